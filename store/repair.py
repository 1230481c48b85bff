"""`pipeline store repair STORE [--dry-run]`: recompute exactly the damaged samples into a new version.

Per table (current version v<N>, in the order the caller gives: images, text, vae):
  1. scan: every shard file against checksums.json (a full read, as `store verify`), and the samples of the
     shards that fail it each against its own checksum (which are still intact); a shard that passes holds the
     very bytes its samples' checksums were taken of, so they are not read twice; a damaged manifest is rebuilt
     from the intact per-shard indexes; counts sealed in checksums.json that are not the manifest's (a writer's
     bug) need the version written again (every shard carried: its commit counts the rows afresh);
  2. mark v<N> damaged (`<table>/v<N>.damaged.json`, outside the immutable folder): `find_version` never
     reuses it, so the producing stage no longer calls it "up to date";
  3. open a writer with v<N>'s exact schema (a new v<M>, or the one a killed repair left): intact shards are
     hard-linked with their rows, the intact samples of damaged shards re-added from their verified bytes;
  4. the producing stage, run with the same config and model, resumes v<M> and so computes only the damaged
     samples (given as `recompute(table, schema)` by the CLI, which knows the stages); it commits v<M>. Where
     v<N> was made by an earlier revision of the stage (a fix made since), the samples it recomputes are this
     revision's: it writes a version of its own lineage instead (store/repair_context.py `supersede`: the damaged
     samples and those the fixes change recomputed, the rest carried), which replaces v<N>; v<M> is removed;
  5. verify v<M>. What cannot be repaired (schema.json or checksums.json damaged, no stage to recompute with,
     a stage whose settings differ) is named and left as it is.
Also: a damaged store.json is rebuilt (each table -> its newest intact complete version), and temp files left
in complete versions by killed writes are removed. A store.json, or a current version's checksums.json or
schema.json, that a newer release wrote (`schemas.newer`) is not damage: the scan refuses the store whole
(`WrittenByNewer`) before anything is changed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa

from schemas import atomic_write
from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from schemas.table import TableSchema
from schemas.temp_files import writer_alive
from schemas.units import count_text
from store import format as fmt
from store import integrity, quarantine, repair_context, version_counts
from store.checksum import file_crc
from store.io_errors import writing
from store.manifest import merge_measured, rows_by_shard
from store.manifest_files import read_schema
from store.reader import TableReader
from store.remote_shards import fetch_problem, is_lazy
from store.verify import verify_version

DAMAGED_SUFFIX = fmt.SET_ASIDE_SUFFIX  # `v<N>.damaged/`: not a version name, so every reader and writer ignores it


@dataclass
class TablePlan:
    table: str
    version: int
    samples: int = 0
    damaged: dict[str, str] = field(default_factory=dict)  # key -> problem
    intact_shards: list[str] = field(default_factory=list)  # hard-linked as they are
    copied: list[str] = field(default_factory=list)  # intact samples of damaged shards, re-added
    manifest_rebuilt: bool = False
    # why the manifest did not read (then rebuilt, or unrepairable): the line a reader's read of it meets and records
    manifest_problem: str | None = None
    unrepairable: str | None = None
    new_version: int | None = None
    # damaged files the manifest makes redundant (shard indexes, rank-NN.done): a new version gets fresh ones
    derived_damaged: list[str] = field(default_factory=list)
    # shards with bytes appended after their recorded end (every sample intact): carried as their first N bytes
    trimmed: dict[str, int] = field(default_factory=dict)
    # counts sealed in checksums.json that are not the manifest's (a writer's bug): the new version's commit counts
    # its rows afresh (every shard carried, nothing recomputed)
    counts_differ: list[str] = field(default_factory=list)
    # the repaired version is the stage's current revision's (v<N> an earlier one's: `repair_context.supersede`)
    superseded: bool = False

    @property
    def needs_repair(self) -> bool:
        return self.unrepairable is None and bool(self.damaged or self.copied or self.manifest_rebuilt
                                                  or self.derived_damaged or self.trimmed or self.counts_differ)


@dataclass
class RepairPlan:
    root: Path
    store_json: str | None = None  # problem with store.json (rebuilt from the versions on disk)
    current: dict[str, int] = field(default_factory=dict)
    litter: list[Path] = field(default_factory=list)
    tables: list[TablePlan] = field(default_factory=list)
    quarantine: str | None = None  # what is wrong with quarantine.parquet (then set aside)


# ---------------------------------------------------------------- scanning


def _intact_version(vdir: Path) -> bool:
    try:
        sums = integrity.read_version_checksums(vdir)
        integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums)
        integrity.read_checked(vdir, fmt.MANIFEST, sums)
        return True
    except WrittenByNewer:
        raise
    except UserError:
        return False


def _current_versions(root: Path) -> tuple[dict[str, int], str | None]:
    try:
        rec = fmt.read_store_record(root)
        return {t: int(v["current"]) for t, v in rec["tables"].items()}, None
    except WrittenByNewer:  # a newer release's store: rebuilt in this format, its good record would be lost
        raise
    except UserError as e:
        found = {}
        for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            done = [v for v in fmt.list_versions(root, d.name) if fmt.is_complete(fmt.version_dir(root, d.name, v))]
            intact = [v for v in done if _intact_version(fmt.version_dir(root, d.name, v))]
            if intact or done:
                found[d.name] = (intact or done)[-1]
        return found, str(e)


def _manifest(vdir: Path, sums: dict | None, plan: TablePlan) -> tuple[pa.Table | None, dict[str, tuple[str, int]]]:
    """The version's manifest; a damaged one is rebuilt from the per-shard indexes when they are intact. With it,
    the (crc32c, nbytes) of each index a rebuild read (file name ->), for the scan's later checks: no index is read
    twice (on a shared file system each read is an open and round trips, ~20-30k indexes at 1M samples)."""
    try:
        from store.manifest_files import read_manifest

        return read_manifest(vdir, integrity.read_checked(vdir, fmt.MANIFEST, sums)), {}
    except UserError as e:
        plan.manifest_problem = str(e)
        indexes = sorted(vdir.glob("shard-r*-*.index.parquet"))
        try:
            if not indexes:
                raise UserError("no shard indexes")
            plan.manifest_rebuilt = True
            # checked against checksums.json from the very bytes the merge then parses
            return merge_measured(indexes, check=None if sums is None else
                                  lambda p, measured: integrity.check_measured(vdir, p.name, measured, sums))
        except UserError as e2:
            plan.unrepairable = f"manifest damaged ({e}) and cannot be rebuilt from the shard indexes ({e2})"
            return None, {}


def scan_table(root: Path, table: str, version: int, progress: bool = True) -> TablePlan:
    from tqdm import tqdm

    plan = TablePlan(table, version)
    vdir = fmt.version_dir(root, table, version)
    if not fmt.is_complete(vdir):
        plan.unrepairable = f"v{version} is missing or incomplete; {integrity.missing_version_hint(vdir)}"
        return plan
    try:
        record = integrity.read_version_record(vdir)
        sums = None if record is None else record["files"]
        read_schema(vdir, integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums), intact=sums is not None)
    except WrittenByNewer:  # a newer release's version: not this code's to judge, let alone recompute
        raise
    except UserError as e:
        plan.unrepairable = str(e)  # the advice in it says which stage to rerun (integrity.repair_hint)
        return plan
    manifest, measured = _manifest(vdir, sums, plan)
    if manifest is None:
        return plan
    if sums is None and {"sample_crc32c", "shard_crc32c"} & set(manifest.column_names):
        plan.unrepairable = (f"{fmt.CHECKSUMS} is missing, so its manifest cannot be trusted (rerun the stage that "
                             "writes it: a new version)")
        return plan
    if record is not None and (recorded := version_counts.shown(record.get("counts"))) is not None:
        plan.counts_differ = version_counts.differences(recorded,
                                                        version_counts.shown(version_counts.counted(manifest)) or {})
    reader = _reader_on(vdir, table, version, manifest)
    plan.samples = len(reader)
    shards_with_damage: set[str] = set(reader.bad_shards)
    shard_col = reader.manifest.column("shard").to_pylist()
    shards = set(shard_col)  # once: rebuilt per checksums entry, it made the scan O(shards x samples)
    listed = [(s, sums[s]) for s in sorted(shards - shards_with_damage) if sums is not None and s in sums]
    damaged_whole, read_once = _whole_shards(vdir, f"{table}/v{version}", listed, _as_written(manifest, sums),
                                             progress)
    shards_with_damage |= damaged_whole
    keys = reader.keys()
    # Only the samples of shards not shown intact whole are read again, to tell their intact samples from the
    # damaged: a shard whose file is its CRC's bytes holds exactly the bytes each sample's CRC was taken of.
    rows = [i for i, s in enumerate(shard_col) if s not in read_once]
    for i in tqdm(rows, desc=f"scan {table}/v{version}", unit="sample", disable=not progress or not rows):
        problem = reader.damaged_at(i)  # by row: no key lookup per sample
        if problem is not None:
            plan.damaged[keys[i]] = problem
            shards_with_damage.add(shard_col[i])
    for shard in sorted(shards_with_damage - {s for k, s in zip(keys, shard_col) if k in plan.damaged}):
        want = sums.get(shard) if sums is not None else None
        if want is not None and _grown_intact(vdir / shard, want):
            plan.trimmed[shard] = want["nbytes"]
    shards_with_damage -= set(plan.trimmed)
    plan.copied = [k for k, s in zip(keys, shard_col) if s in shards_with_damage and k not in plan.damaged]
    if sums is not None:  # without this, verify fails on such a file forever while repair finds nothing to do
        plan.derived_damaged = _derived_damaged(vdir, sums, shards, measured)
    plan.intact_shards = sorted(shards - shards_with_damage - set(plan.trimmed))
    reader.close()
    return plan


def _whole_shards(vdir: Path, name: str, listed: list, as_written: set[str],
                  progress: bool) -> tuple[set[str], set[str]]:
    """Each listed shard's whole file against its checksums.json entry (damage between samples too): (the shards
    that differ, the shards whose file matched as written - their samples need no reading). The scan's long part at
    scale (every byte of the version): its own bar, in bytes, as verify's."""
    damaged, read_once = set(), set()
    with byte_bar(sum(int(want["nbytes"]) for _, want in listed), f"checksum {name}",
                  disable=not progress or not listed) as bar:
        for shard, want in listed:
            found = _whole_crc(vdir / shard)
            if found is None:  # a cached shard not fetched whole: its samples are read by range, each checked
                pass
            elif found != (want["crc32c"], want["nbytes"]):
                damaged.add(shard)
            elif shard in as_written:
                read_once.add(shard)
            bar.update(int(want["nbytes"]))
    return damaged, read_once


