"""The source formats (DESIGN §3): which one a source is (`detect_format`), its samples (`iter_source`, read by the
format's reader: folder_source.py, webdataset_source.py, jsonl_source.py, parquet_source.py; where tar shards are
and how they are opened - local, brace lists, http(s), s3 - in shards.py), the local files its listing hashes
(`source_files`), and what every reader shares: `SourceSample` and the one way a source file is read
(`read_source_file`).

Each reader yields one `SourceSample` per sample with the raw bytes of the target, of each control in order, of
the caption and of the optional edit mask. Nothing is decoded here: judging bytes (bad image, bad caption, wrong
control count) is the stage's job, so every format is judged by the same rules. A sample the reader itself
cannot assemble (missing file, unsafe tar member name, malformed JSONL line) is still yielded, with `problem`
set, so it reaches the quarantine instead of vanishing.

Layouts:
- folder: `target/<stem>.png|jpg|jpeg|webp` + caption `target/<stem>.txt`, controls `control/<stem>.*`,
  `control_1/<stem>.*`, ..., optional mask `mask/<stem>.png`. Dotfiles (`.DS_Store`, `._x`) are OS litter and
  ignored; any other file in these folders that is not an image (or a `.txt` in target/) quarantines its sample.
- webdataset: `*.tar` (a file, every tar in a folder sorted by name, a brace list, or URLs: shards.py); members
  `<key>.png|jpg|...` (target), `<key>.control.png`, `<key>.control_1.png`, ..., `<key>.txt`, `<key>.mask.png`;
  metadata members (`.json`, `.cls`, ...: WDS_METADATA_MEMBERS) are ignored, any other member quarantines its
  sample (it would otherwise be dropped unseen). As in webdataset, a sample is a run of consecutive members
  sharing the key (member path up to the first dot of its base name).
- JSONL: one object per line: `target` (path), `controls` (list of paths; `control` alone also accepted),
  `caption` or `prompt` (text), optional `mask` (path). Relative paths are relative to the JSONL file's folder.
  The file as text (encoding, line endings, a JSON array saved as .jsonl) is checked in jsonl_text.py.
- parquet: image bytes in columns, mapped by `resize.columns` (parquet_source.py).

What is read (every format): only regular files (a device, FIFO or socket is never opened for reading: /dev/zero
would be read without end), of at most `resize.max_file_bytes`; never outside the source through a symlink or
`..` (a folder source: its folder; a JSONL source: the JSONL file's folder for relative paths; absolute JSONL
paths are read where they point, as documented). Each refusal quarantines the sample with the reason.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from schemas.errors import UserError
from stages.resize.caption_text import CAPTION_TOO_LONG, caption_too_long
from stages.resize.folder_listing import _inside
from stages.resize.jsonl_text import checked_manifest
from stages.resize.shards import is_shard_list, shard_urls
from store.remote import is_url

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".bmp", ".gif")  # = features.decode.ALLOWED_FORMATS
CONTROL_DIR = re.compile(r"^control(?:_(\d+))?$")
DEFAULT_MAX_FILE_BYTES = 1 << 30  # = ResizeConfig.max_file_bytes' default
DEFAULT_MAX_CAPTION_BYTES = 64 * 1024  # = ResizeConfig.max_caption_bytes' default


class Done(Protocol):
    """source -> key of a resumed run's samples (resumed_sources.py `ResumedSources`, or a dict)."""

    def get(self, source: str) -> str | None: ...

    def __len__(self) -> int: ...


