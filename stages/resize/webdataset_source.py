"""The webdataset source's reader: tar shards (a file, every tar in a folder, a brace list, URLs: shards.py), a
sample a run of consecutive members sharing a key (the layouts: sources.py). A tar the store read before with
unchanged bytes is carried unopened (known_tars.py); one read for the first time is hashed while streamed
(first_read.py); a local read error makes `read-error` rows of the samples it kept out."""

from __future__ import annotations

import os
import re
import tarfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from schemas.errors import UserError
from stages.resize.caption_text import CAPTION_TOO_LONG, TOO_LONG_MARK, caption_too_long
from stages.resize.shards import open_shard, shard_urls
from stages.resize.sources import (CONTROL_DIR, DEFAULT_MAX_FILE_BYTES, IMAGE_SUFFIXES, READ_ERROR_HINT, Done,
                                   SourceSample, is_read_error, printable, printable_names, resumed_key)
from store.remote import is_url


def tar_headers(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Each member's header in order, none kept: a TarFile keeps every header it met (~1 KB each), GBs for a tar of
    a million samples (a folder dataset put in one `.tar`) read whole; webdataset's reader lets them go alike."""
    while (m := tf.next()) is not None:
        tf.members.clear()
        yield m


def split_member(name: str) -> tuple[str, str]:
    """webdataset's rule: key = path up to the first dot of the base name, suffix = the rest (lowercased)."""
    d, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), (ext.lower() if dot else "")


def dot_member(name: str) -> bool:
    """A tar member whose base name starts with a dot: OS litter, ignored as a folder source's dotfiles (macOS tar
    writes an AppleDouble `._x.png` before every file with extended attributes, e.g. a downloaded one, which split
    each sample's run in two: a whole shard quarantined). webdataset's own key rule skips them too."""
    return name.rpartition("/")[2].startswith(".")


def _unsafe_name(name: str) -> bool:
    pure = PurePosixPath(name)
    return name.startswith("/") or "\\" in name or ".." in pure.parts or re.match(r"^[A-Za-z]:", name) is not None


# Metadata members common in webdataset shards (labels, per-sample JSON): not part of an edit pair, so they
# are ignored rather than quarantining the sample. Anything else unknown (e.g. `.control.heic`) quarantines it.
WDS_METADATA_MEMBERS = frozenset({"json", "cls", "cls2", "id", "meta", "yaml", "yml"})


def sample_from_members(key: str, where: str, members: dict[str, bytes], bad: list[str],
                        done: Done | None = None) -> SourceSample:
    s = SourceSample(name=key, source=where)
    s.done_key = resumed_key(done or {}, where)
    if s.done_key is not None:
        return s
    if bad:
        s.problem = "; ".join(bad)
        s.problem_kind = ("unsafe-path" if any(b.startswith("unsafe member path") for b in bad) else
                          CAPTION_TOO_LONG if all(TOO_LONG_MARK in b for b in bad) else "bad-source")
        return s
    targets = [ext for ext in members if "." not in ext and f".{ext}" in IMAGE_SUFFIXES]
    ctrl_ext: dict[int, list[str]] = {}
    masks: list[str] = []
    unknown: list[str] = []
    for ext in members:
        head, dot, tail = ext.partition(".")
        m = CONTROL_DIR.match(head)
        if m and dot and f".{tail}" in IMAGE_SUFFIXES:
            ctrl_ext.setdefault(int(m.group(1) or 0), []).append(ext)
        elif head == "mask" and dot and f".{tail}" in IMAGE_SUFFIXES:
            masks.append(ext)
        elif ext not in targets and ext != "txt" and ext not in WDS_METADATA_MEMBERS:
            unknown.append(ext)
    if unknown:  # a member we would not read (e.g. .control.heic) must not be dropped unseen
        s.problem, s.problem_kind = (
            f"unsupported member(s) {', '.join(f'{key}.{e}' if e else key for e in sorted(unknown))}: the layout reads "
            f"<key>.<image>, .txt, .control[_i].<image>, .mask.<image>; images {'/'.join(IMAGE_SUFFIXES)}",
            "unsupported-file",
        )
        return s
    several = [f"{key}.{'/'.join(exts)}" for exts in [*ctrl_ext.values(), masks] if len(exts) > 1]
    if several:
        s.problem = f"several members for one image: {', '.join(several)}"
        return s
    if len(targets) != 1:
        s.problem = (
            f"no target image member ({'/'.join(IMAGE_SUFFIXES)}) among {sorted(members)}"
            if not targets
            else f"several target image members: {sorted(targets)}"
        )
        return s
    s.target = members[targets[0]]
    s.files.append(f"{where}.{targets[0]}")
    if sorted(ctrl_ext) != list(range(len(ctrl_ext))):
        s.problem = f"control members are not contiguous from .control: found indices {sorted(ctrl_ext)}"
        return s
    s.controls = [members[ctrl_ext[i][0]] for i in range(len(ctrl_ext))]
    s.files += [f"{where}.{ctrl_ext[i][0]}" for i in range(len(ctrl_ext))]
    s.caption = members.get("txt")
    if s.caption is None:  # the caption may sit in a member passed over as metadata (`<key>.json`)
        meta = sorted(ext for ext in members if ext in WDS_METADATA_MEMBERS)
        s.problem, s.problem_kind = (f"no caption member {key}.txt" + (
            f" (member(s) {', '.join(f'{key}.{e}' for e in meta)} are not read: put the caption text in {key}.txt)"
            if meta else ""), "missing-caption")
    if masks:
        s.mask = members[masks[0]]
        s.files.append(f"{where}.{masks[0]}")
    return s