def _derived_damaged(vdir: Path, sums: dict, shards: set[str], measured: dict) -> list[str]:
    """The version's other listed files (shard indexes, rank-done files) that fail their entry; in a store URL's
    cached copy fetched first: one deleted on the node is no damage (the URL holds it)."""
    derived = {n: e for n, e in sums.items() if n not in (fmt.MANIFEST, fmt.SCHEMA_JSON) and n not in shards}
    return sorted(n for n, e in derived.items() if fetch_problem(vdir / n) is not None or not (vdir / n).is_file()
                  or (measured.get(n) or file_crc(vdir / n)) != (e["crc32c"], e["nbytes"]))


def _whole_crc(path: Path) -> tuple[str, int] | None:
    """(crc32c, size) of a shard file; in a store URL's cached copy fetched whole first, as verify fetches it, and
    None where it cannot be (no room in the cache, damaged on the server, evicted meanwhile): the reader then reads
    its samples by range, each checked. (A missing local shard is the reader's `bad_shards`, never listed here.)"""
    if fetch_problem(path) is not None:
        return None
    try:
        return file_crc(path)
    except FileNotFoundError:
        if is_lazy(path.parent):
            return None
        raise


def _as_written(manifest: pa.Table, sums: dict | None) -> set[str]:
    """The shards whose samples need no read of their own once the whole file matches its checksums.json entry:
    that entry is the CRC32C the writer took of the shard as it wrote it (the manifest's `shard_crc32c`, equal to
    it), so a match means the bytes each sample's CRC was taken of, with the same guarantee (every flipped bit,
    every burst up to 32 bits; other damage missed once in 2^32); and every row's sample range lies inside the
    recorded size (the only thing the per-sample read checked beyond the CRC). Read sample by sample, as before:
    a format-1 version (no checksums.json), a shard whose entry was measured from the file at commit (one a
    format-1 writer began: no `shard_crc32c`), rows that disagree about their shard, a range the file cannot hold."""
    import pyarrow.compute as pc

    if sums is None or manifest.num_rows == 0 or "shard_crc32c" not in manifest.column_names:
        return set()
    # in Arrow: a million rows one by one in Python cost seconds
    recorded: dict[str, list[tuple]] = {}
    for r in manifest.select(["shard", "shard_crc32c", "shard_nbytes"]).group_by(
            ["shard", "shard_crc32c", "shard_nbytes"]).aggregate([]).to_pylist():
        recorded.setdefault(r["shard"], []).append((r["shard_crc32c"], r["shard_nbytes"]))
    start, end = manifest.column("sample_offset"), pc.add(manifest.column("sample_offset"),
                                                          manifest.column("sample_nbytes"))
    outside = pc.or_(pc.less(start, 0), pc.greater(end, manifest.column("shard_nbytes")))
    cannot_hold = set(pc.unique(manifest.column("shard").filter(outside)).to_pylist())
    return {s for s, entries in recorded.items() if s not in cannot_hold and s in sums
            and entries == [(sums[s]["crc32c"], sums[s]["nbytes"])]}