@dataclass
class SourceSample:
    """One sample as found in the source; bytes are raw file contents, never decoded here."""

    name: str  # stem / webdataset key / JSONL line label
    source: str  # where it came from, for the quarantine (path, or tar path + key, or jsonl path:line)
    target: bytes | None = None
    controls: list[bytes] = field(default_factory=list)
    caption: bytes | None = None  # raw caption bytes; None = no caption file / field
    mask: bytes | None = None
    files: list[str] = field(default_factory=list)  # source file of target, controls, mask (for messages)
    problem: str | None = None  # set when the reader could not assemble the sample
    problem_kind: str = "bad-source"  # quarantine reason category of `problem`
    done_key: str | None = None  # a resumed run's sample already written (resumed_sources.py): its bytes not read
    # a sample an earlier version holds, its files unchanged (known_sources.py): only its caption read, no image
    known: Any = None  # known_sources.Known
    reread: Any = None  # with `known`: a callable giving the sample with its bytes read, for the stage's rare needs
    # with `known`: a callable giving its pictures' first bytes (header_checks.Heads, picture_heads.py), for the
    # header checks a rerun makes of a sample it carries; None (or giving None): read whole for them
    heads: Any = None
    # the local file (a folder/JSONL file, a tar, a parquet file) whose read failed (problem_kind "read-error": EIO, EACCES): the
    # version does not count it as read, so a rerun reads it again (stage.py). Its real name, for the listing lines.
    unread: str | None = None
    # how many source samples this record stands for: >1 for one `read-error` row naming a range of unread parquet
    # rows (parquet_source._unread_rows); the quarantine row's `samples` column, the summary counts it
    samples: int = 1


def detect_format(source: str | Path) -> str:
    """'folder', 'webdataset', 'jsonl' or 'parquet' for a source; UserError when it is none of them."""
    if is_shard_list(source):  # a URL or a brace list of shards, or parquet at a URL
        from stages.resize.parquet_source import is_parquet_url

        return "parquet" if is_parquet_url(str(source)) else "webdataset"
    p = Path(source)
    if p.is_file():
        if p.suffix in (".jsonl", ".tar", ".parquet"):
            return checked_manifest(p) if p.suffix == ".jsonl" else {".tar": "webdataset", ".parquet": "parquet"}[p.suffix]
        raise UserError(f"source {p} is a file but neither a .jsonl manifest, a .tar shard nor a .parquet file")
    if not p.is_dir():
        refuse_no_file(p.parent, [p], links=True)  # there, but no file: said what it is, not "does not exist"
        raise UserError(f"source {p} does not exist; pass a folder, a .tar shard (or folder, brace list or URL of "
                        "them), a .jsonl file or a .parquet file (or folder of them)")
    if (p / "target").is_dir():
        from stages.resize.folder_source import control_folders

        control_folders(p)  # its layout refusals (a misnamed or doubled control/mask folder) before a store is made
        return "folder"
    if tars := sorted(p.glob("*.tar")):
        refuse_no_file(p, tars)  # a broken link's own row says it (cannot open tar)
        return "webdataset"
    jsonls = sorted(p.glob("*.jsonl"))
    refuse_no_file(p, jsonls, links=True)
    if len(jsonls) == 1:
        return checked_manifest(jsonls[0])
    if len(jsonls) > 1:
        raise UserError(f"source {p} holds several .jsonl files ({', '.join(j.name for j in jsonls)}); pass one")
    from stages.resize.parquet_source import parquet_files

    if parquet_files(p):
        return "parquet"
    raise UserError(f"source {p} has no target/ folder, no .tar shards, no .jsonl manifest and no .parquet files "
                    "(the layouts: docs/resize-bucket.md, 'Sources')")


_NEVER_ENDS = ("a FIFO", "a socket", "a device")  # waits for a writer forever, or reads on forever


def refuse_no_file(root: Path, files: list[Path], links: bool = False) -> None:
    """UserError naming the first of a source folder's `files` (its shards, manifest or parquet files) that is no
    file to read: a FIFO or a device (hashing or reading it hung the run), and with `links` a broken link or a
    link loop (skipped unsaid). Folders are not looked at (Spark's `x.parquet/` holds the part files)."""
    for f in files:
        kind = not_regular(f)
        if kind in _NEVER_ENDS or links and kind in ("a broken symlink", "a symlink loop"):
            kind += f" to {os.readlink(f)}" if kind == "a broken symlink" else ""
            raise UserError(f"source {root}: {os.path.relpath(f, root)} is {kind}, not a regular file: not read; "
                            "replace it with the file or remove it")


