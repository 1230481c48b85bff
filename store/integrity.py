"""Integrity of one table version: its `checksums.json`, the checks a reader makes when it opens a version
(schema and manifest bytes, every shard present with its size) and on every first read of a sample (CRC32C of
the sample's bytes), and the one error all of these raise.

`checksums.json` (sealed, see store/checksum.py) lists `{"nbytes", "crc32c"}` for every file of the version:
schema.json, manifest.parquet, each shard, each shard index, each rank-done marker. It is written just before
the manifest, so every complete version of store format 2 has one; versions written by format 1 have none and
are read as before (their samples checked against the manifest's sha256 instead).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.errors import UserError
from schemas.newer import refuse_newer
from store import format as fmt
from store.checksum import SealError, crc_hex, file_crc, seal, unseal

CHECKSUMS_FORMAT = 1
DAMAGE_LOCK = ".damage.lock"  # store root: serialises the read-merge-write of every v<N>.damaged.json

log = logging.getLogger("store")


class DamagedData(UserError):
    """Stored bytes that do not match their checksum, or a missing / short file."""


def store_root(vdir: Path) -> Path:
    return vdir.parent.parent


def repair_target(root: Path) -> str:
    """What `pipeline store repair` takes for damage found in the store `root`: root itself, or for the local cache
    of a store URL that URL - the damaged bytes are the remote's objects (a cache keeps a shard only after its
    whole-file check), and a repair of the cache folder would change this node's copy only."""
    from store.remote_parts import source_url  # lazily: the object-store modules import this one

    return source_url(root) or str(root)


def _written_by(vdir: Path) -> str | None:
    """The stage that wrote this table, as its versions record it (their lineage's `stage`; checksums.json keeps
    a copy for when schema.json is the damaged file); None when no record says. Best effort: the record may be
    the damaged file."""
    def recorded(path: Path, *keys: str) -> str | None:
        try:
            data = path.read_bytes()
            obj = unseal(data) if path.name == fmt.CHECKSUMS else json.loads(data)
            for k in keys:
                obj = obj[k]
            return obj if isinstance(obj, str) and obj.replace("-", "").isalnum() else None
        except (OSError, ValueError, SealError, KeyError, TypeError):
            return None

    siblings = sorted(p for p in vdir.parent.glob("v*") if p.is_dir() and p != vdir)
    found = [recorded(vdir / fmt.SCHEMA_JSON, "lineage", "stage"), recorded(vdir / fmt.CHECKSUMS, "stage"),
             *(recorded(p / fmt.SCHEMA_JSON, "lineage", "stage") for p in siblings)]
    return next((f for f in found if f), None)


# ends the advice of damage `store repair` cannot fix: verify's summary repeats the advice before it, not repair's
NO_REPAIR = "`pipeline store repair` cannot fix this"


def repair_hint(vdir: Path, name: str | None = None) -> str:
    """The advice that works for damage to `name` of version `vdir`: repair recomputes damaged samples and
    rebuilds a manifest, but a version whose schema.json or checksums.json is damaged has lost its identity, so
    only rerunning its stage (a new version) helps; saying "repair" there would go in a circle. At a URL (a cache
    of it, or verify's copy of its metadata) the object is the remote's: a rerun would not replace it, pushing the
    version again from an intact store does (what push and pull say of it)."""
    if name in (fmt.SCHEMA_JSON, fmt.CHECKSUMS):
        if (url := repair_target(store_root(vdir))) != str(store_root(vdir)):
            return (f"delete {url}/{vdir.parent.name}/{vdir.name}/{name} (objects are never overwritten) and push "
                    f"that version again from an intact store; {NO_REPAIR}")
        # nothing of it is carried forward: the lineage that would vouch for its samples is in the damaged file
        return (f"{rerun_hint(vdir)}: it writes a new version of '{vdir.parent.name}' (its samples computed again); "
                f"{NO_REPAIR}")
    return f"run `pipeline store repair {repair_target(store_root(vdir))}`"