def _grown_intact(path: Path, want: dict) -> bool:
    """The shard is longer than recorded and its first recorded bytes are exactly the recorded ones."""
    import crc32c

    try:
        if path.stat().st_size <= want["nbytes"]:
            return False
        value, left = 0, want["nbytes"]
        with open(path, "rb") as f:
            while left and (chunk := f.read(min(left, 8 << 20))):
                value, left = crc32c.crc32c(chunk, value), left - len(chunk)
        return left == 0 and f"{value:08x}" == want["crc32c"]
    except OSError:
        return False


def _reader_on(vdir: Path, table: str, version: int, manifest: pa.Table) -> TableReader:
    """A reader that skips damage, over a given (possibly rebuilt) manifest, serving the intact samples of a shard
    cut short (each checked against its checksum): the plan copies them, and a plain reader refused every sample
    of such a shard, so a truncated shard was "not repaired", the line advising `store repair` again."""
    reader = TableReader.over_manifest(vdir, table, version, manifest)
    reader.salvages = True
    return reader


def scan(root: Path, progress: bool = True, order: Sequence[str] = ()) -> RepairPlan:
    """What is damaged, table by table: the tables named in `order` first, in that order (the caller knows which
    stage reads which table: features/tables.py), then the others by name."""
    if not (root / fmt.STORE_JSON).is_file() and not any(root.glob("*/v*")):
        raise UserError(f"no store at {root} (no store.json); check the path: repair needs the store folder a "
                        "stage wrote")
    plan = RepairPlan(root)
    plan.current, plan.store_json = _current_versions(root)
    # temp files of a killed atomic write whose writer is gone (store.json's, a table's records beside its versions)
    plan.litter += [p for p in fmt.store_litter(root, plan.current) if not writer_alive(p)]
    plan.quarantine = quarantine.problem(root)
    rank = {t: i for i, t in enumerate(order)}
    for table in sorted(plan.current, key=lambda t: (rank.get(t, len(rank)), t)):
        for v in fmt.list_versions(root, table):
            vdir = fmt.version_dir(root, table, v)
            if fmt.is_complete(vdir):
                plan.litter += [p for p in vdir.iterdir() if fmt.is_litter(p.name)]
        plan.tables.append(scan_table(root, table, plan.current[table], progress))
    return plan