def iter_webdataset(root: str | Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                    done: Done | None = None, known: Any = None,
                    max_caption_bytes: int | None = None) -> Iterator[SourceSample]:
    """Every shard of the source (shards.py: local, http(s), s3, brace lists), streamed once, in order. `known`
    (known_tars.KnownTars): a tar unchanged since the newest version, every sample of it there, is not opened: its
    samples are yielded with `known`; each tar read whole is recorded in it (its hash, its sample count).
    `max_caption_bytes`: a larger `.txt` member is not read (its sample `caption-too-long`)."""
    for tar in shard_urls(root):
        carried = known.unchanged(tar) if known is not None else None
        if carried is not None:
            from stages.resize.picture_heads import TarIndex

            sha, samples = carried
            # its headers walked only when a sample is read after all (a URL's: while it is still the recorded one)
            index = TarIndex(tar, max_file_bytes, partial(known.still, tar, sha) if is_url(tar) else None,
                             [source for source, _ in samples] if is_url(tar) else None, known.headers(tar),
                             partial(known.match, tar) if is_url(tar) else None)
            for source, hit in samples:
                yield SourceSample(name=source[len(tar) + 1:], source=source, known=hit,
                                   reread=partial(index.sample, source), heads=partial(index.heads, source))
            index.confirm()  # a URL's object not put again while its samples were read by offsets
            known.note(tar, sha, len(samples), index.headers or known.headers(tar))
            continue
        if known is not None and str(Path(tar)) in known.pending:  # read for the first time: hashed as streamed
            yield from _hashed_shard(tar, max_file_bytes, done or {}, known, max_caption_bytes)
            continue
        before = known.identity(tar) if known is not None else None
        count, failed, headers = 0, False, [] if is_url(tar) else None  # a URL's header offsets (known_tars.py)
        for s in _shard_samples(tar, max_file_bytes, done or {}, headers=headers,
                                max_caption_bytes=max_caption_bytes):
            count, failed = count + 1, failed or s.problem_kind == "read-error"
            yield s
        # not changed while it was streamed, and read whole (a read error: not noted, so a rerun reads it again)
        if before is not None and not failed and known.identity(tar, fresh=True) == before:
            known.note(tar, before, count, headers)