def missing_version_hint(vdir: Path) -> str:
    """The advice for a version store.json names current whose manifest is missing (a commit cut short, a deleted
    file): repair has no version to recompute from; the stage's rerun completes it (the samples written kept), and
    at a URL a push of it from an intact store does."""
    if (url := repair_target(store_root(vdir))) != str(store_root(vdir)):
        return f"push {vdir.parent.name}/{vdir.name} again to {url} from an intact store; {NO_REPAIR}"
    return f"{rerun_hint(vdir)}: it completes the version; {NO_REPAIR}"


def rerun_hint(vdir: Path) -> str:
    """`rerun <the stage that wrote vdir's table>`, named as its versions record it."""
    stage = _written_by(vdir)
    return "rerun " + (f"`pipeline run {stage}` with the same store, model and config" if stage else
                       "the stage that wrote it")


def where(vdir: Path) -> str:
    """The version named for a user; in a store URL's cache, by its objects' URL (where the bytes came from)."""
    if (url := repair_target(store_root(vdir))) != str(store_root(vdir)):
        return f"table '{vdir.parent.name}' {vdir.name} ({url}/{vdir.parent.name}/{vdir.name}, cached in {vdir})"
    return f"table '{vdir.parent.name}' {vdir.name} ({vdir})"


# ---------------------------------------------------------------- checksums.json


def write_version_checksums(vdir: Path, manifest: pa.Table, manifest_bytes: bytes | tuple[str, int],
                            measured: Mapping[str, tuple[str, int]] | None = None,
                            counts: dict[str, Any] | None = None) -> None:
    """The version's checksums.json. `manifest`: its rows, or one row per shard (`store.manifest.Written.shards`);
    `manifest_bytes`: its bytes, or their (crc32c, nbytes) when it was streamed to its file. `measured`: file name
    -> (crc32c, nbytes) of the bytes the caller read already (the commit's shard indexes, `store.manifest.merge_runs`:
    the very bytes the manifest's rows came from), not read again; every other file is read here. `counts`: what
    `store inspect` shows of the version (`store.version_counts`), sealed with the rest; without it inspect counts
    the manifest's columns."""
    measured = measured or {}
    own = (crc_hex(manifest_bytes), len(manifest_bytes)) if isinstance(manifest_bytes, bytes) else manifest_bytes
    files: dict[str, dict[str, Any]] = {fmt.MANIFEST: {"nbytes": own[1], "crc32c": own[0]}}
    shards: dict[str, tuple[str | None, int]] = {}
    if manifest.num_rows:
        crcs = (manifest.column("shard_crc32c").to_pylist() if "shard_crc32c" in manifest.column_names
                else [None] * manifest.num_rows)
        for name, crc, n in zip(manifest.column("shard").to_pylist(), crcs, manifest.column("shard_nbytes").to_pylist()):
            shards[name] = (crc, n)
    for name, (crc, n) in shards.items():
        if crc is None:  # a shard committed by format-1 code before a resume: read it once
            crc, n = file_crc(vdir / name)
        files[name] = {"nbytes": n, "crc32c": crc}
    for p in sorted(vdir.iterdir()):
        if p.is_file() and p.name not in files and p.name not in (fmt.CHECKSUMS, fmt.MANIFEST) and \
                not fmt.is_litter(p.name) and unreferenced_shard_file(p.name, shards) is None:
            crc, n = measured.get(p.name) or file_crc(p)
            files[p.name] = {"nbytes": n, "crc32c": crc}
    record: dict[str, Any] = {"format": CHECKSUMS_FORMAT, "files": files}
    if counts is not None:  # an optional key: code before it reads the record as before
        record["counts"] = counts
    try:  # who wrote the version, for the advice when schema.json is the damaged file (`_written_by`)
        record["stage"] = str(json.loads((vdir / fmt.SCHEMA_JSON).read_bytes())["lineage"]["stage"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    fmt.atomic_write_bytes(vdir / fmt.CHECKSUMS, seal(record))


def unreferenced_shard_file(name: str, shards: Container[str]) -> str | None:
    """`name` when it is a shard file (a tar, or an index) of no shard in `shards` (the manifest's), else None:
    not data of the version - a tar whose writer was killed before its index, which a resumed writer leaves in
    place (store/writer_open.py `clean_temp_files`). checksums.json does not list it (so a push does not ship it),
    verify does not count it, `store gc` removes it."""
    shard = fmt.shard_of(name)
    return name if shard is not None and shard not in shards else None


def read_version_checksums(vdir: Path) -> dict[str, dict[str, Any]] | None:
    """file name -> {nbytes, crc32c}; None for a format-1 version (no checksums.json, no sample_crc32c).
    `WrittenByNewer` for a record of a later format (`schemas.newer`), `DamagedData` for one that is damaged."""
    record = read_version_record(vdir)
    return None if record is None else record["files"]


def read_version_record(vdir: Path) -> dict[str, Any] | None:
    """The version's whole checksums.json (`files`, and `counts` where sealed with them), or None, as
    `read_version_checksums`."""
    path = vdir / fmt.CHECKSUMS
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        from store.remote_shards import MARKER

        if os.path.isfile(os.path.join(vdir, MARKER)):  # a store URL's cached copy always has one: deleted here
            raise DamagedData(f"{path} is missing; {repair_hint(vdir, fmt.CHECKSUMS)}") from None
        return None
    try:
        obj = unseal(data)
        # intact (its seal holds) and of a later format: a newer release's version, never damage to repair
        refuse_newer(str(path), obj, CHECKSUMS_FORMAT, intact=True)
        files = obj["files"]
        if obj.get("format") != CHECKSUMS_FORMAT or not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("nbytes"), int) and isinstance(e.get("crc32c"), str)
            for e in files.values()
        ):
            raise SealError("unexpected content")
    except (SealError, KeyError, TypeError) as e:
        raise DamagedData(f"{path} is damaged ({e}); {repair_hint(vdir, fmt.CHECKSUMS)}") from None
    return obj