def describe(plan: RepairPlan) -> list[str]:
    lines = []
    if plan.store_json:
        lines.append(f"store.json: {plan.store_json} -> rebuilt naming "
                     + ", ".join(f"{t} v{v}" for t, v in sorted(plan.current.items())) + " (newest intact versions)")
    for p in plan.litter:
        lines.append(f"remove leftover temp file {p}")
    if plan.quarantine:
        lines.append(f"{fmt.QUARANTINE}: {plan.quarantine} -> set aside as {fmt.QUARANTINE}.damaged (the rejected "
                     "inputs it listed are no longer listed; the stages record new rejections in a fresh file)")
    for t in plan.tables:
        name = f"{t.table} v{t.version}"
        if t.unrepairable:
            lines.append(f"{name}: CANNOT REPAIR: {t.unrepairable}")
        elif not t.needs_repair:
            lines.append(f"{name}: intact ({count_text(t.samples, 'sample')})")
        else:
            extra = ", manifest rebuilt from the shard indexes" if t.manifest_rebuilt else ""
            if t.trimmed:
                extra += f", bytes appended after {', '.join(t.trimmed)} dropped (its samples intact)"
            if t.derived_damaged:
                extra += f", damaged {', '.join(t.derived_damaged)} written afresh in the new version"
            if t.counts_differ:
                extra += (f", {fmt.CHECKSUMS}'s counts ({'; '.join(t.counts_differ)}) counted afresh in the new "
                          "version")
            lines.append(f"{name}: {len(t.damaged)} damaged sample(s) to recompute "
                         f"({', '.join(sorted(t.damaged)[:5])}{' …' if len(t.damaged) > 5 else ''}), "
                         f"{len(t.intact_shards)} intact shard(s) carried forward, {len(t.copied)} intact sample(s) "
                         f"of damaged shards copied{extra}")
    return lines


