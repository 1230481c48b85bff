"""The first bytes of a carried sample's source pictures, for the header checks a rerun makes of it
(header_checks.py: a transparent colour since revision 4, a lowered resize.max_image_pixels), read from its
files (a folder or JSONL source) or from its tar's members by their offsets, never the whole picture.

The sample's files are those whose sha256 the file-hash cache vouches for (known_sources.py, known_tars.py), so
its first bytes are the recorded pictures'. A read that fails (OSError) makes the stage read the sample whole, as
before, which names the error.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Callable

from schemas.errors import UserError
from stages.resize.first_read import file_stamp
from stages.resize.header_checks import FIRST_READ, Heads, Reader
from stages.resize.shards import open_shard
from stages.resize.sources import SourceSample, printable, printable_names
from stages.resize.webdataset_source import dot_member, reread_tar, sample_from_members, split_member, tar_headers

# a tar at a URL is walked by range requests of this many bytes from each header: a member smaller than the rest of
# it costs no request of its own (a caption), a larger one one request (not its data: ~16 KiB of a ~1 MB picture)
WALK_BLOCK = 16 * 1024
# a carried tar at a URL: its pictures' first bytes fetched for this many samples ahead of the one asked, their
# range requests concurrent (fsspec's cat_ranges; async for http and s3): a round trip a window, not one a picture.
# Held: HEADS_AHEAD x pictures x FIRST_READ (64 samples of 3: 12 MiB)
HEADS_AHEAD = 64
# ... while the samples asked are at most this far apart in `order`: a window holds the heads of every sample in it,
# so asked further apart (only some headers checked: a lowered pixel limit, rows without controls over it) each
# ask fetched HEADS_AHEAD samples' heads for its own (64x the bytes); those fetch their own heads alone
HEADS_STRIDE = 4
# a tar at a URL whose member headers' offsets were recorded (known_tars.py) is walked by fetching HEADER_BLOCK bytes
# from each (a header, with a pax or GNU long-name header before it), WALK_AHEAD concurrent requests a round
HEADER_BLOCK = 4096
WALK_AHEAD = 512


def read_first(path: str | Path, n: int, offset: int = 0, size: int | None = None) -> bytes:
    """The first `n` bytes of a regular file (from `offset`, of the `size` bytes there: a tar member's data)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in the file's place must not block the run
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        n = n if size is None else min(n, size)
        parts, got = [], 0
        while got < n:  # a network file system may return fewer bytes than asked before the end
            part = os.pread(fd, n - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        os.close(fd)


@contextlib.contextmanager
def client_errors(what: str) -> Iterator[None]:
    """The client's own errors raised inside (aiohttp's, botocore's, fsspec's ValueError for a server with no range
    requests) as OSError `<what>: <error>` (`what`: the URL and what was read): a read that fails so is no run's end,
    the sample streamed (or the tar downloaded and walked) instead, which names it. OSError as it is."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        raise OSError(f"{what}: {e}") from e


def read_range(url: str, n: int, offset: int = 0, size: int | None = None, **match: Any) -> bytes:
    """`read_first` of an object at a URL: one range request (`match`: shards.if_match's). The client's own errors (a
    lost connection, a server refusing the range, 412 for an object put again) as OSError: the sample is then read
    by streaming its tar, which names them."""
    from stages.resize.shards import remote_fs

    n = n if size is None else min(n, size)
    if n <= 0:
        return b""
    fs, path = remote_fs(url)
    with client_errors(f"{url}: bytes {offset}-{offset + n - 1} could not be read"):
        data = fs.cat_file(path, start=offset, end=offset + n, **match)
    if len(data) > n:  # a server that ignores ranges sends the whole object
        raise OSError(f"{url}: the server ignored a range request")
    return data


def cat_ranges(fs: Any, path: str, starts: list[int], ends: list[int], on_error: str, **match: Any) -> list:
    """The byte ranges of one object, as concurrent requests (fsspec: async for http and s3): a round trip."""
    return fs.cat_ranges([path] * len(starts), starts, ends, on_error=on_error, **match)


def refuse_put_again(url: str, what: str, read: str) -> None:
    """The one line that stops a run whose source at `url` was put again while it was read by recorded offsets."""
    raise UserError(f"{url}: the {what} was put again while this run read its {read} (their rows could mix both "
                    "versions' bytes); rerun to read the new one")


def _blocks(url: str, fs: Any, path: str, starts: list[int], n: int) -> list[bytes]:
    """`n` bytes from each start (fewer at the end), by concurrent range requests; the client's errors as OSError."""
    with client_errors(f"{url}: {n} bytes from each of {len(starts)} offsets (member headers) could not be read"):
        blocks = cat_ranges(fs, path, starts, [s + n for s in starts], on_error="raise")
    if any(len(b) > n for b in blocks):  # a server that ignores ranges sends the whole object
        raise OSError(f"{url}: the server ignored a range request")
    return blocks


@contextlib.contextmanager
def _opened_for_walk(tar: str, at_url: bool) -> Iterator[tarfile.TarFile]:
    """The tar opened for a header walk: a local file as it is; an object at a URL as a random-access file of
    fsspec whose reads ask WALK_BLOCK bytes from where they start (a header and the small members after it)."""
    if not at_url:
        with tarfile.open(tar, mode="r:") as tf:
            yield tf
        return
    from stages.resize.shards import remote_fs

    fs, path = remote_fs(tar)
    with client_errors(f"{tar}: cannot be opened for its headers"):
        f = fs.open(path, "rb", block_size=WALK_BLOCK, cache_type="readahead")
    with f, tarfile.open(fileobj=_Errors(f, tar), mode="r:") as tf:
        yield tf


class _Errors:
    """A file at URL `url` whose reads and seeks raise the client's errors (`client_errors`; fsspec's ValueError
    for a server with no range requests: a seek of the streaming file it gives one that answers `Accept-Ranges:
    none`) as OSError: a walk that fails so is no run's end (the tar is downloaded and walked there, `_walk_copy`)."""

    def __init__(self, f: Any, url: str) -> None:
        self._f, self._url = f, url

    def _call(self, call: Callable[..., Any], *args: int) -> Any:
        with client_errors(f"{self._url}: its headers could not be read (a walk by range requests)"):
            return call(*args)

    def read(self, n: int = -1) -> bytes:
        return self._call(self._f.read, n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._call(self._f.seek, offset, whence)

    def tell(self) -> int:
        return self._call(self._f.tell)


def file_heads(images: list[Path], mask: Path | None) -> Heads:
    """A folder or JSONL sample's pictures (target, then controls) and mask."""
    return Heads(partial(read_first, images[0]), tuple(partial(read_first, p) for p in images[1:]),
                 None if mask is None else partial(read_first, mask))


Run = tuple[str, str, dict[str, tuple[int, int]]]  # a sample's key, `<tar>:<key>`, ext -> (data offset, size)


class TarIndex:
    """A carried tar's samples by source name -> (key, where, ext -> (data offset, size)), from one walk of its
    headers (512 bytes a member, the data seeked over) when first asked: a sample's pictures are read by their
    offsets, not by streaming the tar up to them (one stream a sample read again). A source whose members the
    reader would refuse (a link, a name twice, one over resize.max_file_bytes) or that runs twice, and every source
    once the tar is not the one walked (its size, mtime, ctime or inode changed: its offsets would name other
    bytes): None (read as before, streamed). Held: ~850 B a sample (100k samples of 3 members: 81 MiB; 26 s to
    walk on this 2-core machine under load), one tar at a time.

    A tar at a URL (`still`: is it the recorded one, asked of its server) is walked by range requests through
    fsspec (shards.remote_fs): with its member header offsets recorded (`headers`, known_tars.py: kept when it was
    streamed or walked) by concurrent requests from each, a few round trips (`_recorded_members`); else one after
    another, WALK_BLOCK bytes from each header (the members inside it not asked again). Its pictures' first bytes
    are fetched concurrently HEADS_AHEAD samples ahead in `order` (the rows'), a sample read whole in one round; the
    walk's header offsets (`headers` after it) are recorded for the next run. It is checked against its record
    before and after the walk (one metadata request each), not before each read as a local tar's stat is (a request
    a sample), and once more after its last sample is read (`confirm`): an object put again while its samples were
    read by the walk's offsets (old offsets into new bytes) stops the run, which a rerun reads right. Over http(s)
    each range read also sends the walked object's strong ETag as If-Match (`match`: its keywords, shards.if_match,
    as they are once the tag was asked after the walk; known_tars.KnownTars.match): a server answers 412 for one
    put again, and the sample is streamed from it instead of read by the old offsets (s3fs takes no If-Match: there
    `confirm` alone). A server that ignores range requests: the tar downloaded once to a temporary file and walked
    there."""

    def __init__(self, tar: str, max_file_bytes: int, still: Callable[[], bool] | None = None,
                 order: list[str] | None = None, headers: list[int] | None = None,
                 match: Callable[[], dict[str, Any]] | None = None) -> None:
        self.tar, self._max, self._still, self._match_now = tar, max_file_bytes, still, match
        self._match: dict[str, Any] = {}  # a URL's range reads' If-Match (`match`): the walked object's ETag
        # a URL's member header offsets as recorded (walked concurrently); those of the walk made (for the record)
        self._recorded, self.headers = headers, None
        # a URL's: the sources in the order they are asked (the rows'), whose heads are fetched a window ahead
        self._order = {source: i for i, source in enumerate(order or ())}
        self._ahead: list[str] = list(order or ())
        self._fetched: dict[int, bytes] = {}  # data offset -> the member's first bytes, of the window fetched
        self._last_asked: int | None = None  # the position in `order` of the sample whose heads were asked last
        self._covered = range(0)  # the positions in `order` of the samples the last window fetched
        self._runs: dict[str, tuple[str, str, dict[str, tuple[int, int]]] | None] | None = None
        self._stamp: tuple[int, int, int, int] | bool | None = None
        self._copy: Any = None  # a URL's tempfile, where its walk by range requests failed (`_walk_copy`)
        self._by_offsets = False  # a URL's samples read by the walk's offsets (range requests): `confirm` asks

    def _run(self, source: str) -> tuple[str, str, dict[str, tuple[int, int]]] | None:
        if self._runs is None:
            self._runs = self._index()
        if self._still is not None:
            run = self._runs.get(source) if self._stamp else None
            self._by_offsets = self._by_offsets or (run is not None and self._copy is None)
            return run
        return self._runs.get(source) if self._stamp is not None and file_stamp(self.tar) == self._stamp else None

    def confirm(self) -> None:
        """After a URL tar's last sample was read: one metadata request, where samples were read by the walk's
        offsets, says the object is still the one walked. Put again meanwhile, those reads took the old offsets
        into the new bytes (a row of neither version, which the next run would not notice: its rows are recorded
        under the tag asked before the walk), so the run stops; already yielded, they cannot be read again."""
        if self._by_offsets and not self._still():
            refuse_put_again(self.tar, "tar", "samples by their offsets")

    def _index(self) -> dict[str, tuple[str, str, dict[str, tuple[int, int]]] | None]:
        self._stamp = file_stamp(self.tar) if self._still is None else self._still()
        if not self._stamp:
            return {}
        try:
            runs = self._walk()
        except OSError:  # a read error; at a URL, a server that ignores range requests (or a lost connection)
            runs = self._walk_copy() if self._still is not None else {}
        except (tarfile.TarError, EOFError):  # each sample streamed instead, which names the error
            runs = {}
        if self._still is not None and not self._still():  # put again during the walk
            self._stamp = None
        elif self._match_now is not None:  # the tag just asked, the walk's object's: its reads refused once put again
            self._match = self._match_now()
        return runs

    def _walk_copy(self) -> dict[str, tuple[str, str, dict[str, tuple[int, int]]] | None]:
        """A tar at a URL whose walk by range requests failed (a server that ignores them): downloaded once to a
        temporary file (gone with the index), walked and read there; else each sample to read would stream the tar
        up to it (a tar of n samples read ~n/2 times). A transfer that fails, no room for the copy, or bytes that
        are no tar: each sample streamed instead (`reread_tar`), whose stream names the error where it lasts."""
        from stages.resize.webdataset_source import close_shard

        try:
            copy = tempfile.NamedTemporaryFile(prefix="resize-tar-", suffix=".tar")
            stream = open_shard(self.tar)
            try:
                shutil.copyfileobj(stream, copy, 1 << 20)
            finally:
                close_shard(self.tar, stream)
            copy.flush()
            self._copy = copy
            return self._walk()
        except (OSError, tarfile.TarError, EOFError):  # streamed instead, which names why where it lasts
            self._copy = None
            return {}

    def _walk(self) -> dict[str, tuple[str, str, dict[str, tuple[int, int]]] | None]:
        at_url = self._still is not None and self._copy is None
        if at_url and self._recorded:
            try:
                return self._runs_of(self._recorded_members())
            except (OSError, tarfile.TarError, EOFError, ValueError):  # not the headers recorded: walked instead
                self.headers = None
        with _opened_for_walk(self._copy.name if self._copy else self.tar, at_url) as tf:  # seeks header to header
            return self._runs_of(tar_headers(tf))

    def _recorded_members(self) -> Iterator[tarfile.TarInfo]:
        """Each member's header, read from its recorded offset (the record's: KnownTars.headers) by concurrent range
        requests, WALK_AHEAD a round, not one after another. Each must be a header (its checksum) where the one before
        ends (the first right after the tar's global pax headers, if it starts with any: `_global_headers`), and the
        tar's end follow the last (zeros or nothing): else this raises, and the tar is walked."""
        from stages.resize.shards import remote_fs

        fs, path = remote_fs(self.tar)
        global_ = self._global_headers(fs, path)
        expected = len(global_)
        for first in range(0, len(self._recorded), WALK_AHEAD):
            starts = self._recorded[first:first + WALK_AHEAD]
            for start, block in zip(starts, _blocks(self.tar, fs, path, starts, HEADER_BLOCK)):
                # read after the global headers, as a walk reads each member: their keys apply to its pax header's
                with tarfile.open(fileobj=io.BytesIO(global_ + block), mode="r:") as tf:
                    m, after = tf.firstmember, tf.offset - len(global_)
                if start != expected or m is None or m.offset != len(global_) or \
                        m.offset_data - len(global_) > len(block):
                    raise tarfile.ReadError(f"{self.tar}: no member header at {start}")
                m.offset, m.offset_data, expected = start, start + m.offset_data - len(global_), start + after
                yield m
        if _blocks(self.tar, fs, path, [expected], 512)[0].strip(b"\0"):
            raise tarfile.ReadError(f"{self.tar}: members after the {len(self._recorded)} recorded")

    def _global_headers(self, fs: Any, path: str) -> bytes:
        """The bytes before the first recorded header: none, or a tar's global pax headers (`git archive` writes one,
        its commit: tarfile reads it with the member header after it, whose offset is recorded). They must be what
        tarfile reads as headers only, the first member's header right after them (`_recorded_members` checks it
        is: the member read from offset 0 is the one at the recorded offset); over HEADER_BLOCK: walked instead."""
        first = self._recorded[0]
        if first > HEADER_BLOCK:
            raise tarfile.ReadError(f"{self.tar}: {first} bytes before the first member header recorded")
        global_ = _blocks(self.tar, fs, path, [0], first)[0] if first else b""
        if len(global_) != first:
            raise tarfile.ReadError(f"{self.tar}: fewer than {first} bytes")
        return global_

    def _runs_of(self, members: Iterable[tarfile.TarInfo]) -> dict[str, Run | None]:
        """The runs of the members met, each header's offset kept (`headers`: recorded for the next run's walk)."""
        runs: dict[str, tuple[str, str, dict[str, tuple[int, int]]] | None] = {}
        last, headers = None, []
        for m in members:
            headers.append(m.offset)
            if m.isdir() or dot_member(m.name):
                continue
            key, ext = split_member(m.name)
            where = f"{self.tar}:{key}"
            name = printable(where)
            if key != last and name in runs:  # a second run of one key: which is the row's is not known
                runs[name] = None
            run = runs.setdefault(name, (key, where, {}))
            last = key
            if run is not None and (not m.isfile() or ext in run[2] or m.size > self._max):
                runs[name] = None
            elif run is not None:
                run[2][ext] = (m.offset_data, m.size)
        self.headers = headers if self._copy is None else None
        return runs

    def heads(self, source: str) -> Heads | None:
        run = self._run(source)
        if run is None:
            return None
        # the reader's own rules say which member is the target, a control, the mask (offsets in place of bytes)
        s = sample_from_members(run[0], run[1], run[2], [])  # type: ignore[arg-type]
        if s.problem is not None:
            return None
        if self._still is not None and self._copy is None and source in self._order:
            at, last = self._order[source], self._last_asked
            self._last_asked = at
            # (one of the window's that did not come, an empty member or a failed range: read alone, read_range)
            if at not in self._covered and \
                    any(p[0] not in self._fetched for p in (s.target, *s.controls, s.mask) if p is not None):
                self._fetch_ahead(at, last)
        return Heads(self._reader(s.target), tuple(self._reader(c) for c in s.controls),
                     None if s.mask is None else self._reader(s.mask))

    def _reader(self, at: object) -> Reader:
        offset, size = at  # type: ignore[misc]
        return partial(self._read, offset=offset, size=size)

    def _fetch_ahead(self, at: int, last: int | None) -> None:
        """The first FIRST_READ + 1 bytes of each picture of the HEADS_AHEAD samples from `at` in row order, by
        concurrent range requests; the window before dropped. A range that fails or comes back whole (a server that
        ignores ranges) is left out: its picture is read alone then (read_range), which names the error. `last`: the
        position of the sample asked before (None: the first): asked out of row order or more than HEADS_STRIDE
        after it, the sample's own heads alone."""
        ahead = HEADS_AHEAD if last is None or 0 < at - last <= HEADS_STRIDE else 1
        self._fetched, self._covered = {}, range(at, at + ahead)
        wanted = []
        for source in self._ahead[at:at + ahead]:
            run = self._runs.get(source) if self._runs else None
            wanted += [at_ for ext, at_ in (run[2].items() if run else ()) if ext != "txt" and at_[1] > 0]
        if not wanted:
            return
        from stages.resize.shards import remote_fs

        try:
            fs, path = remote_fs(self.tar)
            got = cat_ranges(fs, path, [o for o, _ in wanted], [o + min(size, FIRST_READ + 1) for o, size in wanted],
                             on_error="return", **self._match)
        except Exception:  # the client's own errors: each picture read alone, which names them
            return
        for (offset, size), data in zip(wanted, got):
            if isinstance(data, bytes) and len(data) == min(size, FIRST_READ + 1):
                self._fetched[offset] = data

    def _read(self, n: int, offset: int, size: int) -> bytes:
        head = self._fetched.get(offset)
        if head is not None and (n <= len(head) or len(head) == size):
            return head[:n]
        if self._copy is not None:
            return read_first(self._copy.name, n, offset, size)
        if self._still is not None:
            return read_range(self.tar, n, offset, size, **self._match)
        return read_first(self.tar, n, offset, size)

    def _whole(self, members: dict[str, tuple[int, int]]) -> dict[str, bytes]:
        """ext -> a member's bytes; a URL's members by concurrent range requests (one round trip a sample)."""
        if self._still is None or self._copy is not None:
            return {ext: self._read(size, offset, size) for ext, (offset, size) in members.items()}
        from stages.resize.shards import remote_fs

        fs, path = remote_fs(self.tar)
        # an empty member (a blank caption) is asked of no server: s3fs sends `bytes=o-(o-1)` for it, a range S3
        # may ignore, answering with the whole object
        asked = {ext: at for ext, at in members.items() if at[1] > 0}
        with client_errors(f"{self.tar}: a sample's members ({', '.join(asked)}) could not be read"):
            got = cat_ranges(fs, path, [o for o, _ in asked.values()], [o + n for o, n in asked.values()],
                             on_error="raise", **self._match) if asked else []
        return {ext: b"" for ext in members} | dict(zip(asked, got))

    def sample(self, source: str) -> SourceSample:
        """The sample read whole from its members' offsets (what streaming the tar up to it gives)."""
        try:
            run = self._run(source)
            if run is not None:
                members = self._whole(run[2])
                if all(len(data) == run[2][ext][1] for ext, data in members.items()):
                    return printable_names(sample_from_members(run[0], run[1], members, []))
        except (OSError, tarfile.TarError):
            pass
        return reread_tar(self.tar, source, self._max)  # which names a read error, or a tar changed meanwhile