def check_bytes(vdir: Path, name: str, data: bytes, sums: dict[str, dict[str, Any]]) -> None:
    check_measured(vdir, name, (crc_hex(data), len(data)), sums)


def check_measured(vdir: Path, name: str, measured: tuple[str, int], sums: dict[str, dict[str, Any]]) -> None:
    """`check_bytes` of bytes whose (crc32c, nbytes) the caller measured as it read them (`store.manifest.read_indexes`)."""
    crc, nbytes = measured
    entry = sums.get(name)
    if entry is None:
        raise DamagedData(f"{where(vdir)}: {name} is not listed in {fmt.CHECKSUMS}; {repair_hint(vdir, fmt.CHECKSUMS)}")
    if nbytes != entry["nbytes"] or crc != entry["crc32c"]:
        raise DamagedData(f"{where(vdir)}: {name} is damaged ({nbytes} bytes, crc32c {crc}; "
                          f"recorded {entry['nbytes']} bytes, crc32c {entry['crc32c']}); {repair_hint(vdir, name)}")


def read_checked(vdir: Path, name: str, sums: dict[str, dict[str, Any]] | None) -> bytes:
    """A small file's bytes, checked against checksums.json when the version has one."""
    try:
        data = (vdir / name).read_bytes()
    except FileNotFoundError:
        raise DamagedData(f"{where(vdir)}: {name} is missing; {repair_hint(vdir, name)}") from None
    if sums is not None:
        check_bytes(vdir, name, data, sums)
    return data


def shard_problems(vdir: Path, manifest: pa.Table, sums: dict[str, dict[str, Any]] | None) -> dict[str, str]:
    """shard -> what is wrong with its file (missing, or not its recorded size): the cheap check on open."""
    out: dict[str, str] = {}
    if manifest.num_rows == 0:
        return out
    # per distinct shard: sample count and recorded size, with numpy over the dictionary indices (a million
    # rows in Python took seconds)
    shard = manifest.column("shard")
    shard = (shard if pa.types.is_dictionary(shard.type) else shard.dictionary_encode())
    shard = shard.unify_dictionaries().combine_chunks()
    idx = shard.indices.to_numpy(zero_copy_only=False)
    counts = np.bincount(idx, minlength=len(shard.dictionary))
    sizes = np.zeros(len(shard.dictionary), np.int64)
    sizes[idx] = manifest.column("shard_nbytes").to_numpy()
    base = str(vdir)
    from store.remote_shards import drop_damaged_copy, is_lazy

    lazy = is_lazy(vdir)  # a cached version of a store at a URL: a shard not there yet is fetched when read
    for name, n_samples, recorded in zip(shard.dictionary.to_pylist(), counts.tolist(), sizes.tolist()):
        if not n_samples:
            continue
        want = sums[name]["nbytes"] if sums is not None and name in sums else recorded
        try:
            size = os.stat(os.path.join(base, name)).st_size  # os.path: pathlib costs more than the stat
        except FileNotFoundError:
            if not lazy:
                out[name] = f"shard {name} is missing ({n_samples} samples)"
            continue
        if size != want:
            problem = f"shard {name} is {size} bytes, {want} recorded ({'truncated' if size < want else 'grown'})"
            if not (lazy and drop_damaged_copy(vdir, name, problem)):  # a cached copy: fetched again when read
                out[name] = problem
    return out