# ---------------------------------------------------------------- applying


Recompute = Callable[[str, TableSchema], None]


def apply(plan: RepairPlan, recompute: Recompute | None, echo: Callable[[str], None] = print) -> list[str]:
    """Carry out the plan; returns what could not be repaired (empty: the store verifies)."""
    from store.store import Store

    root = plan.root
    failed: list[str] = []
    if plan.store_json:
        rec = fmt.new_store_record()
        rec["tables"] = {t: {"current": v} for t, v in plan.current.items()}
        with fmt.flock(root / fmt.STORE_LOCK):
            fmt.write_store_record(root, rec)
        echo("store.json rebuilt")
    for p in plan.litter:
        p.unlink(missing_ok=True)
    if plan.quarantine:
        echo(f"{fmt.QUARANTINE} set aside as {quarantine.set_aside(root).name}")
    st = Store(root, create=False)
    for t in plan.tables:
        if t.unrepairable:
            failed.append(f"{t.table} v{t.version}: {t.unrepairable}")
            continue
        if not t.needs_repair:
            continue
        try:
            t.new_version = _repair_table(st, t, recompute, echo)
        except UserError as e:
            failed.append(f"{t.table} v{t.version}: {e}")
            continue
        # read back in full, as `store verify`: as long as that, so with its bars
        problems = verify_version(st.version_dir(t.table, t.new_version), f"{t.table}/v{t.new_version}")
        if problems:
            failed.append(f"{t.table} v{t.new_version} does not verify: {problems[0]}")
        else:
            aside = set_aside(st.version_dir(t.table, t.version))
            done = ("its damaged samples and those the fixes since change recomputed, the rest carried forward"
                    if t.superseded else f"{len(t.damaged)} recomputed, {t.samples - len(t.damaged)} carried forward")
            echo(f"{t.table}: v{t.version} repaired as v{t.new_version} ({done}); verified. "
                 f"{aside[0].upper()}{aside[1:]}")
    return failed