def iter_source(source: str | Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, columns: Any = None,
                done: Done | None = None, known: Any = None,
                max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES) -> Iterator[SourceSample]:
    """The samples of a source; `columns` is `resize.columns` (a parquet source's column mapping). `done`: {source:
    key} of the samples a resumed run holds (resumed_sources.py): yielded with `done_key`, their files not read
    (a parquet row is read with its batch anyway). `known` (known_sources.KnownSources; a folder or JSONL source): samples
    an earlier version holds with unchanged files, yielded with `known`, their images not read; a webdataset or
    parquet source's: known_tars.KnownTars (unchanged tars not opened, unchanged parquet files not read).
    `max_caption_bytes`: a larger caption file or tar member is not read (a JSONL field's or parquet cell's, read with
    its line or row, `judge` refuses)."""
    fmt = detect_format(source)
    done = done or {}
    if fmt == "webdataset":
        from stages.resize.webdataset_source import iter_webdataset

        samples = iter_webdataset(source, max_file_bytes, done, known, max_caption_bytes)
    elif fmt == "parquet":
        from stages.resize.parquet_source import iter_parquet

        samples = iter_parquet(source if is_url(source) else Path(source), columns, max_file_bytes, known, done)
    elif fmt == "folder":
        from stages.resize.folder_source import iter_folder

        samples = iter_folder(Path(source), max_file_bytes, done, known, max_caption_bytes)
    else:
        from stages.resize.jsonl_source import iter_jsonl

        samples = iter_jsonl(Path(source), max_file_bytes, done, known)
    return map(printable_names, samples)


def resumed_key(done: Done, source: str) -> str | None:
    """The key the resumed version holds `source` under (`done`), None where it holds none."""
    return done.get(printable(source)) if done else None  # recorded as printable (the manifest holds UTF-8)