def sample_problem(data: memoryview | bytes, row: dict[str, Any]) -> str | None:
    """None when the sample's bytes match their recorded checksum (CRC32C, or sha256 for format-1 rows)."""
    crc = row.get("sample_crc32c")
    if crc:
        have = crc_hex(data)
        return None if have == crc else f"crc32c mismatch (recorded {crc}, read {have})"
    have = hashlib.sha256(data).hexdigest()
    return None if have == row["sample_sha256"] else "sha256 mismatch"


def record_damage(vdir: Path, samples: dict[str, str] | None = None, shards: dict[str, str] | None = None,
                  problems: list[str] | None = None, *, required: bool = False) -> None:
    """Record damage found in a version in its `v<N>.damaged.json` marker (merged with what is recorded), so
    the rerun of the stage that wrote it no longer calls it "up to date" but recomputes the damaged samples
    (store/reuse.py). Readers on every rank and process record, so the read-merge-write runs under the store's
    damage lock (`DAMAGE_LOCK`, its own: a reader may find damage while its process holds the store lock):
    two readers never drop each other's findings. A failure to record (a read-only store, a full disk) is
    reported as one warning line, never silently: reading goes on, but a rerun of the stage that wrote the
    version may then call it up to date.

    A sample or shard already recorded keeps its first problem, and a finding that adds nothing returns after
    one stat of the marker (no lock, no read, no write): every rank of a validation meets the same damaged
    samples, and a resumed or next-epoch read meets them again; each such repeat used to take the lock and
    re-read and compare the whole marker. Callers that find many at once pass them in one call (one write).

    `store repair` marks the version it replaces here too (one writer mechanism: its own unlocked overwrite lost
    findings a reader recorded meanwhile, and a reader's merge could drop repair's), with `required`: a marker
    that cannot be written raises there, as the marker is what keeps `find_version` off that version."""
    if (marker := _marker_of(vdir)) is None:
        return
    version, root, path = marker
    try:
        if _merged(_recorded(path), version, samples, shards, problems) is None:
            return
        with fmt.flock(root / DAMAGE_LOCK):
            rec = _merged(_recorded(path, fresh=True), version, samples, shards, problems)
            if rec is not None:
                fmt.atomic_write_json(path, rec)
                _remember(path, rec)
    except OSError as e:
        if required:
            raise
        log.warning("%s: could not record the damage found in %s (%s: %s); a rerun of the stage that wrote it "
                    "may call it up to date: run `pipeline store verify %s` where the store is writable",
                    where(vdir), path, type(e).__name__, e.strerror or e, root)


def _marker_of(vdir: Path) -> tuple[int, Path, Path] | None:
    """(version, store root, damage marker path) of the version folder `vdir`; None for a folder not named vN."""
    try:
        version = int(vdir.name.lstrip("v"))
    except ValueError:
        return None
    root = store_root(vdir)
    return version, root, fmt.damaged_marker(root, vdir.parent.name, version)


