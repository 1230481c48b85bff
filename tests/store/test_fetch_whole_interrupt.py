"""A reader of a store URL's lazy cache waiting for another thread's or another process's whole-shard fetch
(store/remote_shards.py `ShardFetcher`): a Ctrl-C (or a launcher's signal) that Linux gives to another thread
ends the wait (tests/signal_elsewhere.py). Before: an untimed per-shard lock and a blocking flock, which wake for
a signal to their own thread only, held the main thread until the other fetch ended (a large shard on a slow link:
minutes). Here the other fetch is a held lock that lets go after HOLD_SECONDS, the shard then present."""

from __future__ import annotations

import pytest

from signal_elsewhere import run_script

HOLD_SECONDS = 30  # how long the other fetch holds out: far above what a passing run needs under load

_WAITING_READER = """
import dis, fcntl, json, os, signal, sys, tempfile, threading
from pathlib import Path
from signal_elsewhere import main_in_call, signal_elsewhere_once
from store import format as fmt
from store.checksum import seal
from store.integrity import CHECKSUMS_FORMAT
from store.remote_shards import FETCH_LOCK, MARKER, ShardFetcher

vdir = Path(tempfile.mkdtemp()) / "store" / "images" / "v1"
vdir.mkdir(parents=True)
(vdir / MARKER).write_text(json.dumps({"url": "http://127.0.0.1:9/nowhere", "table": "images", "version": 1}))
shard = "shard-00000.bin"
(vdir / fmt.CHECKSUMS).write_bytes(seal({"format": CHECKSUMS_FORMAT,
                                         "files": {shard: {"nbytes": 4, "crc32c": "00000000"}}}))
f = ShardFetcher(vdir)
done = threading.Event()

class OtherThreadsFetch:  # the shard's lock, held by another thread fetching it (a Python acquire, to be seen)
    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()
    def acquire(self, blocking=True, timeout=-1):
        return self.lock.acquire(blocking, timeout)
    def release(self):
        self.lock.release()
    def locked(self):
        return self.lock.locked()
    def __enter__(self):
        self.acquire()
    def __exit__(self, *exc):
        self.release()

def finish(let_go):  # the other fetch ends: its shard is there
    (vdir / shard).write_bytes(b"data")
    done.set()
    let_go()

if HELD == "flock":  # another process of the node fetches it: its flock (another open file conflicts as one)
    fd = os.open(vdir / f".{shard}{FETCH_LOCK}", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    threading.Timer(HOLD_SECONDS, finish, (lambda: os.close(fd),)).start()
    calls = ("flock(", "sleep(")
else:
    held = f._shard_locks[shard] = OtherThreadsFetch()
    threading.Timer(HOLD_SECONDS, finish, (held.release,)).start()
inside = "read" if HELD == "read" else "fetch_whole"

def in_held_acquire():  # main_in_call for the lock above (its source, in this `-c` script, has no lines to read)
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None or frame.f_code is not OtherThreadsFetch.acquire.__code__:
        return False
    at = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
    while frame is not None and frame.f_code.co_name != inside:
        frame = frame.f_back
    return at is not None and at.opname == "CALL" and frame is not None

try:
    ready = (lambda: main_in_call(inside, calls)) if HELD == "flock" else in_held_acquire
    signal_elsewhere_once(ready, signal.SIGINT)
    f.read(shard, 0, 4) if HELD == "read" else f.fetch_whole(shard)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", "after the other fetch" if done.is_set() else "while the other fetch ran")
    os._exit(130)
"""


@pytest.mark.parametrize("held", ["thread", "flock", "read"])
def test_ctrl_c_elsewhere_ends_a_wait_for_another_whole_fetch(held: str) -> None:
    """`thread`: a scan's fetch_whole waits for this process's other thread (the check-ahead thread) fetching
    the shard; `flock`: for another rank of the node; `read`: a random read waits for this process's whole fetch."""
    proc = run_script(f"HOLD_SECONDS, HELD = {HOLD_SECONDS}, {held!r}\n" + _WAITING_READER,
                      timeout=HOLD_SECONDS + 120)
    assert (proc.returncode, proc.stdout.strip()) == (130, "interrupted while the other fetch ran"), \
        proc.stderr[-2000:]