def _hashed_shard(tar: str, max_file_bytes: int, done: Done, known: Any,
                  max_caption_bytes: int | None = None) -> Iterator[SourceSample]:
    """A local tar's samples, its sha256 taken from the same bytes (first_read.py): noted as read, and kept for
    the cache, when it was streamed whole and is unchanged since its stream began."""
    from stages.resize.first_read import HashingStream, file_stamp

    streams: list[HashingStream] = []

    def opened(url: str) -> HashingStream:
        streams.append(HashingStream(open_shard(url)))
        return streams[-1]

    started = time.time_ns()  # the file-hash cache judges a whole-second stamp by it (models/file_hashes.RACY_NS)
    before, count, failed = file_stamp(tar), 0, False
    for s in _shard_samples(tar, max_file_bytes, done, opener=opened, max_caption_bytes=max_caption_bytes):
        count, failed = count + 1, failed or s.problem_kind == "read-error"
        yield s
    digest = streams[0].digest() if streams else None
    if digest is not None and not failed and before is not None and file_stamp(tar) == before:
        known.streamed[tar] = (digest, os.stat(tar), started)
        known.note(tar, digest, count)


def _shard_samples(tar: str, max_file_bytes: int, done: Done,
                   opener: Callable[[str], Any] | None = None, headers: list[int] | None = None,
                   max_caption_bytes: int | None = None) -> Iterator[SourceSample]:
    stream = None
    try:
        stream = (opener or open_shard)(tar)
        tf = tarfile.open(fileobj=stream, mode="r|*")  # streaming: one pass, like webdataset
    except (tarfile.TarError, OSError) as e:
        if stream is not None:
            close_shard(tar, stream)  # a failed transfer (e.g. curl's exit status) stops the run instead
        if is_read_error(tar, e):
            yield from _unread_rest(tar, -1, None, done, e)  # EACCES, EIO: the disk's, not the data's
            return
        yield SourceSample(name=Path(tar).stem, source=tar, problem=f"cannot open tar: {e}")
        return
    yield from _tar_samples(tar, tf, stream, max_file_bytes, done, headers, max_caption_bytes)


def reread_tar(tar: str, source: str, max_file_bytes: int) -> SourceSample:
    """The sample recorded as `source` of a tar carried unread, read from the tar after all (streamed up to it)."""
    samples = _shard_samples(tar, max_file_bytes, {})
    try:
        for s in samples:
            if printable(s.source) == source:
                return printable_names(s)
            if s.problem_kind == "read-error" and s.source == tar:  # a read error, the headers after it too
                return SourceSample(name=source[len(tar) + 1:], source=source, problem_kind="read-error", unread=tar,
                                    problem=f"sample {source} could not be read again: {s.problem}")
    finally:
        samples.close()
    return SourceSample(name=source[len(tar) + 1:], source=source, problem=f"sample {source} is no longer in "
                        f"{tar} (the tar changed while this run read it); rerun")


