"""Read (and push) leases on a store at a URL: lease OBJECTS, the object-store form of store/lease.py's files.

`<prefix>/.leases/<host>-<pid>-<random>.json` holds the same record as a local lease (host, boot id, pid, its start
time and pid namespace, what it is, `versions` {table: [N, ...]}) plus `kind` ("read" or "push"). A process that
reads versions of a URL store (train, evaluate, the encoders reading `images`, verify: whatever opens it through
store/remote_cache.local_store) or pushes versions into it (store/remote_push.push) writes one, rewrites it every
`REFRESH_SECONDS` from a daemon thread (the heartbeat: the object's LastModified is its refresh time, set by the
server), and deletes it when done and at interpreter exit. A heartbeat never writes a lease that is gone (a gc
judged it dead: the process was paused past its margin): it marks it lost instead (store/lease.lose), and the
process stops at its next read of the URL's cached store (the folder store/remote_cache.local_store made: reads of
other stores go on); one older than its margin by the server's clock is lost too once a version it
names has lost its manifest. On S3 the rewrite is conditional on the ETag just read, so a gc's DELETE between that
look and the PUT is noticed too (a server without If-Match support gets a plain PUT after the look). `add` (more
versions) rewrites it by the same look. `pipeline store gc URL` (store/remote_gc.py) keeps
every version a live lease names. Liveness is store/lease.judge's: a lease of this host (its boot id) and pid
namespace is live while its process runs; any other is live until `STALE_SECONDS` (15 min; `stale_s`, decided
when the lease is held, where PIPELINE_LEASE_MINUTES asks more) after its last refresh, so a reader killed with -9
blocks gc for at most that long.

The race with gc (docs/store-format.md, "On an object store"): a reader learns its version from store.json, THEN
writes its lease, THEN checks that the version's manifest still exists (else it stops in one line). gc lists the
leases again right before each manifest DELETE, and once more after it, before the version's data: a reader whose
check found the manifest wrote its lease before that DELETE, so gc's second listing sees it and keeps the data
(store/remote_gc.py). A reader never reads a deleted object; every object is checked against its version's sealed
checksums.json anyway.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from store import format as fmt
from store import lease as local_lease
from store.remote import Remote, _modified
from store.remote_upload import precondition_failed

log = logging.getLogger("store")

LEASES_DIR = local_lease.LEASES_DIR
REFRESH_SECONDS = local_lease.REFRESH_SECONDS
STALE_SECONDS = local_lease.STALE_SECONDS


@dataclass
class RemoteLease:
    """One process's lease object on one remote store; `versions` grows as it opens more (`add`). `stale_s`: its
    margin, decided when it is made and used by every beat after; `scopes`: the local folders whose reads stop once
    it is lost (the URL's cached stores; "": every read)."""

    remote: Remote
    kind: str  # "read" | "push"
    what: str
    rel: str = ""
    versions: dict[str, list[int]] = field(default_factory=dict)
    stale_s: float = field(default_factory=local_lease.stale_seconds)
    scopes: list[str] = field(default_factory=lambda: [""])
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pid: int = field(default_factory=os.getpid)
    _warned_unconditional: bool = False  # the server refused a conditional PUT (`_write_over`)

    def record(self) -> dict[str, Any]:
        """store/lease.py's record (what `judge` reads), plus the kind and the time of this write."""
        return {**local_lease.process_identity(), "what": self.what, "kind": self.kind,
                "versions": self.versions, "argv": local_lease.command_line(), "stale_s": self.stale_s,
                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def _write(self) -> None:
        self.remote.write(self.rel, local_lease.record_bytes(self.record()))

    def add(self, versions: Iterable[tuple[str, int]]) -> None:
        """Name more versions: a read lease is rewritten only where it still is (`_rewrite`, the heartbeat's look: a
        paused process may add before its heartbeat wakes), else lost (LeaseLost), never written again."""
        local_lease.check_held(self)  # a lost lease is never written again
        with self._lock:
            held = {t: list(vs) for t, vs in self.versions.items()}
            for t, v in versions:
                if v not in self.versions.setdefault(t, []):
                    self.versions[t].append(v)
            if self.versions == held or not self.rel:
                return
            if self.kind != "read":  # a push re-sends any object a gc removed meanwhile (`_beat`)
                self._write()
                return
            how = self._rewrite()
            if how is None:
                return
            self.versions = held  # what it read under the lost lease, for its message
        self._lose(how)
        local_lease.check_held(self)

    def release(self) -> None:
        self._stop.set()
        local_lease.forget(self)
        _live.pop(id(self), None)
        with self._lock:
            if self.rel and self._pid == os.getpid():  # never a forked child's copy
                try:
                    self.remote.fs.rm_file(self.remote.path(self.rel))
                except FileNotFoundError:  # a gc judged it dead (the process was paused): nothing to remove
                    pass
                except Exception as e:  # noqa: BLE001  at exit the server may be gone: gc judges it stale later
                    log.warning("could not remove the lease %s/%s (%s); `store gc` ignores it once stale",
                                self.remote.url, self.rel, e)
                self.rel = ""

    def _heartbeat(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS) and self._beat():
            pass

    def _beat(self, now: float | None = None) -> bool:
        """One refresh; False once there is nothing more to refresh. A read lease is rewritten only where it still
        is (`_rewrite`), else lost, never written again."""
        with self._lock:
            if not self.rel:
                return False
            if self.kind != "read":  # a push re-sends, before its manifest, any object a gc removed meanwhile
                try:
                    self._write()
                except Exception as e:  # noqa: BLE001  a lost connection: try again at the next beat
                    log.warning("could not refresh the lease %s/%s (%s)", self.remote.url, self.rel, e)
                return True
            try:
                how = self._rewrite(now)
            except Exception as e:  # noqa: BLE001  a lost connection: the next beat tries again
                log.warning("could not refresh the lease %s/%s (%s)", self.remote.url, self.rel, e)
                return True
            if how is None:
                return True
        self._lose(how)
        return False

    def _rewrite(self, now: float | None = None) -> str | None:
        """Rewrite the read lease object (its refresh, and the versions it names) only where it still is: None when
        done, else how it was lost (by the heartbeat and by `add`, under `_lock`; other errors, a lost connection,
        are raised). An object gone is lost (a gc judged it dead). One older than its margin on the server's clock
        (`now`, default `Remote.now()`: what gc judges it by) may be judged dead by a gc running now: it is
        rewritten (so gc's look right before each DELETE keeps what it names from now on), then every version it
        names must still have its manifest (gc deletes that first), else it is lost. On S3 the PUT is conditional
        on the ETag just read, so a gc's DELETE between the look and the PUT is noticed too."""
        path = self.remote.path(self.rel)
        try:
            self.remote.fs.invalidate_cache()
            info = self.remote.fs.info(path)
            age = (self.remote.now() if now is None else now) - _modified(info)
            self._write_over(path, info.get("ETag") if self.remote.is_s3 else None)
            if age <= self.stale_s:
                return None
            gone = [f"{t} v{v}" for t, vs in sorted(self.versions.items()) for v in vs
                    if not self.remote.exists(f"{t}/v{v}/{fmt.MANIFEST}")]
            if not gone:
                log.warning("the lease %s/%s was not refreshed for %.0f min (the process was paused); what it "
                            "names is still there: refreshed", self.remote.url, self.rel, age / 60)
                return None
            return f"was not refreshed for {age / 60:.0f} min and {', '.join(gone)} is gone"
        except FileNotFoundError:
            return f"was removed ({self.rel})"
        except OSError as e:
            if precondition_failed(e):
                return f"was removed ({self.rel})"
            raise

    def _lose(self, how: str) -> None:
        local_lease.lose(self, self._stop, self.remote.url, self.what, how, self.versions, self.stale_s,
                         scopes=list(self.scopes))

    def _write_over(self, path: str, etag: str | None) -> None:
        """The lease's PUT over the object just looked at: If-Match on its ETag where there is one (a DELETE
        meanwhile fails it: 412 / 404). A server that refuses a conditional PUT for any other reason (one without
        If-Match support) gets a plain PUT, warned once: else the lease would never be refreshed again and a gc
        elsewhere would remove, 15 min later, versions this live reader uses; only the one-request window between
        the look and the PUT goes unwatched then."""
        if etag:
            try:
                self.remote.fs.pipe_file(path, local_lease.record_bytes(self.record()), IfMatch=etag)
                return
            except Exception as e:  # noqa: BLE001
                if isinstance(e, FileNotFoundError) or precondition_failed(e):
                    raise
                if not self._warned_unconditional:
                    self._warned_unconditional = True
                    log.warning("%s refused the conditional rewrite of the lease %s (%s); it is rewritten with a "
                                "plain PUT whenever refused (a gc's DELETE in the instant between the look and the "
                                "write then goes unnoticed)", self.remote.url, self.rel, e)
        self._write()


def hold(remote: Remote, versions: Iterable[tuple[str, int]], what: str, kind: str = "read",
         scope: str = "") -> RemoteLease:
    """Write a lease object naming `versions` and start its heartbeat; released at interpreter exit. `scope`: the
    local folder its readers read (store/lease.lose; "": any)."""
    lease = RemoteLease(remote, kind, what, scopes=[scope])
    for t, v in versions:
        lease.versions.setdefault(t, []).append(int(v))
    atexit.register(lease.release)  # registered first: a signal landing after the PUT must not leave it behind
    lease.rel = f"{LEASES_DIR}/{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.json"
    try:
        lease._write()
    except BaseException:  # nothing written (no bucket, no server): nothing to remove at exit
        lease.rel = ""
        raise
    threading.Thread(target=lease._heartbeat, name="store-remote-lease", daemon=True).start()
    _live[id(lease)] = lease
    return lease


_held: dict[str, RemoteLease] = {}  # the read lease of each URL
_live: dict[int, RemoteLease] = {}  # every lease `hold` wrote and nothing released yet (`release_all`)


def _what() -> str:
    """What the process is, for a human reading gc's output: the command (`pipeline train`, ...)."""
    return " ".join([os.path.basename(sys.argv[0]) if sys.argv else "python", *sys.argv[1:3]])


def hold_reading(url: str, versions: Iterable[tuple[str, int]], storage_options: dict[str, Any] | None = None,
                 root: str | Path | None = None) -> RemoteLease | None:
    """The process's one read lease on this URL (created on first use, then extended; released at exit), then a
    check that every named version still has its manifest: one gc removed before it saw the lease is reported.
    `root`: the local folder the versions are read from (the URL's cached store), whose reads stop once the lease is
    lost; None: every read of the process."""
    from schemas.errors import UserError
    from store.remote import open_remote, remote_errors

    versions = list(versions)
    scope = "" if root is None else str(root)
    with remote_errors(url, "read lease"):
        lease = _held.get(url)
        if lease is not None:
            local_lease.check_held(lease)  # lost while the process was paused: nothing more is read under it
        if lease is None or not lease.rel:
            remote = open_remote(url, storage_options)
            try:
                lease = _held[url] = hold(remote, versions, _what(), scope=scope)
            except PermissionError as e:  # read-only credentials: reading goes on without a lease
                log.warning("%s: no read lease (%s); a `store gc` meanwhile could remove versions this process "
                            "reads", url, e)
                return None
        else:  # a fresh client, as every open (store/remote.open_remote): the server may have restarted since
            lease.remote = open_remote(url, storage_options)
            if scope not in lease.scopes:  # another cache folder reads the URL too
                lease.scopes.append(scope)
            lease.add(versions)
        remote = lease.remote
        remote.fs.invalidate_cache()
        for t, v in versions:
            if not remote.fs.exists(remote.path(f"{t}/v{v}/{fmt.MANIFEST}")):
                release_reading(url)  # the process stops here: nothing of this URL is read
                raise UserError(f"{url}: {t} v{v} was removed (by `store gc`) while this process opened it; "
                                "rerun to read the current version")
    return lease


# ---------------------------------------------------------------- what gc reads


def leases(remote: Remote, listing: dict[str, tuple[int, float]], now: float | None = None) -> list[local_lease.Found]:
    """Every lease object, judged live or dead (`listing`: {rel: (size, LastModified epoch)}) by the server's
    clock (`now`, default `remote.now()`: LastModified is the server's); a damaged one (objects are written whole)
    by its age alone (`local_lease.judge`: its heartbeat rewrites it whole every beat)."""
    now = remote.now() if now is None else now
    out = []
    for rel, (_, mtime) in sorted(listing.items()):
        if not (rel.startswith(LEASES_DIR + "/") and rel.endswith(".json")):
            continue
        try:
            record, damaged = local_lease.parse_record(remote.read(rel, small=True))
        except FileNotFoundError:  # released meanwhile
            continue
        out.append(local_lease.judge(PurePosixPath(rel), record, mtime, now, damaged))  # type: ignore[arg-type]
    return out


def release_reading(url: str) -> None:
    """The process is done reading `url` (a command that ends before the process does, e.g. `store verify`)."""
    lease = _held.pop(url.rstrip("/"), None)
    if lease is not None:
        lease.release()


def release_all() -> None:
    """Every lease this process holds (a process that runs several commands in turn, e.g. the tests): the read
    leases, and push leases of writers left open (store/remote_parts.hold_parts)."""
    for url in list(_held):
        release_reading(url)
    for lease in list(_live.values()):
        lease.release()
