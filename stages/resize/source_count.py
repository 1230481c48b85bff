"""How many samples a source holds, counted cheaply before reading it, so resize-bucket's bar has a total
and an ETA. A count, not a read: a folder's target images, a tar's distinct member keys (headers only), a
JSONL manifest's non-blank lines, a parquet source's rows (from the footers). Shards at URLs are not
counted (it would take a pass over them), unless every one is carried unread (counted by its record): the bar then
runs without a total. Problem entries found while reading (orphan files, unreadable tars) can
make the real number differ a little; the bar's total is corrected at the end."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from stages.resize import folder_source, jsonl_source, sources, webdataset_source
from stages.resize.jsonl_text import manifest_lines
from store.remote import is_url


def count_samples(source: str | Path, fmt: str, known: Any = None) -> int | None:
    """Expected samples, or None when counting fails (the bar then runs without a total). `known`
    (known_tars.KnownTars): a tar carried unread is counted by its record, not opened."""
    try:
        if fmt == "folder":
            layout = folder_source.folder_layout(Path(source))  # the listing is cached: no second scan of the disk
            return len(layout.targets) + len(folder_source.folder_leftovers(Path(source), layout))
        if fmt == "parquet":
            from stages.resize.parquet_source import count_rows

            return count_rows(source if is_url(source) else Path(source))
        if fmt == "webdataset":
            tars = sources.shard_urls(source)
            # a tar at a URL is counted by its record when carried, else not (its headers would be fetched)
            if any(is_url(t) for t in tars) and (known is None or any(known.count(t) is None for t in tars)):
                return None
            total = 0
            # a header walk per shard: minutes over a million samples, so it has its own bar
            for tar in tqdm(tars, desc="counting samples", unit="shard", leave=False):
                if known is not None and (n := known.count(tar)) is not None:
                    total += n
                    continue
                with tarfile.open(tar, mode="r:") as tf:  # uncompressed tar: seeks header to header
                    total += len({webdataset_source.split_member(m.name)[0] for m in webdataset_source.tar_headers(tf)
                                  if m.isfile() and not webdataset_source.dot_member(m.name)})
            return total
        return sum(1 for _, line in manifest_lines(jsonl_source.jsonl_path(Path(source))) if line.strip())
    except (OSError, tarfile.TarError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        return None
