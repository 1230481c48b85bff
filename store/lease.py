"""Read leases: a process that reads table versions names them in a small file, and `store gc` keeps every
version a live lease names (docs/store-format.md, "Read leases").

`STORE/.leases/<host>-<pid>-<random>.json` (a dot folder: no table, so verify / inspect / repair ignore it) holds
host, pid, the process's start time, its pid namespace, what it is (train, evaluate, encode-text, ...) and
`versions` ({table: [N, ...]}), sealed with its own CRC32C (`record_bytes`: store/checksum.py, as store.json). It is
written with `store.format.atomic_write_bytes` under the store lock, the lock
`store gc` (store/gc.py) holds from its plan to its last delete: so a lease either exists before gc plans (its
versions are kept) or is written after gc is done (and then names versions that exist, which `hold` checks). It is
removed when the reader is done or garbage collected, and at interpreter exit, on error too.

Another remover, the URL cache's eviction (store/remote_cache.py: dead lease files of its cached stores, and at
open whole versions no live lease names), judges leases under the cache lock only, never the store lock (taking it
there would risk a lock-order inversion, or a process blocking on its own flock, wherever a fetch, and so an
eviction, runs while its process holds a store lock). A lease of this boot and pid namespace it judges by its pid
(a paused reader still runs: never dead); any other (a container sharing the cache folder) by its age - so a reader
of another container paused past its margin and woken mid-eviction (its lease removed, its version not yet renamed
away) writes its lease again, reads on, and then may fail on a missing file instead of stopping with the lease
line.

All remove a dead lease's file in one place, `remove_dead`: renamed aside first (out of its reader's reach: a
reader refreshes by path), judged again there, and removed only if still dead - so a lease its reader refreshed
between the judgement and the removal is kept, and so is what it names (unlinked by path, it was lost).

A kill -9 leaves the file behind; it must not block gc for ever. Liveness:
- same host (the running kernel's boot id, `schemas.host.host_id`: never the host name, which nodes given one
  name share, and the init pid namespace's id is the same on every host) and pid namespace: the pid is running
  and started when the lease says (a reused pid is not the reader) and has not ended (a zombie: killed, not yet
  reaped by its parent); decided at once, whatever the file's age;
- another host (a store on a shared file system), or a lease without a boot id (written before it was recorded):
  the reader cannot be asked, so its lease is refreshed (file mtime) every `REFRESH_SECONDS` by a daemon thread,
  and counts as live until `STALE_SECONDS` after its last refresh (15 min: a margin of several missed refreshes
  and of clock skew between hosts; a reader may record a longer one, `stale_s`, from `LEASE_MINUTES_ENV`: read
  once, when the lease is held, and kept for its life - an environment changed later moves no live lease's margin).
gc removes the files of dead leases (`remove_dead`), and so does every lease's start (`_remove_dead_met`: this
host's only).
- a damaged lease (its seal fails: a flipped byte could name another pid or version) says nobody's pid: judged by its
  refresh age alone, at the default margin. While live, which versions it keeps cannot be told, so gc stops with one
  line, removing nothing (the URL cache's eviction, housekeeping, keeps every version of its cached store whole
  instead, a whole-URL pull copies and a push sends every version: `live_versions`); its reader's heartbeat, reading its file
  back each beat, writes it again within `REFRESH_SECONDS` (as one removed, below); a dead reader's is removed once
  stale.

A reader paused longer than that (SIGSTOP, a suspended VM, a hung mount) may have had its lease judged dead by a
gc on another host, its file removed, and its versions removed with it. On waking, its heartbeat (and `add`) looks
under the store lock (`_lost_how`) with ONE rule: the lease is lost iff a version it names is gone (or incomplete,
or another version now has its number: a writer numbers a new version one past the newest folder left, so a gc
that took v2 lets the next write be another v2; told apart by its manifest's inode, mtime and size, `Lease.ids`);
then it is never written again, it is marked lost (`lose`) and the reader stops at its next read (`check_held`,
store/shard_io.py) with one line instead of reading on from a version whose files may be gone, or a mix. Removed
or old with every version intact (gc kept them: the current version, one another lease holds), it is written again
or refreshed, with a warning, and the reader goes on. Safe against `store gc`, which holds that lock from its plan
to its last delete: under it, no gc is midway, and what is complete now stays until the lease is seen again by the
next plan (not against the cache's eviction, above).
(A URL's lease objects, store/remote_lease.py, have no such lock: there a removed lease is always lost.)
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from schemas.errors import UserError, without_secrets
from schemas.host import host_id, pid_namespace_id
from store import format as fmt
from store.checksum import SealError, is_sealed, seal, unseal

log = logging.getLogger("store")

LEASES_DIR = ".leases"
REFRESH_SECONDS = 60.0
STALE_SECONDS = 15 * 60.0
# A job that gets paused for longer on purpose (a preempted queue, a suspended VM) sets this many minutes: its
# leases record it (`stale_s`) and every gc judges them by it (never below STALE_SECONDS).
LEASE_MINUTES_ENV = "PIPELINE_LEASE_MINUTES"


def stale_seconds() -> float:
    """How long a lease held now stays live after its last refresh: read once per lease, at `hold` (its `stale_s`,
    recorded and used for its life; a bad value is refused there, never in a heartbeat thread)."""
    raw = os.environ.get(LEASE_MINUTES_ENV, "").strip()
    if not raw:
        return STALE_SECONDS
    try:
        minutes = float(raw)
    except ValueError:
        raise UserError(f"{LEASE_MINUTES_ENV}={raw!r} is not a number of minutes; set it to e.g. 120, or unset it "
                        f"for the default {STALE_SECONDS / 60:.0f}") from None
    return max(STALE_SECONDS, minutes * 60)


def _stale_after(record: dict[str, Any]) -> float:
    """The margin a lease record asks for (`stale_s`), never below the default."""
    asked = record.get("stale_s")
    return max(STALE_SECONDS, float(asked)) if isinstance(asked, (int, float)) else STALE_SECONDS


def record_bytes(record: dict[str, Any]) -> bytes:
    """A lease record as written (a local file, a URL's object): sealed JSON (store/checksum.py), so a flipped
    byte is seen as damage, never read as another pid (a live reader judged gone) or another version (the one it
    reads left unkept)."""
    return seal(record)


def parse_record(data: bytes) -> tuple[dict[str, Any], str | None]:
    """(the record, None), or ({}, why it is damaged): a seal that fails, a record that is no JSON object, or
    `versions` that are not table -> version numbers. A record without a seal (an earlier release's) is read as
    plain JSON."""
    try:
        if is_sealed(data):
            record = unseal(data)
        else:
            record = json.loads(data)
    except (SealError, ValueError) as e:  # (a JSONDecodeError, a UnicodeDecodeError)
        return {}, str(e)
    if not isinstance(record, dict):
        return {}, "not a JSON object"
    if not _names_versions(record):
        return {}, "its versions are not table -> version numbers"
    return record, None


class LeaseLost(UserError):
    """This process's read lease was removed, or not refreshed for longer than gc's margin, and (a local lease) a
    version it names is gone: what it reads may be gone."""


# id(lease) -> (the folders its readers read below, "" for any; why it was lost): set by its heartbeat thread, read
# by the readers
_lost: dict[int, tuple[tuple[str, ...], str]] = {}
_lost_lock = threading.Lock()


def lose(lease: object, stopped: threading.Event, where: str, what: str, how: str,
         versions: dict[str, list[int]], stale_s: float, scopes: Iterable[str] = ("",)) -> None:
    """The heartbeat of `lease` found it `how` ("was removed (F) and vae v1 is gone", "was not refreshed for 17 min
    and ...", a URL lease's "was removed (F)"): it is never
    written again, and the process's next read below one of `scopes` (store folders: a local store, the cached copy
    of a URL's; "": any) raises (`check_held`) - unless it was released meanwhile (`stopped`; checked under the lock
    `forget` takes, so a released lease is never marked after). Scoped: a lease a process left unreleased (a failed
    command whose traceback a caller keeps, in-process) must not stop the reads of another store. `stale_s`: the
    lease's margin, for the message."""
    named = ", ".join(f"{t} v{v}" for t, vs in sorted(versions.items()) for v in vs) or "its versions"
    why = (f"the read lease of this {what} on {where} {how}: the process was paused (SIGSTOP, a suspended VM, a "
           f"hung mount) for longer than a lease outlives its last refresh ({stale_s / 60:.0f} min), so a "
           f"`store gc` may have removed what it reads ({named}); stopped rather than read on. Rerun (a training "
           f"resumes from its last checkpoint); if the job gets paused on purpose, raise the lease timeout: "
           f"{LEASE_MINUTES_ENV}=MINUTES")
    with _lost_lock:
        if stopped.is_set():
            return
        _lost[id(lease)] = (tuple(os.path.join(os.path.realpath(s), "") if s else "" for s in scopes), why)
    log.error("%s", why)


def forget(lease: object) -> None:
    """`lease` is released: a process that goes on (`run all`, the tests) reads again without it."""
    with _lost_lock:
        _lost.pop(id(lease), None)


def check_held(lease: object | None = None, path: str | None = None) -> None:
    """Raise `LeaseLost` once a heartbeat found `lease` lost, or (no lease) a lease of this process whose scopes
    hold `path` (a version's folder, as `os.path.realpath` spells it; None: any): every read checks (one dict
    test)."""
    if _lost:
        if lease is not None:
            found = _lost.get(id(lease))
            why = found[1] if found else None
        else:
            why = next((w for scopes, w in list(_lost.values()) if path is None
                        or any(not s or os.path.join(path, "").startswith(s) for s in scopes)), None)
        if why is not None:
            raise LeaseLost(why)


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from field 3 (the state) on; None where unknown (no such process, no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # after the (command), which may hold spaces and parentheses


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None where unknown."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_identity() -> dict[str, Any]:
    """Who holds a lease (local files and the lease objects of a URL, store/remote_lease.py): what `judge` reads.
    The host name is for people; the boot id says whether the pid is this host's to ask."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": host_id(), "pid": pid, "pid_start": _proc_start(pid),
            "pid_namespace": _pid_namespace()}


def pid_gone(pid: int, started: int | None) -> str | None:
    """Why this host's process `pid` (started at `started`) is not the lease's reader any more; None while it runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "is gone"
    except PermissionError:  # someone else's process: it exists
        pass
    fields = _proc_stat(pid)
    if fields is None:  # no /proc to ask: kill(0) says it exists
        return None
    if fields[0] in ("Z", "X"):  # killed (kill -9), its parent has not wait()ed yet: it reads nothing any more
        return "has ended (not reaped by its parent yet)"
    if started is not None and int(fields[19]) != started:
        return "is gone (the pid is another process's now)"
    return None


def process_tag() -> str:
    """`<pid>-<start time>-n<pid namespace>`: this process in a temp file's name (store/remote_shards.py's
    fetches), for `tag_gone`; a part left out where unknown (no /proc: `<pid>` alone). The namespace: containers
    sharing one cache folder (pods mounting one node-local volume) number their processes apart, so pid 123 of
    another container is not this one's pid 123."""
    pid = os.getpid()
    start, ns = _proc_start(pid), pid_namespace_id()
    return "-".join([str(pid), *([str(start)] if start is not None else []), *([f"n{ns}"] if ns is not None else [])])


def tag_gone(tag: str, mtime: float | None = None, now: float | None = None) -> str | None:
    """Why the process of `process_tag`'s `tag` is no longer running; None while it runs, or when the tag names
    none. This pid namespace's (or a tag without one, as earlier releases wrote): `pid_gone`'s rules, a zombie has
    ended, a pid with another start time is another process. Another namespace's (another container on the node;
    or this one's unknown): its pid cannot be asked here, so its file (`mtime`: written to as the fetch streams)
    is gone once older than `STALE_SECONDS`, the read leases' margin; without `mtime`, None."""
    pid, *rest = tag.split("-")
    spaces = [r[1:] for r in rest if r.startswith("n")]
    starts = [r for r in rest if not r.startswith("n")]
    try:
        if len(spaces) > 1 or len(starts) > 1 or not all(s.isdigit() for s in spaces):
            return None
        if spaces and int(spaces[0]) != pid_namespace_id():
            if mtime is None:
                return None
            age = (time.time() if now is None else now) - mtime
            return (f"is of another pid namespace (n{spaces[0]}) and not written for {age / 60:.0f} min"
                    if age > STALE_SECONDS else None)
        return pid_gone(int(pid), int(starts[0]) if starts else None)
    except ValueError:
        return None


def command_line() -> list[str]:
    """The command's first words, for a human reading a lease (local or on a remote: anyone who may list the
    bucket reads it), a credential given as `-o secret=...` masked (schemas.errors.without_secrets)."""
    return [without_secrets(w) for w in sys.argv[:6]]


@dataclass
class Lease:
    """The versions this process reads from one store; `path` is None when the store is read-only (no gc can run
    there from here either) and the lease is then a no-op. `stale_s`: its margin, decided when it is made (`hold`)
    and used by every look and heartbeat after."""

    root: Path
    what: str
    versions: dict[str, list[int]] = field(default_factory=dict)
    path: Path | None = None
    # (table, version) -> `_identity` of its manifest when named (`hold`, `add`): a version named without one (a
    # Lease made otherwise) is judged by completeness alone
    ids: dict[tuple[str, int], tuple[int, int, int]] = field(default_factory=dict)
    stale_s: float = field(default_factory=stale_seconds)
    _stop: threading.Event = field(default_factory=threading.Event)
    _pid: int = field(default_factory=os.getpid)
    _written: bytes = b""  # the file's bytes as last written (`_put`): other bytes there are damage

    def version(self, table: str) -> int | None:
        """The version of `table` this lease resolved (the first one named)."""
        named = self.versions.get(table)
        return named[0] if named else None

    def record(self) -> dict[str, Any]:
        return {**process_identity(), "what": self.what, "versions": self.versions, "argv": command_line(),
                "stale_s": self.stale_s, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def add(self, table: str, version: int) -> bool:
        """Name one more version (under the store lock); False when it no longer exists (gc took it first).
        LeaseLost once the lease was lost, or is found lost here (`_lost_how`, the heartbeat's look: a paused
        process may add before its heartbeat wakes): it is never written again. Found removed with what it names
        intact, it is written again there (and then with `version`)."""
        check_held(self)
        path = self.path  # None once released (another thread may release it meanwhile)
        if path is None:  # read-only store or released: nothing to register
            return fmt.is_complete(fmt.version_dir(self.root, table, version))
        with fmt.flock(self.root / fmt.STORE_LOCK):
            how = self._lost_how(path)
            if how is not None:
                self._lose(how)
                check_held(self)
                return False  # released meanwhile (by another thread): nothing to add to
            ident = _identity(self.root, table, version)
            if ident is None:
                return False
            if version not in self.versions.setdefault(table, []):
                self.versions[table].append(version)
                self.ids[(table, version)] = ident
                self._write(path)
        return True

    def _write(self, path: Path) -> None:
        """Write the lease file (under the store lock); removed again when the lease was released meanwhile (by
        another thread: `release` sets `_stop` before its unlink, so one of the two removes what this wrote)."""
        path.parent.mkdir(exist_ok=True)  # `.leases/` removed by hand: the lease must still be written
        self._put(path)
        if self._stop.is_set():
            path.unlink(missing_ok=True)

    def _put(self, path: Path) -> None:
        data = record_bytes(self.record())
        fmt.atomic_write_bytes(path, data)
        self._written = data

    def _intact(self, path: Path) -> bool:
        """Whether the file holds what this lease last wrote (one read of a few hundred bytes a beat): a damaged
        one is judged by its age by every gc (`judge`), and kept live while refreshed, stopping every gc."""
        return path.read_bytes() == self._written

    def release(self) -> None:
        self._stop.set()
        forget(self)
        if self.path is not None and self._pid == os.getpid():  # never a forked child's copy
            self.path.unlink(missing_ok=True)
            self.path = None

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS) and self._beat():
            pass

    def _beat(self, now: float | None = None) -> bool:
        """One refresh (its mtime); False once there is nothing more to refresh. A fresh lease is refreshed at
        once; a removed or old one is looked at under the store lock (`_lost_how`: written again or refreshed while
        every version it names is intact, else lost, `lose`)."""
        path = self.path
        if path is None:
            return False
        now = time.time() if now is None else now
        try:
            try:
                if now - path.stat().st_mtime <= self.stale_s and self._intact(path):
                    os.utime(path)
                    return True
            except FileNotFoundError:  # a gc judged it dead: looked at under the lock, as an old one (or damaged)
                pass
            with fmt.flock(self.root / fmt.STORE_LOCK):
                if self._stop.is_set():  # released meanwhile (its file removed by `release`)
                    return False
                how = self._lost_how(path, now)
                if how is None:
                    os.utime(path)
                    return True
        except OSError as e:
            if self._stop.is_set():  # released meanwhile: nothing more to refresh
                return False
            log.warning("could not refresh the read lease %s (%s)", path, e.strerror or e)  # NFS: next beat retries
            return True
        self._lose(how)
        return False

    def _lost_how(self, path: Path, now: float | None = None) -> str | None:
        """How this lease was lost, None while it stands; looked at under the store lock (by the heartbeat and by
        `add`), which every local `store gc` holds from its plan to its last delete (the URL cache's eviction does
        not: the module's docstring). One rule: lost iff a version it names is gone (or incomplete, or another version
        of that number: its manifest is not the one named, `ids`). A lease removed (a gc judged it dead: paused past
        its margin) or older than its margin (`now`: this host's clock, as a gc elsewhere judges it) whose versions
        are all intact stands: gc kept them (the current version, one another lease holds), and no gc is midway while
        we hold the lock, so a removed one is written again here (the caller refreshes an old one). Not so on a URL
        (store/remote_lease.py): no lock there, so a gc may be between its look and its DELETE; a removed lease
        object stays lost."""
        try:
            age: float | None = (time.time() if now is None else now) - path.stat().st_mtime
            intact = self._intact(path)
        except FileNotFoundError:
            age, intact = None, False
        if age is not None and age <= self.stale_s and intact:
            return None
        gone = [f"{t} v{v}" + ("" if ident is None else " (a new version of that number since)")
                for t, vs in sorted(self.versions.items()) for v in vs
                if (ident := _identity(self.root, t, v)) is None or self.ids.get((t, v), ident) != ident]
        found = (f"was removed ({path.name})" if age is None else f"was damaged ({path.name})" if not intact
                 else f"was not refreshed for {age / 60:.0f} min")
        if gone:
            return f"{found} and {', '.join(gone)} is gone"
        named = ", ".join(f"{t} v{v}" for t, vs in sorted(self.versions.items()) for v in vs) or "nothing yet"
        if not intact:  # removed (a gc judged it dead) or damaged (read by no gc): written again
            log.warning("read lease %s %s, but every version it names is still there (%s): written again, reading "
                        "on", path, "was damaged (its bytes are not what this reader wrote)" if age is not None else
                        f"was removed by a `store gc` that judged it dead (this process was paused, e.g. SIGSTOP or "
                        f"a suspended VM, for longer than its margin of {self.stale_s / 60:.0f} min)", named)
            self._write(path)
        else:
            log.warning("read lease %s was not refreshed for %.0f min (the process was paused); what it names is still "
                        "there (%s): refreshed", path, age / 60, named)
        return None

    def _lose(self, how: str) -> None:
        lose(self, self._stop, str(self.root), self.what, how, self.versions, self.stale_s, scopes=[str(self.root)])


def _identity(root: Path, table: str, version: int) -> tuple[int, int, int] | None:
    """Which version `table` v`version` is: its manifest's `fmt.file_identity`, None while it is not complete."""
    try:
        return fmt.file_identity(os.stat(fmt.version_dir(root, table, version) / fmt.MANIFEST))
    except (FileNotFoundError, NotADirectoryError):
        return None


def hold(root: str | Path, tables: dict[str, int | None], what: str, owner: object | None = None) -> Lease:
    """A lease on the given versions of one store (None = the table's current version, resolved here under the
    store lock; a table the store does not have is left out, for the caller's own error). With `owner`, the
    lease is released when that object is garbage collected; always at interpreter exit."""
    root = Path(root)
    lease = Lease(root, what)
    # Registered before the lease file exists: a signal (SystemExit / KeyboardInterrupt) that lands between
    # writing the file and returning must not leave a lease that blocks gc (test_signals can hit it under load).
    if owner is not None:
        weakref.finalize(owner, lease.release)
    atexit.register(lease.release)
    try:
        (root / LEASES_DIR).mkdir(exist_ok=True)
        with fmt.flock(root / fmt.STORE_LOCK):
            current = {t: int(v["current"]) for t, v in fmt.read_store_record(root)["tables"].items()}
            for table, v in tables.items():
                v = current.get(table) if v is None else v
                ident = None if v is None else _identity(root, table, v)
                if ident is not None:
                    lease.versions[table] = [v]
                    lease.ids[(table, v)] = ident
            _remove_dead_met(root)
            lease.path = root / LEASES_DIR / f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}.json"
            lease._put(lease.path)
    except OSError as e:  # a read-only store: reading goes on without a lease
        log.warning("store %s: no read lease (%s); a `store gc` meanwhile could remove versions this %s reads",
                    root, e.strerror or e, what)
        lease.path = None
        current = {t: int(v["current"]) for t, v in fmt.read_store_record(root)["tables"].items()}
        lease.versions = {t: [current[t] if v is None else v] for t, v in tables.items()
                          if (current.get(t) if v is None else v) is not None}
        return lease
    threading.Thread(target=lease._refresh, name="store-lease-refresh", daemon=True).start()
    return lease


def _remove_dead_met(root: Path) -> None:
    """At a lease's start, under the store lock: remove the files of this host's dead leases in .leases/ (a killed
    reader's stayed until the next `store gc`), through `remove_dead`. Cheap: one listing; a file is read and
    judged only where its name's pid is gone on this host. Another host's lease is left to gc (and to its own
    host's starts): telling its age is a stat of its file, a metadata round trip on a shared file system, for every
    other host's lease at every start, all under the store lock (64 ranks' starts: ~4,000 of them, one after the
    other). A failure here (a read-only folder) leaves them to gc."""
    dead, asides, me = [], False, socket.gethostname()
    try:
        with os.scandir(root / LEASES_DIR) as listing:
            for entry in listing:
                asides |= ASIDE in entry.name  # a killed remover's leftover: remove_dead removes it too
                if entry.name.endswith(".json") and _gone_here(entry.name, me):
                    found = _judged_file(Path(entry.path))
                    dead += [found] if found is not None and not found.live else []
        if dead or asides:
            remove_dead(root, dead)
    except OSError as e:
        log.debug("store %s: dead leases left for gc (%s)", root, e.strerror or e)


def _gone_here(name: str, me: str) -> bool:
    """Whether the lease file `name` (`<host>-<pid>-<random>.json`) is of this host (`me`) by its name, and its pid
    no longer runs here (its record then judges it: another node of the same host name is no reader here)."""
    host, pid, _ = (name[:-len(".json")].rsplit("-", 2) + ["", ""])[:3]
    # (no pid has 10 digits: such a name is judged by its record)
    return host == me and pid.isdigit() and (len(pid) > 9 or pid_gone(int(pid), None) is not None)


# ---------------------------------------------------------------- what gc reads


@dataclass(frozen=True)
class Found:
    path: Path
    record: dict[str, Any]
    live: bool
    why: str  # "pid 123 on host, running" / "pid 123 on host is gone" / "refreshed 20 s ago on other-host"
    damaged: bool = False  # its record did not read (`parse_record`): judged by its refresh age alone
    # which file was read (a local one's `fmt.file_identity`): another file at that path later (an atomic rewrite:
    # a new inode) is another lease to a caller that says each once (store/remote_cache.py keys on the inode: a
    # refresh's os.utime changes only the mtime)
    seen: tuple[int, int, int] | None = None

    def describe(self) -> str:
        return f"{self.record.get('what', '?')} ({self.why}, lease {self.path.name})"

    def versions(self) -> Iterable[tuple[str, int]]:
        """The versions it names. A live damaged lease names versions no one can tell: UserError (gc and repair's
        retiring of a version stop there, before removing anything more; the URL cache's eviction, a whole-URL pull
        and a push ask only undamaged ones: `live_versions`)."""
        if self.damaged and self.live:
            # "anything more": asked mid-way too (a URL's gc looks again before each version's DELETE; a stage
            # sets the damaged version aside after its commit), where what went before stays removed
            raise UserError(damaged_lease_line(self, "this stopped before removing anything more; rerun later, or "
                                                     "remove the file if its reader is known to be gone"))
        for table, vs in (self.record.get("versions") or {}).items():
            for v in vs:
                yield table, int(v)


def damaged_lease_line(found: Found, consequence: str) -> str:
    """The one line for a live damaged lease `found`: `consequence`, what the caller does about it (gc: "this
    stopped before removing anything more"; push: "every complete version is pushed to URL"), and when that ends."""
    return (f"read lease {found.path} is damaged ({found.why}): its reader may still run, and which versions it reads "
            f"cannot be told, so {consequence} (a running reader writes its lease again within {REFRESH_SECONDS:.0f} "
            f"s; one of a gone reader counts as dead {STALE_SECONDS / 60:.0f} min after its last refresh)")


def warn_damaged(where: object, damaged: Iterable[Found], consequence: str) -> None:
    """One warning per live damaged lease in `damaged` (`damaged_lease_line`), for a caller that goes on past them
    rather than stop (`live_versions`): `where`, the store or URL they lease; `consequence`, what the caller does
    about them ("every complete version is pushed to URL")."""
    for found in damaged:
        log.warning("%s: %s", where, damaged_lease_line(found, consequence))


def live_versions(found: Iterable[Found]) -> tuple[set[tuple[str, int]], list[Found]]:
    """(the versions the live leases among `found` name, the live damaged ones). A damaged one names versions no one
    can tell: a caller whose removing is optional housekeeping (the URL cache's eviction, store/remote_cache.py; a
    whole-URL pull leaving out the URL's garbage, store/remote_gc.py `not_kept`; a push leaving out the store's,
    store/gc.py `not_kept`) keeps every version of that store while it is fresh, and says so (`warn_damaged`),
    instead of stopping; `store gc`, asked for, stops (`Found.versions`)."""
    leased: set[tuple[str, int]] = set()
    damaged: list[Found] = []
    for lease in found:
        if lease.live and lease.damaged:
            damaged.append(lease)
        elif lease.live:
            leased |= set(lease.versions())
    return leased, damaged


def _names_versions(record: dict[str, Any]) -> bool:
    """Whether a lease record's `versions` is what a lease writes: {table: [version number, ...]}."""
    named = record.get("versions") or {}
    return isinstance(named, dict) and all(
        isinstance(vs, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in vs)
        for vs in named.values())


def judge(path: Path, record: dict[str, Any], mtime: float, now: float | None = None,
          damaged: str | None = None) -> Found:
    """Live or dead. A `damaged` record (`parse_record`: a seal that fails, a record that does not parse, versions
    that are no version numbers) cannot say whose it is: judged by its refresh age alone, as another host's (its
    reader, if it runs, refreshes it, and writes it again: `Lease._lost_how`), at the default margin."""
    now = time.time() if now is None else now
    if damaged is not None:
        age = now - mtime
        if age <= STALE_SECONDS:
            return Found(path, {}, True, f"{damaged}; refreshed {age:.0f} s ago", damaged=True)
        return Found(path, {}, False, f"unreadable ({damaged}); not refreshed for {age / 60:.0f} min", damaged=True)
    host, pid = record.get("host"), record.get("pid")
    if record.get("boot_id") == host_id() and record.get("pid_namespace") == _pid_namespace() and isinstance(pid, int):
        gone = pid_gone(pid, record.get("pid_start"))
        if gone is None:
            return Found(path, record, True, f"pid {pid} on {host}, running")
        return Found(path, record, False, f"pid {pid} on {host} {gone}")
    age = now - mtime
    if age <= _stale_after(record):
        return Found(path, record, True, f"pid {pid} on {host}, refreshed {age:.0f} s ago")
    return Found(path, record, False, f"pid {pid} on {host}, not refreshed for {age / 60:.0f} min")


def leases(root: Path) -> list[Found]:
    """Every lease file of the store, judged live or dead (a damaged one - a torn write is impossible with atomic
    writes - by its refresh age: `judge`)."""
    folder = Path(root) / LEASES_DIR
    if not folder.is_dir():
        return []
    return [found for p in sorted(folder.glob("*.json")) if (found := _judged_file(p)) is not None]


def _judged_file(p: Path, named: Path | None = None) -> Found | None:
    """The lease file `p` judged (as the lease `named`, its own path unless given); None once it is gone."""
    mtime, seen = 0.0, None  # not even stat'ed: as old as can be
    try:
        st = p.stat()
        mtime, seen = st.st_mtime, fmt.file_identity(st)
        record, damaged = parse_record(p.read_bytes())
    except FileNotFoundError:  # released meanwhile
        return None
    except OSError as e:  # unreadable here (permissions, I/O): whose it is cannot be told, as a damaged one
        record, damaged = {}, f"cannot be read: {e.strerror or e}"
    return replace(judge(named or p, record, mtime, damaged=damaged), seen=seen)


# `<lease>.json.aside-<process tag>-<random>`: a dead lease's file taken aside by `remove_dead` to be judged again
# (no `.json`: no judge reads it). One a killed remover left is removed once that remover is gone (`tag_gone`).
ASIDE = ".aside-"


def remove_dead(root: Path, found: list[Found]) -> list[Found]:
    """`found` (`leases(root)`) with the file of each dead lease removed: the one remover of local lease
    files (`store gc`, the URL cache's eviction, a lease's start). A reader refreshes its file by path
    (`os.utime`, or an atomic rename over it), so a removal by path right after the judgement lost a lease
    refreshed in between: each dead one is first renamed aside, out of every reader's reach, and judged again
    there - dead, it is removed; live (refreshed before the rename), it is linked back (unless its reader wrote
    it anew meanwhile) and returned live, so the caller keeps what it names. A refresh after the rename finds
    no file: its reader looks under the store lock (`Lease._lost_how`: written again while what it names is
    intact, else lost). Also removes what killed removers left aside."""
    out = [f if f.live else _remove_dead(f) for f in found]
    _remove_left_aside(Path(root) / LEASES_DIR)
    return out


def _remove_dead(found: Found) -> Found:
    aside = found.path.with_name(f"{found.path.name}{ASIDE}{process_tag()}-{secrets.token_hex(4)}")
    try:
        os.rename(found.path, aside)
    except FileNotFoundError:
        # released, or taken aside by another remover (a `store gc` while the URL cache evicts) that may yet link
        # it back live: what it names is kept this time. Not a damaged one: its reader never refreshes it in
        # place (it writes it anew, `Lease._intact`), so no remover links it back
        if found.damaged:
            return found
        return replace(found, live=True, why=f"{found.why}; taken aside by another process as this looked")
    try:
        again = _judged_file(aside, named=found.path)
        if again is not None and again.live:
            _link_back(aside, found.path)
            return again
        return found
    finally:
        aside.unlink(missing_ok=True)


def _link_back(aside: Path, path: Path) -> None:
    """A live lease taken aside put back at `path`: linked, never over a file its reader wrote anew since."""
    try:
        os.link(aside, path)
    except FileExistsError:  # its reader wrote it anew: that one stands
        pass
    except OSError:  # no hard links here (some FUSE or SMB mounts): renamed back, unless written anew by now
        if not path.exists():
            os.rename(aside, path)


def _remove_left_aside(folder: Path) -> None:
    """Remove the lease files that removers killed between their rename and their unlink left aside (dead; or live
    and not linked back yet: its reader finds it removed and writes it again at its next beat, `Lease._lost_how`).
    Their age is the rename's (`st_ctime`): another pid namespace's remover, judged by age, is not raced mid-look."""
    for p in folder.glob(f"*.json{ASIDE}*"):
        try:
            changed = p.stat().st_ctime
        except FileNotFoundError:
            continue
        tag = p.name.rsplit(ASIDE, 1)[1].rsplit("-", 1)[0]
        if tag_gone(tag, changed) is not None:
            p.unlink(missing_ok=True)
