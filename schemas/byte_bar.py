"""The one progress bar over bytes (hashing model files, checksumming, pushing, pulling, verifying, writing a merged
transformer): its count, total and rate in the package's one size rule (`schemas.units.size_text`: KiB, MiB, GiB,
TiB), as the summaries after it say them, so a local and a URL store's verify of the same version count the same
figures: `1.5 MiB/3072.0 MiB [00:02<01:10, 43.1 MiB/s]` (a 3 GiB total: GiB only from 10000 MiB). tqdm's own
scaling read its count in powers of 1024 and its rate in powers of 1000 under the same letters (`1.50M/3.00G`,
`11.3MB/s`). tqdm.auto's bar, as every other bar of the package: a widget in Jupyter, text in a terminal. Here
because models/, store/ and pipeline/ all may import schemas/."""

from __future__ import annotations

from functools import cache

from schemas.units import size_text

BAR_FORMAT = "{l_bar}{bar}| {done}/{size} [{elapsed}<{remaining}, {speed}{postfix}]"


def byte_bar(total: int, desc: str, *, disable: bool = False):
    """A tqdm.auto bar counting `total` bytes, its figures in `size_text`'s units, its width following the
    terminal's."""
    from tqdm.auto import tqdm  # (imported here: the bar is made only where bytes are counted)

    return _sized(tqdm)(total=total, desc=desc, unit="B", bar_format=BAR_FORMAT, dynamic_ncols=True,
                        disable=disable)


@cache
def _sized(base: type) -> type:
    """`base` (tqdm.auto's class: a notebook's or a terminal's) whose fields add `done`, `size` and `speed`."""

    class SizedBar(base):
        @property
        def format_dict(self):
            fields = super().format_dict
            n, elapsed, rate = fields.get("n") or 0, fields.get("elapsed") or 0, fields.get("rate")
            if rate is None and elapsed:  # tqdm's own fallback (and its close): the whole run's rate
                rate = (n - (fields.get("initial") or 0)) / elapsed
            total = fields.get("total")
            fields.update(done=size_text(n), size="?" if total is None else size_text(total),
                          speed=f"{size_text(rate)}/s" if rate else "?B/s")
            return fields

    return SizedBar
