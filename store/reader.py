"""Reading one table version: tensors sliced by manifest offsets (no tar parsing) - from a shard map when the
reader scans a shard (no copy), else from one pread of the sample's bytes into a buffer of its own -, random
access by key, files, and the checks on read.

`TableReader` is the manifest side (store/reader_manifest.py: keys, meta, columns, rank/epoch order, over
store/manifest_view.py) plus the samples' bytes, composed of the shard files (store/shard_io.py) and the sample
check (store/sample_check.py); the tensors are views of those bytes (store/sample_tensors.py). The check-ahead
thread (store/check_ahead.py) uses the same sample check through a shard reader of its own. A reader is a context
manager: `close()` ends its check-ahead thread and closes its descriptors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import pyarrow as pa

from store import integrity
from store.check_ahead import DEFAULT_WINDOW, CheckAhead
from store.integrity import DamagedData
from store.manifest_view import ManifestView
from store.reader_manifest import ReaderManifest
from store.remote_shards import ensure_local
from store.sample_check import SampleCheck
from store.sample_tensors import layout_tensors, member_tensors
from store.shard_io import DEFAULT_MAX_OPEN_SHARDS, ShardFiles

if TYPE_CHECKING:  # imported where tensors are made: the store's commands that read no tensor start without it
    import torch


class TableReader(ReaderManifest):
    """on_damaged="stop": a damaged sample, or a missing / short shard, raises `DamagedData` (on open for the
    shards, on the sample's first read for its bytes). "skip": open succeeds; `damaged(key)` tells which samples
    cannot be read, and reading one still raises."""

    def __init__(self, vdir: Path, table: str, version: int, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                 on_damaged: str = "stop", *, view: ManifestView | None = None, records_damage: bool = True) -> None:
        super().__init__(view if view is not None else ManifestView.open(vdir, table, version))
        self.shards = ShardFiles(vdir, max_open_shards)
        bad_shards = integrity.shard_problems(
            vdir, pa.table({"shard": self.view.column("shard"), "shard_nbytes": self.view.column("shard_nbytes")}),
            self.view.sums)
        self.view.forget("shard_nbytes")  # only the open-time size check reads it
        self.checks = SampleCheck(self.view, bad_shards, records_damage)
        self.salvages = False  # `store repair`'s: the intact samples of a cut (or grown) shard are served
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

    bad_shards = property(lambda self: self.checks.bad_shards)
    max_open_shards = property(lambda self: self.shards.max_open)

    # ------------------------------------------------------------ checked bytes

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
            elif problem is not None and self.shards.lazy:
                problem = None  # read here: the thread's descriptor may be of a damaged cached copy dropped since
        if problem is None:  # a bad shard's intact samples are still checked byte by byte
            got, problem = self._read_bytes(i, shard, start, n)
        if problem is not None and self.shards.drop_damaged_copy(shard, problem):
            # the node's cached copy of a store URL's shard was at fault: the sample is read again from the URL
            got, problem = self._read_bytes(i, shard, start, n)
        if problem is not None:
            if self._ahead is not None:
                self._ahead.damaged(i)
            raise check.refuse(i, shard, problem)
        check.mark_checked(i)
        return got

    def _read_bytes(self, i: int, shard: str, start: int, n: int) -> tuple[Any, str | None]:
        """(buffer and where shard offset 0 lies in it, None), or (None, what is wrong with them)."""
        got = self.shards.sample(shard, start, n)
        if isinstance(got, str):
            return None, got
        if not self.checks.is_checked(i):
            return got, self.checks.bytes_problem(i, got[0], start + got[1], n)
        return got, None

    def _intact_bytes(self, i: int) -> tuple[Any, int]:
        """Checked bytes of a sample in a shard that is whole (a bad shard's samples are not served, but by a
        `salvages` reader: its own bytes, each sample checked against its checksum)."""
        got = self._checked_bytes(i)
        shard = self.view.samples.shard_of(i)
        if shard in self.checks.bad_shards and not self.salvages:
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

    # ------------------------------------------------------------ tensors and files

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        return self.tensors_at(self.view.keys.index(key))

    def tensors_at(self, i: int) -> dict[str, torch.Tensor]:
        """The sample's tensors: views of the shard map during a scan, else of the sample's own buffer."""
        buf, base = self._intact_bytes(i)
        _, start, _ = self.view.samples.locate(i)
        found = member_tensors(buf, start + base)
        if found is not None:
            return found
        return layout_tensors(buf, base, self.view.cell("tensors", i))  # no safetensors member first: hand-written

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
        return self.meta_and_files_of(keys, (), damaged)[1]

    def meta_and_files_of(self, keys: Iterable[str], columns: Iterable[str], damaged: dict[str, str] | None = None
                          ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, bytes]]]:
        """(`meta_of(keys, columns)`, `files_of(keys, damaged)`) from one read of those rows (evaluate's captions and
        pictures): the two apart decode the row groups holding the rows twice."""
        rows = {k: self.view.keys.index(k) for k in keys}
        cells = self.view.rows_at(rows.values(), [*columns, "files"])
        meta: dict[str, dict[str, Any]] = {}
        out: dict[str, dict[str, bytes]] = {}
        for k, i in rows.items():
            layout = cells[i].pop("files")
            meta[k] = cells[i]
            try:
                out[k] = self._files_at(i, layout)
            except DamagedData as e:
                if damaged is None:
                    raise
                damaged[k], out[k] = str(e), {}
        return meta, out

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

    def close(self) -> None:
        self.stop_check_ahead()
        self.shards.close()