def printable(text: str) -> str:
    """`text` as valid UTF-8: a file name that is not UTF-8 (a Latin-1 name from an old archive or share) comes
    from the OS with its bytes as lone surrogates, which no parquet column, sqlite row or UTF-8 file can hold;
    those bytes are shown as `\\xNN` instead (the file is still read by its real name)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is no escaped byte (a JSON "\\ud800")
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable_names(s: SourceSample) -> SourceSample:
    """The names a sample is recorded under (manifest, quarantine, messages), as valid UTF-8."""
    s.name, s.source, s.files = printable(s.name), printable(s.source), [printable(f) for f in s.files]
    if s.problem is not None:
        s.problem = printable(s.problem)
    return s


def source_files(source: str | Path) -> list[Path]:
    """The local files a source consists of (for the listing hash); JSONL includes the files it references.
    A webdataset source at URLs has none: content.py identifies its shards by their metadata (shards.py)."""
    fmt = detect_format(source)
    if fmt == "webdataset":
        return [Path(u) for u in shard_urls(source) if not is_url(u)]
    p = Path(source)
    if fmt == "parquet":
        from stages.resize.parquet_source import parquet_files

        return [] if is_url(source) else parquet_files(p)  # at a URL: content.py hashes their metadata
    if fmt == "folder":
        from stages.resize.folder_source import folder_files

        return folder_files(p)
    from stages.resize.jsonl_source import jsonl_files

    return jsonl_files(p)


# ---------------------------------------------------------------- the one way a source file is read


class ReadProblem(Exception):
    def __init__(self, message: str, kind: str = "bad-source", unread: Path | None = None) -> None:
        super().__init__(message)
        self.kind, self.unread = kind, unread


# What an OSError says about a path that names no file: the source's fault (a wrong JSONL path), not the disk's.
_NO_FILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP})
READ_ERROR_HINT = ("a disk, network or permission error, not bad data: this version does not count the file as read, "
                   "so a rerun once it reads again adds the sample")


def is_read_error(path: Any, e: BaseException) -> bool:
    """A local file's read failed for the disk's or the permissions' sake (EIO, EACCES: an OSError with an errno
    that names an existing file), not for its data's (pyarrow's and gzip's "corrupt" errors carry no errno): a
    rerun retries it. A URL's failure is the transfer's, which stops the run instead."""
    return isinstance(e, OSError) and bool(e.errno) and e.errno not in _NO_FILE and not is_url(path)


def _read_failed(what: str, path: Path, e: OSError) -> ReadProblem:
    """A file the reader could not read: `read-error` (EIO, EACCES, ...: retried by a rerun), unless the path names
    no file (`bad-source`)."""
    if e.errno in _NO_FILE:
        return ReadProblem(f"{what} file {path} cannot be read: {e.strerror or e}")
    return ReadProblem(f"{what} file {path} could not be read: {e.strerror or e} (errno {e.errno}); {READ_ERROR_HINT}",
                    "read-error", path)


def read_source_file(path: Path, root: Path | None, max_bytes: int, what: str = "file",
                     max_caption_bytes: int | None = None) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, within `root` (None: anywhere, for an absolute JSONL
    path); `ReadProblem` naming the reason otherwise. `max_caption_bytes`: the file is a caption, refused over it
    from its size, unread (`caption-too-long`)."""
    if "\0" in str(path):  # a JSON "\u0000" in a path: no OS call takes it (ValueError, the run's traceback)
        raise ReadProblem(f"{what} path {str(path)!r} holds a NUL character: no file has such a name; fix the path")
    if root is not None and not _inside(path, root):
        raise ReadProblem(f"{what} {path} resolves to {os.path.realpath(path)}, outside the source {root} (symlink or "
                       "'..'): not read; copy the file into the source", "outside-source")
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the mode is checked on the open file (no race)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise _read_failed(what, path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadProblem(f"{what} {path} is not a regular file ({_file_kind(st.st_mode)}): not read", "not-a-file")
        if max_caption_bytes is not None and st.st_size > max_caption_bytes:
            raise ReadProblem(caption_too_long(str(path), st.st_size, max_caption_bytes), CAPTION_TOO_LONG)
        if st.st_size > max_bytes:
            raise ReadProblem(f"{what} {path} is {st.st_size} bytes, over resize.max_file_bytes ({max_bytes})",
                           "file-too-large")
        if max_caption_bytes is not None:  # a file that grows while read stops at the caption's limit
            max_bytes = min(max_bytes, max_caption_bytes)
        with os.fdopen(os.dup(fd), "rb") as f:
            # the size read, not the limit: read(n) allocates n bytes up front (1 GiB of address space per file,
            # refused where memory is not overcommitted); more only when the file grew since the fstat
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:
                data += f.read(max_bytes + 1 - len(data))
        if len(data) > max_bytes:  # grew while read
            if max_caption_bytes is not None and len(data) > max_caption_bytes:
                raise ReadProblem(caption_too_long(str(path), len(data), max_caption_bytes), CAPTION_TOO_LONG)
            raise ReadProblem(f"{what} {path} is over resize.max_file_bytes ({max_bytes})", "file-too-large")
        return data
    except OSError as e:
        raise _read_failed(what, path, e) from None
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def not_regular(path: Path) -> str | None:
    """What a folder entry is when it is no regular file (a broken link, a link loop, a folder, a FIFO), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:  # a link: ENOENT when it points nowhere, ELOOP when it points at itself
        return "a symlink loop" if e.errno == errno.ELOOP else "a broken symlink" if os.path.islink(path) else e.strerror
    return None if stat.S_ISREG(mode) else _file_kind(mode)


def read_heads(images: list[Path], mask: Path | None) -> Any:
    """A local sample's pictures' first bytes (picture_heads.py `file_heads`), for the header checks."""
    from stages.resize.picture_heads import file_heads

    return file_heads(images, mask)