def _tar_samples(tar: str, tf: tarfile.TarFile, stream: Any, max_file_bytes: int, done: Done,
                 headers: list[int] | None = None, max_caption_bytes: int | None = None) -> Iterator[SourceSample]:
    """`headers`: each member header's offset appended (a tar at a URL's, recorded: known_tars.py).
    `max_caption_bytes`: a larger `.txt` member is passed over unread (None: read, `judge` refuses it)."""
    key: str | None = None
    members: dict[str, bytes] = {}
    bad: list[str] = []
    at, failed = -1, None  # the header offset of the last member met; the local read error that ended the stream
    try:
        with tf:
            for m in tar_headers(tf):
                at = m.offset
                if headers is not None:
                    headers.append(at)
                if m.isdir() or dot_member(m.name):
                    continue
                k, ext = split_member(m.name)
                if key is not None and k != key:
                    yield sample_from_members(key, f"{tar}:{key}", members, bad, done)
                    members, bad = {}, []
                key = k
                if resumed_key(done, f"{tar}:{k}") is not None:
                    continue  # written before: its members not read (a stream passes over them)
                # never follow names out of the archive, even though we do not extract to disk
                if _unsafe_name(m.name):
                    bad.append(f"unsafe member path {m.name!r} (absolute or '..')")
                elif not m.isfile():
                    bad.append(f"member {m.name!r} is not a regular file (link or device)")
                elif ext in members:  # webdataset would keep the last copy silently
                    bad.append(f"member {m.name!r} appears twice in the run of key {k!r}")
                elif ext == "txt" and max_caption_bytes is not None and m.size > max_caption_bytes:
                    bad.append(caption_too_long(f"member {m.name!r}", m.size, max_caption_bytes))
                elif m.size > max_file_bytes:
                    bad.append(f"member {m.name!r} is {m.size} bytes, over resize.max_file_bytes ({max_file_bytes})")
                else:
                    f = tf.extractfile(m)
                    members[ext] = f.read() if f is not None else b""
    except (tarfile.TarError, EOFError) as e:  # the data: a truncated or corrupt tar
        close_shard(tar, stream)  # unless the transfer failed, which is the run's error, not the data's
        bad.append(f"tar is truncated or corrupt: {e}")
    except Exception as e:  # noqa: BLE001  reading failed: a local disk's OSError, or a transfer's (any library type)
        if is_url(tar):
            raise UserError(f"source shard {tar}: the transfer failed ({type(e).__name__}: {e}); check the server "
                            "and rerun (samples already written are kept)") from None
        if not isinstance(e, OSError):
            raise
        close_shard(tar, stream)
        failed = e  # the disk's error, not the data's: this sample and the rest of the tar are not read
    else:
        close_shard(tar, stream)
    if failed is not None:
        yield from _unread_rest(tar, at, key, done, failed)
    elif key is not None:
        yield sample_from_members(key, f"{tar}:{key}", members, bad, done)
    elif bad:
        yield SourceSample(name=Path(tar).stem, source=tar, problem="; ".join(bad))


def _unread_rest(tar: str, after: int, key: str | None, done: Done, error: OSError) -> Iterator[SourceSample]:
    """The samples a local read error (EIO, EACCES) kept from being read: `key`'s, whose members it cut, and those
    after it, named by a walk of the tar's headers past header offset `after` (a bad sector mostly spoils one
    member's data); each a `read-error` sample (a resumed run's written ones: as written). Headers that cannot be
    read either: one row for the rest of the tar. Never silently missing, never "corrupt": a rerun reads them."""
    why = f"{error.strerror or error} (errno {error.errno}); {READ_ERROR_HINT}"

    def unread(k: str, what: str) -> SourceSample:
        source = f"{tar}:{k}"
        if (done_key := resumed_key(done, source)) is not None:
            return SourceSample(name=k, source=source, done_key=done_key)
        return SourceSample(name=k, source=source, problem=f"{what} {tar}: {why}", problem_kind="read-error",
                            unread=tar)

    if key is not None:
        yield unread(key, "a member of this sample could not be read from")
    last = key
    try:
        with tarfile.open(tar, mode="r:") as tf:  # uncompressed: seeks header to header, member data unread
            for m in tar_headers(tf):
                if m.offset <= after or m.isdir() or dot_member(m.name):
                    continue
                k = split_member(m.name)[0]
                if k != last:  # a run of members sharing a key is a sample
                    yield unread(k, "not read: a read error earlier in")
                last = k
    except (OSError, tarfile.TarError, EOFError) as e:
        yield SourceSample(name=Path(tar).stem, source=tar, problem_kind="read-error", unread=tar, problem=(
            f"the rest of the tar after {'key ' + repr(last) if last is not None else 'its start'} could not be "
            f"read (its headers neither: {type(e).__name__}: {e}), how many samples it holds is not known: {why}"))


def close_shard(tar: str, stream: Any) -> None:
    """Close a shard's stream; a URL whose transfer failed (curl's exit status, s3fs's error) stops the run with
    one line rather than quarantining its remaining samples as if the tar were corrupt: a rerun continues."""
    try:
        stream.close()
    except Exception as e:  # noqa: BLE001  webdataset's Pipe raises a bare IOError with curl's status
        if not is_url(tar):
            return
        raise UserError(f"source shard {tar}: the transfer failed ({e}); check the server and rerun "
                        "(samples already written are kept)") from None
