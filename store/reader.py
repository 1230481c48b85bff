"""Reading one table version: tensors sliced by manifest offsets (no tar parsing) - from a shard map when the
reader scans a shard (no copy), else from one pread of the sample's bytes into a buffer of its own -, random
access by key, meta, img_shapes (derived on the fly for schema v1), rank/epoch iteration order.

`TableReader` composes three parts, each with a public interface: the manifest (store/manifest_view.py: its
`keys`, store/key_index.py, and `samples`, store/sample_locator.py), the shard files (store/shard_io.py) and the
sample check (store/sample_check.py); the check-ahead thread (store/check_ahead.py) uses the same sample check
through a shard reader of its own. A reader is a context manager: `close()` ends its check-ahead thread and closes
its descriptors.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from schemas.img_shapes import ImgShape
from store import integrity
from store.check_ahead import DEFAULT_WINDOW, CheckAhead
from store.integrity import DamagedData
from store.manifest_view import ManifestView
from store.partition import epoch_positions
from store.remote_shards import ensure_local
from store.sample_check import SampleCheck
from store.shard import SAFETENSORS_NAMES
from store.shard_io import DEFAULT_MAX_OPEN_SHARDS, ShardFiles

if TYPE_CHECKING:  # imported where tensors are made: the store's commands that read no tensor start without it
    import torch


@cache  # per tensor of every sample read
def torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UserError(f"unknown tensor dtype {name!r} in manifest")
    return dt


_TAR_BLOCK = 512


def member_tensors(buf: Any, at: int) -> dict[str, torch.Tensor] | None:
    """The tensors of a sample whose first tar member (header at `at` in `buf`) is its `.safetensors` file, as
    views of `buf`, from that file's own (checked) header; None when the first member is something else.

    Read from the sample's bytes rather than from the manifest's `tensors` column: that column, parsed, is the
    largest thing a reader holds (~400 MB per process at 1M samples), and the bytes are read anyway."""
    with memoryview(buf) as mv:
        name = bytes(mv[at : at + 100]).split(b"\0", 1)[0]
        if not name.endswith(b".safetensors"):
            return None
        data = at + _TAR_BLOCK
        n = int.from_bytes(mv[data : data + 8], "little")
        header = json.loads(bytes(mv[data + 8 : data + 8 + n]))
    first = data + 8 + n
    import torch

    out = {}
    for tname, meta in header.items():
        if tname == "__metadata__":
            continue
        dt = torch_dtype(SAFETENSORS_NAMES[meta["dtype"]])
        begin, end = meta["data_offsets"]
        count = (end - begin) // dt.itemsize
        if count == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
            out[tname] = torch.empty(meta["shape"], dtype=dt)
            continue
        out[tname] = torch.frombuffer(buf, dtype=dt, count=count, offset=first + begin).view(meta["shape"])
    return out


class TableReader:
    """on_damaged="stop": a damaged sample, or a missing / short shard, raises `DamagedData` (on open for the
    shards, on the sample's first read for its bytes). "skip": open succeeds; `damaged(key)` tells which samples
    cannot be read, and reading one still raises."""

    def __init__(self, vdir: Path, table: str, version: int, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                 on_damaged: str = "stop", *, view: ManifestView | None = None, records_damage: bool = True) -> None:
        self.view = view if view is not None else ManifestView.open(vdir, table, version)
        self.dir, self.table, self.version = vdir, table, version
        self.shards = ShardFiles(vdir, max_open_shards)
        bad_shards = integrity.shard_problems(
            vdir, pa.table({"shard": self.view.column("shard"), "shard_nbytes": self.view.column("shard_nbytes")}),
            self.view.sums)
        self.view.forget("shard_nbytes")  # only the open-time size check reads it
        self.checks = SampleCheck(self.view, bad_shards, records_damage)
        self._ahead: CheckAhead | None = None
        if bad_shards and records_damage:
            integrity.record_damage(vdir, self.checks.shard_damage(), shards=bad_shards)
        if bad_shards and on_damaged == "stop":
            raise DamagedData(f"{integrity.where(vdir)}: {next(iter(bad_shards.values()))}"
                              + (f" (and {len(bad_shards) - 1} more shards)" if len(bad_shards) > 1 else "")
                              + f"; {integrity.repair_hint(vdir)}")

    @classmethod
    def over_manifest(cls, vdir: Path, table: str, version: int, manifest: pa.Table) -> "TableReader":
        """A reader that skips damage (on_damaged="skip") over a given manifest table, e.g. one `store repair`
        rebuilt from the shard indexes (it writes its own damage record); schema.json is read as it is."""
        return cls(vdir, table, version, on_damaged="skip", view=ManifestView.over(vdir, table, version, manifest),
                   records_damage=False)

    def __enter__(self) -> "TableReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the manifest (store/manifest_view.py)

    schema = property(lambda self: self.view.schema)
    checksummed = property(lambda self: self.view.checksummed)
    key_array = property(lambda self: self.view.keys.array)
    keys_sorted = property(lambda self: self.view.keys.sorted)
    is_v1 = property(lambda self: self.view.is_v1)
    manifest = property(lambda self: self.view.manifest)
    bad_shards = property(lambda self: self.checks.bad_shards)
    max_open_shards = property(lambda self: self.shards.max_open)

    def column(self, name: str) -> pa.Array:
        return self.view.column(name)

    def has_column(self, name: str) -> bool:
        return self.view.has_column(name)

    def __len__(self) -> int:
        return len(self.view)

    def __contains__(self, key: str) -> bool:
        return self.view.keys.row_of(key) is not None

    def row_of(self, key: str) -> int | None:
        return self.view.keys.row_of(key)

    def rows_of_keys(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Each key's row number, -1 where the table lacks it (store/key_index.py), for whole columns of keys: take
        another table's rows' values from this one with `column(name).take(...)`, not `meta(key)` row by row."""
        return self.view.keys.rows_of_keys(keys)

    def keys(self) -> list[str]:
        return list(self.view.keys.as_list())

    def meta_columns(self) -> list[str]:
        return self.view.meta_columns()

    def meta(self, key: str) -> dict[str, Any]:
        return self.view.meta_at(self.view.keys.index(key))

    def meta_of(self, keys: Iterable[str], columns: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The named meta columns of a few keys (e.g. evaluate's captions), reading only those rows and columns and
        keeping nothing (`ManifestView.rows_at`); `meta(key)` is for walks over the table: it keeps every meta
        column parsed. A key the table lacks is a UserError, as in `meta`."""
        rows = {k: self.view.keys.index(k) for k in keys}
        got = self.view.rows_at(rows.values(), columns)
        return {k: got[i] for k, i in rows.items()}

    def img_shapes(self, key: str) -> list[ImgShape]:
        return self.view.img_shapes_at(self.view.keys.index(key))

    def img_shapes_at(self, i: int) -> list[ImgShape]:
        return self.view.img_shapes_at(i)

    # ------------------------------------------------------------ bytes

    def shard_map(self, shard: str):
        """The shard's private (copy-on-write) map (store/shard_io.py). A shard found missing or of the wrong
        size on open raises `DamagedData` naming the repair command."""
        if shard in self.checks.bad_shards:
            raise self.checks.refuse_shard(shard)
        return self.shards.map(shard)

    def prepare_checks(self) -> None:
        self.view.samples.prepare_checks()

    def _checked_bytes(self, i: int) -> tuple[Any, int]:
        """Sample i's bytes as (buffer, where shard offset 0 lies in it), checked against their checksum on the
        reader's first read of the sample (the store is immutable, and the private map never sees a consumer's
        writes to a tensor view). Raises `DamagedData` naming the sample and the repair command."""
        shard, start, n = self.view.samples.locate(i)
        check = self.checks
        problem = check.shard_problem(shard, start, n)
        if problem is None and not check.is_checked(i) and self._ahead is not None:
            # The check-ahead thread verified these bytes of the (immutable) shard by its own reads.
            done, problem = self._ahead.take(i)
            if done and problem is None:
                check.mark_checked(i)
        if problem is None:  # a bad shard's intact samples are still checked byte by byte
            got = self.shards.sample(shard, start, n)
            if isinstance(got, str):
                problem = got
            elif not check.is_checked(i):
                problem = check.bytes_problem(i, got[0], start + got[1], n)
        if problem is not None:
            if self._ahead is not None:
                self._ahead.damaged(i)
            raise check.refuse(i, shard, problem)
        check.mark_checked(i)
        return got

    def _intact_bytes(self, i: int) -> tuple[Any, int]:
        """Checked bytes of a sample in a shard that is whole (a bad shard's samples are not served)."""
        got = self._checked_bytes(i)
        shard = self.view.samples.shard_of(i)
        if shard in self.checks.bad_shards:
            raise self.checks.refuse_shard(shard)
        return got

    def check(self, key: str) -> None:
        """Raise `DamagedData` unless the sample's bytes match their checksum (checked once per reader)."""
        self.check_at(self.view.keys.index(key))

    def check_at(self, i: int) -> None:
        if not self.checks.is_checked(i):
            self._checked_bytes(i)

    def check_ahead(self, order: Iterable[int], window: int = DEFAULT_WINDOW) -> CheckAhead:
        """Check the rows of `order` (the consumer's read order, may be endless) in a background thread, at most
        `window` rows ahead of the consumer (store/check_ahead.py); `check_at` then only waits for a row's result.
        Replaces a running check-ahead; `stop_check_ahead` or `close` ends it."""
        self.stop_check_ahead()
        self.view.samples.prepare_checks()  # columns parsed here, in the consumer's thread; the thread only reads them
        self._ahead = CheckAhead(self.checks, self.shards.dir, order, window, name=self.table)
        return self._ahead

    def stop_check_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def damaged(self, key: str) -> str | None:
        """None if the sample reads back intact, else what is wrong (does not raise)."""
        return self.damaged_at(self.view.keys.index(key))

    def damaged_at(self, i: int) -> str | None:
        try:
            self.check_at(i)
        except DamagedData as e:
            return str(e)
        return None

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        return self.tensors_at(self.view.keys.index(key))

    def tensors_at(self, i: int) -> dict[str, torch.Tensor]:
        """The sample's tensors: views of the shard map during a scan, else of the sample's own buffer."""
        buf, base = self._intact_bytes(i)
        _, start, _ = self.view.samples.locate(i)
        found = member_tensors(buf, start + base)
        if found is not None:
            return found
        import torch

        out = {}  # no safetensors member first (a hand-written store): the manifest's layout
        for t in self.view.cell("tensors", i):
            dt = torch_dtype(t["dtype"])
            n = t["nbytes"] // dt.itemsize
            if n == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
                out[t["name"]] = torch.empty(t["shape"], dtype=dt)
                continue
            out[t["name"]] = torch.frombuffer(buf, dtype=dt, count=n, offset=t["offset"] + base).view(t["shape"])
        return out

    def files(self, key: str) -> dict[str, bytes]:
        """The sample's files, located by the `files` column (parsed whole and kept on first use: for walks over
        the table, as the encoders make; for a few samples, `files_of`)."""
        i = self.view.keys.index(key)
        return self._files_at(i, self.view.cell("files", i))

    def files_of(self, keys: Iterable[str], damaged: dict[str, str] | None = None) -> dict[str, dict[str, bytes]]:
        """The files of a few keys (evaluate's pictures), their `files` cells read for those rows only and kept
        nowhere (`ManifestView.rows_at`): `files(key)` parses and keeps the whole column (~95 MB at 1M samples).
        A damaged sample raises `DamagedData`, or, given `damaged`, is recorded there (key -> what is wrong) with
        no files. A key the table lacks is a UserError, as in `files`."""
        from store.integrity import DamagedData

        rows = {k: self.view.keys.index(k) for k in keys}
        cells = self.view.rows_at(rows.values(), ["files"])
        out: dict[str, dict[str, bytes]] = {}
        for k, i in rows.items():
            try:
                out[k] = self._files_at(i, cells[i]["files"])
            except DamagedData as e:
                if damaged is None:
                    raise
                damaged[k], out[k] = str(e), {}
        return out

    def _files_at(self, i: int, layout: list[dict[str, Any]]) -> dict[str, bytes]:
        """Row i's files, `layout` its `files` cell (name, offset in the shard, size)."""
        buf, base = self._intact_bytes(i)
        with memoryview(buf) as mv:
            return {f["name"]: bytes(mv[f["offset"] + base : f["offset"] + base + f["nbytes"]]) for f in layout}

    def get(self, key: str) -> dict[str, Any]:
        return {"key": key, "meta": self.meta(key), "tensors": self.tensors(key), "files": self.files(key)}

    def shard_paths(self) -> list[Path]:
        """The shard files, for a tar reader such as `webdataset.WebDataset`. In a lazily cached version of a store
        at a URL each is fetched whole (checked) first: the caller opens the paths itself, past the reader's
        fetch-on-miss (UserError when one cannot be: damaged on the server, no room in the cache)."""
        return [ensure_local(self.dir / s) for s in dict.fromkeys(self.view.values("shard"))]

    # ------------------------------------------------------------ iteration

    def rows_of(self, split: str | None) -> np.ndarray:
        """Row numbers of one split (every row for None)."""
        if split is None:
            return np.arange(len(self), dtype=np.int64)
        return split_rows(self.column("split") if self.has_column("split") else None, split,
                          f"table '{self.table}' v{self.version} ({self.dir})")

    def by_shard(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`rows` grouped by shard - shards in name order, rows in row order within one - and each group's size
        (no empty groups): the stored order of `iter_keys`, as numbers."""
        idx, names = self.view.samples.shard_numbers()
        rank_of = {name: i for i, name in enumerate(sorted(set(names)))}
        group = np.asarray([rank_of[n] for n in names], dtype=np.int64)[idx[rows]] if len(rows) else \
            np.zeros(0, np.int64)
        order = np.lexsort((rows, group))
        sizes = np.bincount(group, minlength=len(rank_of))
        return rows[order], sizes[sizes > 0]

    def shard_groups(self, split: str | None = None) -> list[list[str]]:
        """Keys grouped by shard (in shard order, then key order), optionally only one split."""
        rows, sizes = self.by_shard(self.rows_of(split))
        keys = self.key_array.take(pa.array(rows)).to_pylist()
        ends = np.cumsum(sizes).tolist()
        return [keys[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def iter_keys(
        self, split: str | None = None, rank: int = 0, world_size: int = 1,
        seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """This rank's keys for one epoch (see store.partition): disjoint across ranks, nothing lost."""
        return self.epoch_keys(self.rows_of(split), rank, world_size, seed, epoch, buffer_size)

    def epoch_keys(
        self, rows: np.ndarray, rank: int = 0, world_size: int = 1,
        seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """`iter_keys` of the given rows: the order is worked out on row numbers and only this rank's share
        becomes str keys (every rank's would be ~1M str and lists of them per rank at 1M samples)."""
        rows, sizes = self.by_shard(np.asarray(rows, dtype=np.int64))
        mine = rows[epoch_positions(sizes, rank, world_size, seed, epoch, buffer_size)]
        return self.key_array.take(pa.array(mine)).to_pylist()

    def close(self) -> None:
        self.stop_check_ahead()
        self.shards.close()


def split_rows(column: pa.Array | pa.ChunkedArray | None, split: str, table: str) -> np.ndarray:
    """Row numbers of one split from a table's `split` column (None: the table has none, `table` names it), for a
    reader and for a bare manifest alike."""
    if column is None:
        raise UserError(f"{table} has no split column; rebuild it with the current code")
    return np.flatnonzero(pc.fill_null(pc.equal(column, split), False).to_numpy(zero_copy_only=False))
