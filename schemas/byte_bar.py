"""The one progress bar over bytes (hashing model files, checksumming, pushing, pulling, verifying, writing a merged
transformer): counted in powers of 1024 alike everywhere, so a local and a URL store's verify of the same version
count the same figures. tqdm labels those powers with its SI letters: `1.50M/3.00G`, `11.3MB/s` mean MiB, GiB and
MiB/s. tqdm.auto's bar, as every other bar of the package: a widget in Jupyter, text in a terminal. Here because
models/, store/ and pipeline/ all may import schemas/."""

from __future__ import annotations


def byte_bar(total: int, desc: str, *, disable: bool = False):
    """A tqdm.auto bar counting `total` bytes in powers of 1024 (labelled k / M / G), its width following the
    terminal's."""
    from tqdm.auto import tqdm  # (imported here: the bar is made only where bytes are counted)

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                disable=disable)