def set_aside(vdir: Path) -> str:
    """A damaged version, once replaced by one that verifies, leaves the store's version list: renamed to
    `v<N>.damaged/` (kept for inspection until the next `store gc`) - unless a live read lease names it (a training or
    an encoder still reading it, store/lease.py): then it stays where it is, no longer current, and `store gc`
    removes it once its last reader is gone (as gc does for any version a reader holds). Moving it would make
    the running reader's next shard open fail. Decided under the store lock, which `hold` also takes, so a
    lease is either seen here or made after the version left. Returns what happened, for the user."""
    from store.lease import leases

    root, table, version = integrity.store_root(vdir), vdir.parent.name, int(vdir.name.lstrip("v"))
    with fmt.flock(root / fmt.STORE_LOCK):
        if not vdir.is_dir():  # no longer current since the repaired version's commit: a `store gc` meanwhile
            return f"the damaged v{version} was removed meanwhile (`store gc`)"
        readers = [f.describe() for f in leases(root) if f.live and (table, version) in set(f.versions())]
        if readers:
            return (f"the damaged v{version} is still read by {'; '.join(readers)}: left in place (not current); "
                    f"`pipeline store gc {root}` removes it once no reader holds it")
        aside = vdir.with_name(f"{vdir.name}{DAMAGED_SUFFIX}")
        if aside.exists():  # set aside before (a version number reused after a table was rebuilt)
            import shutil

            shutil.rmtree(aside)
        os.rename(vdir, aside)
        atomic_write.fsync_dir(vdir.parent)
    return f"the damaged v{version} was moved to {aside}"


def replace_damaged(st, table: str, new: int, damaged: int, how: str) -> str:
    """The version rebuilt from one recorded as damaged (`how`: "re-rendered", "recomputed") is read back in full
    (as `store verify`) before the damaged one leaves (`set_aside`): the one verify-then-set-aside of the stages.
    Returns what happened, for the user."""
    problems = verify_version(st.version_dir(table, new), f"{table}/v{new}")  # rank 0's alone: with its bars
    if problems:
        raise UserError(f"table '{table}' v{new} ({how} from damaged v{damaged}) does not verify: {problems[0]}; "
                        f"run `pipeline store repair {st.root}`")
    return set_aside(st.version_dir(table, damaged))


def _carry(w, src: Path, by_shard: dict[str, pa.Table]) -> None:
    """Link a shard into the repaired version with its rows (`by_shard`: the manifest's, `rows_by_shard`), unless
    an earlier, killed repair already did."""
    rows = by_shard.get(src.name)
    if rows is not None and rows.num_rows and not set(rows.column("key").to_pylist()) <= w.done_keys:
        w.add_linked_shard(src, rows)


def _carry_trimmed(w, vdir: Path, shard: str, nbytes: int, by_shard: dict[str, pa.Table]) -> None:
    """A shard carried as its recorded bytes only, as a new file (versions are immutable) written in the table's
    `.trim-v<N>/` (`fmt.trim_dir`), linked in, then the folder removed; `store gc` removes one a killed repair left.
    A rerun after a kill rewrites the file afresh: a copy left there may be linked into the repair version already
    (killed before the folder's removal), and writing through it would change that version's shard in place."""
    rows = by_shard.get(shard)
    if rows is None or not rows.num_rows or set(rows.column("key").to_pylist()) <= w.done_keys:
        return  # carried by the killed run
    work = fmt.trim_dir(integrity.store_root(vdir), vdir.parent.name, int(vdir.name.lstrip("v")))
    work.mkdir(exist_ok=True)
    (work / shard).unlink(missing_ok=True)
    with open(vdir / shard, "rb") as src, open(work / shard, "wb") as dst:
        left = nbytes
        while left and (chunk := src.read(min(left, 8 << 20))):
            dst.write(chunk)
            left -= len(chunk)
        dst.flush()  # new bytes, linked in as a carried shard, whose folder fsync makes only names durable
        os.fsync(dst.fileno())
    fmt.crash_point("repair_trimmed")
    fmt.pause_point("repair_trimmed")
    _carry(w, work / shard, by_shard)
    shutil.rmtree(work, ignore_errors=True)