def clear_damage(vdir: Path, names: list[str]) -> None:
    """Drop from the version's `v<N>.damaged.json` what it records about the files `names` (a pull fetched them
    again, each checked: store/remote_pull.refill): those shards, the samples in them, the problems naming them;
    the marker goes when nothing is left, so the repaired copy is no longer refused as damaged. Damage elsewhere
    in the version (a sample whose bytes changed in a shard of the right size) stays recorded."""
    if (marker := _marker_of(vdir)) is None or not marker[2].exists():
        return
    _, root, path = marker
    gone = set(names)
    with fmt.flock(root / DAMAGE_LOCK):
        rec = _recorded(path, fresh=True)
        shards = rec.get("shards") if isinstance(rec.get("shards"), dict) else {}
        samples = rec.get("damaged") if isinstance(rec.get("damaged"), dict) else {}
        problems = rec.get("problems") if isinstance(rec.get("problems"), list) else []
        if samples:
            import pyarrow.parquet as pq

            import pyarrow.compute as pc

            m = pq.read_table(vdir / fmt.MANIFEST, columns=["key", "shard"])  # vectorised: 1M rows at most
            in_gone = set(m.filter(pc.is_in(m["shard"], value_set=pa.array(sorted(gone)))).column("key").to_pylist())
            samples = {k: v for k, v in samples.items() if k not in in_gone}
        shards = {k: v for k, v in shards.items() if k not in gone}
        problems = [p for p in problems if not any(n in str(p) for n in gone)]
        own = ("version", "damaged", "shards", "problems")
        if samples or shards or problems or any(k not in own for k in rec):
            rec = {**rec, "damaged": samples, "shards": shards, "problems": problems}
            fmt.atomic_write_json(path, rec)
            _remember(path, rec)
        else:
            path.unlink()
            _RECORDED.pop(path, None)


# marker -> (its stat stamp when read, its record): a repeat finding is judged by one stat. Every write of a
# marker is an atomic replace (a new inode), and records only grow, so a record cached under the current stamp
# never claims a finding the file lacks.
_RECORDED: dict[Path, tuple[tuple[int, ...], dict[str, Any]]] = {}


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(path: Path, rec: dict[str, Any]) -> None:
    try:
        _RECORDED[path] = (_stamp(os.stat(path)), rec)
    except OSError:
        _RECORDED.pop(path, None)


def _recorded(path: Path, fresh: bool = False) -> dict[str, Any]:
    """The marker's record ({} when there is none, or it is damaged itself: then rewritten from what is found
    now). `fresh`: read the file even when a record is cached (under the lock: the merge never trusts a stamp)."""
    cached = _RECORDED.get(path)
    if cached is not None and not fresh:
        try:
            if _stamp(os.stat(path)) == cached[0]:
                return cached[1]
        except FileNotFoundError:
            return {}
    try:
        with open(path, "rb") as f:  # stamp and bytes of one inode: a replace meanwhile cannot pair them wrong
            stamp, data = _stamp(os.fstat(f.fileno())), f.read()
    except FileNotFoundError:
        return {}
    try:
        rec = json.loads(data)
    except ValueError:
        rec = None
    rec = rec if isinstance(rec, dict) else {}
    _RECORDED[path] = (stamp, rec)
    return rec


def _merged(rec: dict[str, Any], version: int, samples: dict[str, str] | None, shards: dict[str, str] | None,
            problems: list[str] | None) -> dict[str, Any] | None:
    """`rec` with these findings added (a new dict); None when it already holds every one of them."""
    out = dict(rec)
    changed = out.get("version") != version
    out["version"] = version
    for name, new in (("damaged", samples), ("shards", shards)):
        known = rec.get(name) if isinstance(rec.get(name), dict) else {}
        if new and any(k not in known for k in new):
            out[name] = {**new, **known}  # the first problem recorded for a key stays
            changed = True
    if problems:
        known_problems = rec.get("problems") if isinstance(rec.get("problems"), list) else []
        merged = sorted(set(map(str, known_problems)) | set(problems))[:50]
        if merged != known_problems:
            out["problems"] = merged
            changed = True
    return out if changed else None


def damaged_sample_message(vdir: Path, shard: str, key: str, what: str) -> str:
    return (f"{where(vdir)}: sample {key} in {shard} is damaged ({what}); {repair_hint(vdir)} to recompute it "
            "(readers can leave damaged samples out: on_damaged=skip in the reading stage's config section)")
