"""The one progress bar over bytes (hashing model files, checksumming, pushing, pulling, verifying, writing a merged
transformer): KiB / MiB / GiB alike everywhere, so a local and a URL store's verify of the same version count the
same figures. Here because models/, store/ and pipeline/ all may import schemas/."""

from __future__ import annotations


def byte_bar(total: int, desc: str, *, disable: bool = False):
    """A tqdm bar counting `total` bytes in powers of 1024, its width following the terminal's."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                disable=disable)