def _repair_table(st, t: TablePlan, recompute: Recompute | None, echo: Callable[[str], None]) -> int:
    vdir = st.version_dir(t.table, t.version)
    schema = read_schema(vdir)
    if t.damaged and recompute is None:
        raise UserError(f"{len(t.damaged)} damaged sample(s) need the stage that wrote them "
                        f"({schema.lineage.stage}): pass --model (and the --config it was built with)")
    with writing(f"the damage marker of table '{t.table}' v{t.version}", vdir):  # a full disk: one line
        integrity.record_damage(vdir, t.damaged, required=True)  # under the damage lock, merged: readers record too
    sums = integrity.read_version_checksums(vdir)
    manifest, _ = _manifest(vdir, sums, TablePlan(t.table, t.version))  # read again: the scan kept no manifest
    assert manifest is not None
    reader = _reader_on(vdir, t.table, t.version, manifest)
    w = st.writer(t.table, schema)
    # each shard's rows from one sort: a filter of the manifest per shard was O(shards x rows), ~1 min at 1M rows
    by_shard = rows_by_shard(manifest) if t.intact_shards or t.trimmed else {}
    try:
        for shard in t.intact_shards:
            _carry(w, vdir / shard, by_shard)
        for shard, nbytes in t.trimmed.items():
            _carry_trimmed(w, vdir, shard, nbytes, by_shard)
        for key in t.copied:
            if key not in w.done_keys:
                s = reader.get(key)  # checked: only intact bytes are copied
                meta = {k: v for k, v in s["meta"].items() if v is not None}
                w.add(key, tensors=s["tensors"], files=s["files"], meta=meta)
        new = w.version
        if not t.damaged:
            return w.commit()
        w.finish_rank()
    finally:
        w.close()
        reader.close()
    # no version named: a stage of a later revision writes its own (`supersede`), known once it ran; the closing
    # "repaired as v<M>" line names the one written
    echo(f"{t.table}: recomputing {len(t.damaged)} damaged sample(s) with {schema.lineage.stage} into a new version")
    assert recompute is not None
    with repair_context.expecting(schema.lineage) as repairing:
        recompute(t.table, schema)
    current = st.tables().get(t.table)
    if repairing.superseded_by is not None and current not in (None, t.version, new) \
            and fmt.is_complete(st.version_dir(t.table, current)) \
            and read_schema(st.version_dir(t.table, current)).lineage == repairing.superseded_by:
        # v<N> was an earlier revision's: the stage wrote this revision's version instead of completing v<new>
        t.superseded = True
        _drop_unfinished(st.version_dir(t.table, new))
        return current
    if current != new or not fmt.is_complete(st.version_dir(t.table, new)):
        raise UserError(f"{schema.lineage.stage} did not complete v{new} (its settings differ from those that built "
                        f"v{t.version}?): rerun repair with the --config and --model it was built with")
    return new


def _drop_unfinished(vdir: Path) -> None:
    """The repair version a stage superseded (incomplete; no writer holds it: the repair's closed, the stage wrote
    another): removed as gc removes a version - renamed out of the version names under the store lock, then
    deleted; a kill in between leaves a dot-folder the next `store gc` finishes. Its carried shards are links."""
    from store.gc import DELETING_SUFFIX

    gone = vdir.with_name(f".{vdir.name}{DELETING_SUFFIX}")
    with fmt.flock(integrity.store_root(vdir) / fmt.STORE_LOCK):
        if fmt.is_complete(vdir) or not vdir.is_dir():
            return
        shutil.rmtree(gone, ignore_errors=True)
        os.rename(vdir, gone)
        atomic_write.fsync_dir(vdir.parent)
    shutil.rmtree(gone, ignore_errors=True)
