"""`pipeline store verify`: every problem as one line; an empty list means the store is sound. Never raises (but
for a newer release's store, below): whatever cannot be read or decoded is itself a problem line.

Checks: store.json (its own checksum, format, each table's current version exists and is complete); for every
complete version: `checksums.json` (sealed) and every file it lists (size + CRC32C: schema.json, manifest.parquet,
every shard and index), files it does not list (but shard files of no shard the manifest names: tars a writer
was killed before indexing, which `store gc` removes), temp files left by killed writes; schema valid, manifest columns
present, keys valid and unique, and each manifest row against its bytes (sample checksum, tar members named
after the key, safetensors header agreeing with the recorded dtype/shape/offset of every tensor, file members at
their recorded offsets). Format-1 versions (no checksums.json) get the sha256 checks they always had. A shard whose
file matched the CRC32C its writer took (`_as_written`) is read once: its samples' checksums held with the file's,
so only the headers the row checks compare are read again (a few hundred bytes a sample, not the sample).

A store or version that a newer release wrote (a later format in its intact store.json, checksums.json or
schema.json: `schemas.newer`) is refused whole with `WrittenByNewer`, the one error verify raises: it is not this
code's to judge, and nothing is recorded as damaged.

Why a single flipped bit is always reported: store.json and checksums.json carry a CRC32C of their own bytes, every
other file's exact bytes are covered by a CRC32C in checksums.json, and a CRC detects every single-bit error.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
import tarfile
from pathlib import Path
from typing import Any, Callable, Mapping

from tqdm import tqdm

from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.file_digest import file_sha256
from schemas.img_shapes import normalize_img_shapes
from schemas.newer import WrittenByNewer
from schemas.table import SCHEMA_V1
from schemas.temp_files import writer_alive
from store import format as fmt
from store import integrity, quarantine
from store.checksum import file_crc
from store.manifest_files import printable_line
from store.shard import SAFETENSORS_ITEMSIZES, SAFETENSORS_NAMES
from store.remote_shards import fetch_problem, is_cache_file
from store.verify_manifest import ShardPart, read_manifest_pass

#: what a verify of a URL fetches into its temporary folder (with checksums.json); every other file stays remote
REMOTE_METADATA = (fmt.SCHEMA_JSON, fmt.MANIFEST)
#: objects(version name, its checksums.json record or None, {shard: its manifest rows}) -> problem lines
ObjectCheck = Callable[[str, "dict[str, dict[str, Any]] | None", "Mapping[str, ShardPart]"], list[str]]

LITTER_NOTE = "temp file left by an interrupted write (`pipeline store repair` removes it)"
# a temp `store repair` keeps (`schemas.temp_files.writer_alive`): this host's live writer's, or another host's or
# container's not yet a day untouched - after a reboot, this host's own killed ones too (a new boot id)
LIVE_TEMP_NOTE = ("temp file of a write in progress, or of one killed on another host or container (or before a "
                  "reboot): `pipeline store repair` removes it once untouched for a day; with no write of the store "
                  "running anywhere, delete it")


# What `store repair` mends without recomputing a sample, so without the --model / --config of the stage that wrote
# it (store/repair.py): a shard index or rank-done file (derived from the manifest: written afresh), counts sealed
# in checksums.json that are not the manifest's (counted afresh), a temp file (removed), quarantine.parquet (set
# aside). Any other problem may need the producing stage.
_NO_RECOMPUTE = re.compile(
    rf"[A-Za-z0-9_]+/v\d+/(?:shard-[^/:]+\.index\.parquet|rank-\d+\.done): (?:missing$|size |crc32c )"
    rf"|[A-Za-z0-9_]+/v\d+/{re.escape(fmt.CHECKSUMS)}: its counts are not its manifest's"
    rf"|.*: (?:{re.escape(LITTER_NOTE)}|{re.escape(LIVE_TEMP_NOTE)})$"
    rf"|{re.escape(fmt.QUARANTINE)}: ")


def needs_recompute(problem: str) -> bool:
    """Whether repairing `problem` (a line of `verify_store`'s) may recompute samples (False: known not to)."""
    return _NO_RECOMPUTE.match(problem) is None


def verify_store(root: Path, progress: bool = True, objects: ObjectCheck | None = None) -> list[str]:
    """`objects`: a store at a URL (store/remote_verify.py): `root` holds only its metadata, and `objects` checks
    every other file each version lists where it lies."""
    problems: list[str] = []
    try:
        rec = fmt.read_store_record(root)
    except WrittenByNewer:
        raise
    except UserError as e:
        problems.append(str(e))
        rec = {"tables": {}}
    tables = sorted({p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")} | set(rec["tables"]))
    for table in tables:
        current = rec["tables"].get(table, {}).get("current")
        if current is not None and not fmt.is_complete(fmt.version_dir(root, table, int(current))):
            problems.append(f"{table}: store.json names v{current} as current, but it is missing or incomplete; "
                            + integrity.missing_version_hint(fmt.version_dir(root, table, int(current))))
        for v in fmt.list_versions(root, table):
            vdir = fmt.version_dir(root, table, v)
            if fmt.is_complete(vdir):  # incomplete folders are writes in progress (or killed): not yet data
                try:
                    found = verify_version(vdir, f"{table}/v{v}", progress, objects)
                except WrittenByNewer:  # refused whole: no damage recorded, no repair advised
                    raise
                except Exception as e:  # noqa: BLE001 - verify reports, it never crashes
                    found = [f"{table}/v{v}: cannot be checked ({type(e).__name__}: {e})"]
                # one printable line per problem: pyarrow's messages carry newlines and the damaged byte they met
                found = [printable_line(p) for p in found]
                problems += found
                # Recorded in the store, so the stage that wrote the version recomputes its damaged samples on
                # its next run instead of calling it up to date (temp files left by killed writes are not damage).
                damage = [p for p in found if not p.endswith(LITTER_NOTE)]
                if damage:
                    integrity.record_damage(vdir, problems=damage)
    problems += [f"{p.relative_to(root).as_posix()}: {LIVE_TEMP_NOTE if writer_alive(p) else LITTER_NOTE}"
                 for p in fmt.store_litter(root, tables)]  # what repair removes now, as its scan judges them
    if (bad := quarantine.problem(root)) is not None:
        problems.append(f"{fmt.QUARANTINE}: {bad} (`store repair` sets it aside)")
    return problems


def _file_problems(vdir: Path, name: str, sums: dict[str, dict[str, Any]], shards: set[str], progress: bool = True,
                   then: Callable[[str, bool], None] | None = None) -> tuple[list[str], set[str]]:
    """(problem lines, the listed files that match their entry). `shards`: those the manifest names (each must be
    listed); a shard file of none of them is no file of the version (`integrity.unreferenced_shard_file`: `store
    gc` removes it). `then(file name, whether it matched)`: called right after each file's check."""
    problems = [f"{name}/{s}: named by the manifest, not listed in {fmt.CHECKSUMS}"
                for s in sorted(shards - sums.keys())]
    # every byte of the version is read here (the per-shard checks then read again only the samples of shards that
    # fail, and the headers of the others): the long part, its own bar, in bytes
    with byte_bar(sum(int(e["nbytes"]) for e in sums.values()), f"checksum {name}", disable=not progress) as bar:
        found, intact = _each_file(vdir, name, sums, bar, then)
        problems += found
    for p in sorted(vdir.iterdir()):
        if p.name in sums or p.name == fmt.CHECKSUMS or is_cache_file(p.name) or \
                integrity.unreferenced_shard_file(p.name, shards) is not None:
            continue
        if fmt.is_litter(p.name):
            problems.append(f"{name}/{p.name}: {LITTER_NOTE}")
        else:
            problems.append(f"{name}/{p.name}: not listed in {fmt.CHECKSUMS}")
    return problems, intact


def _each_file(vdir: Path, name: str, sums: dict[str, dict[str, Any]], bar: tqdm,
               then: Callable[[str, bool], None] | None = None) -> tuple[list[str], set[str]]:
    """Each file `sums` lists against its size and CRC32C (the bar advanced by its recorded size), `then` called
    after each: (problem lines, the files that match)."""
    problems: list[str] = []
    intact: set[str] = set()
    for fname, entry in sorted(sums.items()):
        found = _file_problem(vdir / fname, f"{name}/{fname}", entry)
        problems += found
        if not found:
            intact.add(fname)
        if then is not None:
            then(fname, not found)
        bar.update(int(entry["nbytes"]))
    return problems, intact


def _file_problem(path: Path, name: str, entry: dict[str, Any]) -> list[str]:
    if (problem := fetch_problem(path)) is not None:
        return [f"{name}: {problem}"]
    if not path.is_file():
        return [f"{name}: missing"]
    crc, size = file_crc(path)
    if size != entry["nbytes"]:
        return [f"{name}: size {size} bytes, {fmt.CHECKSUMS} records {entry['nbytes']}"]
    if crc != entry["crc32c"]:
        return [f"{name}: crc32c {crc}, {fmt.CHECKSUMS} records {entry['crc32c']}: the file is damaged"]
    return []


def verify_version(vdir: Path, name: str, progress: bool = True, objects: ObjectCheck | None = None) -> list[str]:
    problems: list[str] = []
    try:
        record = integrity.read_version_record(vdir)
    except WrittenByNewer:
        raise
    except UserError as e:
        problems.append(f"{name}: {e}")
        record = None
    sums, counts = (record["files"], record.get("counts")) if record is not None else (None, None)
    if objects is None:
        found, by_shard = read_manifest_pass(vdir, name, sums, counts)
        checked: dict[str, list[str]] = {}

        def right_after(fname: str, intact: bool) -> None:
            # a shard's rows checked as soon as its file's CRC was read, while its pages are in the page cache: a
            # second pass over the headers after the whole version (TBs at 1M samples) read them back cold, a disk
            # or network read per header (bench/verify_cold_headers.py)
            if fname in by_shard:
                checked[fname] = _shard_problems(vdir, name, fname, by_shard, sums, intact)

        files, intact = _file_problems(vdir, name, sums, set(by_shard), progress, right_after) \
            if sums is not None else ([], set())
        problems += files + found
        # in name order: `by_shard` reads a group of shards' rows at a time (store/verify_manifest.py); the shards
        # checked above are only collected here (the problem lines in this order, as they always were)
        for shard in tqdm(by_shard, desc=f"verify {name}", unit="shard", disable=not progress):
            lines = checked.pop(shard, None)
            problems += lines if lines is not None else _shard_problems(vdir, name, shard, by_shard, sums,
                                                                       shard in intact)
        return problems
    local = {n: e for n, e in (sums or {}).items() if n in REMOTE_METADATA}
    found, by_shard = read_manifest_pass(vdir, name, sums, counts)
    problems += _file_problems(vdir, name, local, set(), progress=False)[0] if sums is not None else []
    return problems + found + objects(name, sums, by_shard)


def _shard_problems(vdir: Path, name: str, shard: str, by_shard: Mapping[str, ShardPart],
                    sums: dict[str, dict[str, Any]] | None, intact: bool) -> list[str]:
    """One shard's problem lines: its manifest rows' columns, then the rows against the shard's bytes. `intact`:
    the file matched its checksums.json entry (`sums`: None for a format-1 version, its sha256 checked here)."""
    problems: list[str] = []
    try:
        srows, bad = shard_rows(by_shard[shard], name)  # (its group of the manifest read here: a problem line too)
        problems += bad
        problems += _check_shard(vdir / shard, f"{name}/{shard}", srows, whole_file_checked=sums is not None,
                                 as_written=intact and _as_written(srows, sums[shard]))
    except Exception as e:  # noqa: BLE001 - a manifest with nonsense values is a problem line
        problems.append(f"{name}/{shard}: cannot be checked ({type(e).__name__}: {e})")
    return problems


def shard_rows(part: ShardPart, name: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(the shard's manifest rows, the problems of their columns)."""
    try:
        rows = part.rows.to_pylist()
    except Exception as e:  # noqa: BLE001
        return [], [f"{name}/{fmt.MANIFEST}: undecodable ({type(e).__name__}: {e})"]
    problems: list[str] = []
    for r in rows:
        try:
            problems += _check_columns(r, part.schema_version, name)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: key {r.get('key')!r}: columns cannot be checked ({type(e).__name__}: {e})")
    return rows, problems


def _check_columns(r: dict[str, Any], schema_version: int, name: str) -> list[str]:
    if schema_version == SCHEMA_V1:
        if not r.get("height") or not r.get("width"):
            return [f"{name}: key {r['key']}: schema v1 row lacks height/width"]
        return []
    try:
        normalize_img_shapes(r.get("img_shapes"))
    except ValueError as e:
        return [f"{name}: key {r['key']}: {e}"]
    return []


def _as_written(rows: list[dict[str, Any]], entry: dict[str, Any]) -> bool:
    """Does the shard's checksums.json entry hold the CRC32C its writer took as it wrote it (each row's
    `shard_crc32c`; a format-1 shard resumed by format-2 code was measured at commit instead)? Then a file that
    matches it holds the very bytes its samples' CRCs were taken of (store/repair.py `_as_written`)."""
    return bool(rows) and all(r.get("shard_crc32c") == entry["crc32c"] for r in rows)


def _check_shard(path: Path, name: str, rows: list[dict[str, Any]], whole_file_checked: bool = False,
                 as_written: bool = False) -> list[str]:
    """`as_written`: the file matched the CRC32C its writer took (`_as_written`): its samples' bytes are not read
    again, only the tar and safetensors headers the row checks compare with the manifest."""
    if (problem := fetch_problem(path)) is not None:
        return [f"{name}: {problem}"]  # evicted since the file check, and now cannot be fetched
    if not path.is_file():
        return [f"{name}: shard file missing ({len(rows)} samples)"]
    recorded = {(r["shard_sha256"], r["shard_nbytes"]) for r in rows}
    if len(recorded) != 1:
        return [f"{name}: manifest rows disagree on the shard's checksum/size"]
    (sha, nbytes), = recorded
    problems = []
    size = path.stat().st_size
    if size != nbytes:
        problems.append(f"{name}: size {size} bytes, manifest records {nbytes}")
    with open(path, "rb") as f:
        if not whole_file_checked:  # format 1: the shard's sha256 (format 2: its CRC32C, already checked)
            found = file_sha256(f)
            if found != sha:
                problems.append(f"{name}: sha256 mismatch (recorded {sha[:12]}…, found {found[:12]}…): shard is corrupt")
        for r in rows:
            try:
                problems += [f"{name}: key {r['key']}: {p}" for p in _check_row(f, size, r, as_written)]
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name}: key {r.get('key')!r}: cannot be checked ({type(e).__name__}: {e})")
    return problems


def _check_row(f: Any, size: int, r: dict[str, Any], as_written: bool = False) -> list[str]:
    start, n = r["sample_offset"], r["sample_nbytes"]
    if start < 0 or start + n > size:
        return [f"sample bytes [{start}, {start + n}) lie outside the shard"]
    if as_written:  # its CRC held over the whole file: the headers alone, read where the checks look
        return check_sample(_Pread(f.fileno(), start, n), r, crc=False)
    f.seek(start)
    return check_sample(f.read(n), r)


#: how much a sample's header check reads at once: a tar header, the safetensors member's length and its JSON
#: header (a few hundred bytes) come in one read, and the small members after the tensors in one more
HEADER_READ = 16 * 1024


class _Pread:
    """A sample's `n` bytes at `start` of a file, read only where sliced (a tar header, a safetensors header), in
    reads of at least HEADER_READ bytes, each kept while the sample is checked (its members' headers are read in
    order, then the safetensors header again): each header read on its own was 5 reads a sample of 3 members, a
    round trip each on a network file system (bench/verify_header_reads.py)."""

    def __init__(self, fd: int, start: int, n: int) -> None:
        self.fd, self.start, self.n = fd, start, n
        self.held: list[tuple[int, bytes]] = []  # (offset in the sample, the bytes read there)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, part: slice) -> bytes:
        a, b, _ = part.indices(self.n)
        b = max(a, b)
        for at, got in self.held:
            if at <= a and b <= at + len(got):
                return got[a - at : b - at]
        got = os.pread(self.fd, min(max(b - a, HEADER_READ), self.n - a), self.start + a)
        self.held.append((a, got))
        return got[: b - a]


def check_sample(data: Any, r: dict[str, Any], crc: bool = True) -> list[str]:
    """The problems of one manifest row's sample bytes `data` (read at its `sample_offset`; bytes, or anything
    sliced as bytes are). `crc=False`: their checksum is known to hold (their whole shard's did)."""
    start = r["sample_offset"]
    bad = integrity.sample_problem(data, r) if crc else None
    if bad is not None:
        return [f"sample bytes are damaged ({bad})"]
    members = _members(data, start)
    if members is None:
        return ["sample bytes are not whole tar members"]
    problems = []
    key = r["key"]
    wrong = [m for m in members if m.split(".", 1)[0] != key]
    if wrong:
        problems.append(f"tar members named for another key: {wrong}")
    for fr in r["files"]:
        at = members.get(f"{key}.{fr['name']}")
        if at != (fr["offset"], fr["nbytes"]):
            problems.append(f"file {fr['name']!r} not at its recorded offset/size")
    if r["tensors"]:
        at = members.get(f"{key}.safetensors")
        if at is None:
            return problems + ["tensors recorded but no .safetensors member"]
        problems += _check_tensors(data, start, at, r["tensors"])
    return problems


def _members(data: bytes, base: int) -> dict[str, tuple[int, int]] | None:
    """member name -> (absolute data offset, size) for the tar members filling `data` exactly."""
    out = {}
    pos = 0
    while pos < len(data):
        block = data[pos : pos + tarfile.BLOCKSIZE]
        got = _plain_header(block)
        if got is None:  # anything but the plain header the writer makes: tarfile's own reading decides
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
            except (tarfile.TarError, UnicodeDecodeError):  # a name no writer of ours makes: not whole members
                return None
            got = info.name, info.size
        name, size = got
        out[name] = (base + pos + tarfile.BLOCKSIZE, size)
        pos += tarfile.BLOCKSIZE + size + (-size % tarfile.BLOCKSIZE)
    return out if pos == len(data) else None


def _octal(field: bytes) -> int | None:
    """A numeric header field as tarfile reads it (up to the first NUL, stripped, octal), when it is plain digits."""
    digits = field.split(b"\0", 1)[0].strip()
    return int(digits or b"0", 8) if not digits.translate(None, b"01234567") else None


def _plain_header(block: bytes) -> tuple[str, int] | None:
    """(name, size) of a regular file's header block whose every field is plain (octal digits, the unsigned
    checksum), read as `tarfile.TarInfo.frombuf` reads it; None for any other block, which frombuf then judges.
    frombuf decodes every field through Python-level helpers: ~2/3 of a verify's time (bench/verify_members.py)."""
    if len(block) != tarfile.BLOCKSIZE or block[156:157] not in (b"0", b"\0"):
        return None
    # mode, uid, gid, mtime and everything from the type flag on: the same bytes in every member a writer makes
    prefix = _plain_rest(block[100:124] + block[136:148] + block[156:500])
    size, chksum = _octal(block[124:136]), _octal(block[148:156])
    if prefix is None or size is None or chksum != 256 + sum(block) - sum(block[148:156]):
        return None
    try:
        name = block[:100].split(b"\0", 1)[0].decode("utf-8", "strict")
    except UnicodeDecodeError:
        return None
    if name.endswith("/"):  # a directory in the old V7 way
        return None
    return (f"{prefix}/{name}" if prefix else name), size


@functools.lru_cache(maxsize=64)
def _plain_rest(rest: bytes) -> str | None:
    """The ustar prefix (a long name's folder) of a header whose other fields `rest` (mode, uid, gid, mtime, and
    bytes 156-500 from offset 36 on: linkname, uname, gname, devmajor, devminor, prefix) are plain, else None."""
    if any(_octal(rest[a:b]) is None for a, b in ((0, 8), (8, 16), (16, 24), (24, 36), (209, 217), (217, 225))):
        return None
    try:  # linkname, uname, gname, prefix: decoded as frombuf decodes them
        *_, prefix = (rest[a:b].split(b"\0", 1)[0].decode("utf-8", "strict")
                      for a, b in ((37, 137), (145, 177), (177, 209), (225, 380)))
    except UnicodeDecodeError:
        return None
    return prefix


def _check_tensors(data: bytes, base: int, member: tuple[int, int], tensors: list[dict[str, Any]]) -> list[str]:
    moff, msize = member[0] - base, member[1]
    try:
        (hlen,) = struct.unpack("<Q", data[moff : moff + 8])
        header = json.loads(data[moff + 8 : moff + 8 + hlen])
    except (struct.error, ValueError):
        return ["safetensors member has an unreadable header"]
    problems = []
    data_start = member[0] + 8 + hlen
    for t in tensors:
        h = header.get(t["name"])
        if h is None:
            problems.append(f"tensor {t['name']!r} not in the safetensors header")
            continue
        begin, end = h["data_offsets"]
        st_dtype = SAFETENSORS_NAMES.get(h["dtype"])
        if (data_start + begin, end - begin, st_dtype, list(h["shape"])) != (t["offset"], t["nbytes"], t["dtype"], list(t["shape"])):
            problems.append(f"tensor {t['name']!r}: manifest offset/size/dtype/shape disagree with the safetensors header")
        elif math.prod(t["shape"]) * SAFETENSORS_ITEMSIZES[h["dtype"]] != t["nbytes"] or data_start + end > member[0] + msize:
            problems.append(f"tensor {t['name']!r}: byte size inconsistent with its shape")
    return problems
