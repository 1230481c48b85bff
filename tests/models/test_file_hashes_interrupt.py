"""A rank waiting for another rank of its node to hash the model's files (models/file_hashes.py `alone`: minutes
for a 41 GB folder): a Ctrl-C (or a launcher's signal) that Linux gives to another thread ends the wait
(tests/signal_elsewhere.py), as it ends a wait for a store's flock (store/format.py). Before: a blocking flock,
which wakes for a signal to its own thread only, held the main thread until the other rank's hashing ended.
Here the other rank is another open file holding the lock, let go after HOLD_SECONDS."""

from __future__ import annotations

from signal_elsewhere import run_script

HOLD_SECONDS = 30  # how long the other rank hashes: far above what a passing run needs under load

_WAITING_RANK = """
import fcntl, os, signal, tempfile, threading
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()
from signal_elsewhere import main_in_call, signal_elsewhere_once
from models.file_hashes import FileHashes

done = threading.Event()
holding = threading.Event()

def other_rank():  # the node's other rank, hashing: its own open file of the same lock
    with FileHashes() as other, other.alone("model"):
        holding.set()
        done.wait(HOLD_SECONDS)
        done.set()

threading.Thread(target=other_rank, daemon=True).start()
holding.wait()
try:
    signal_elsewhere_once(lambda: main_in_call("alone", ("flock(", "sleep(")), signal.SIGINT)
    with FileHashes() as hashes, hashes.alone("model"):
        pass
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", "after the other rank" if done.is_set() else "while the other rank hashed")
    os._exit(130)
"""


def test_ctrl_c_elsewhere_ends_a_wait_for_the_node_s_hashing() -> None:
    proc = run_script(f"HOLD_SECONDS = {HOLD_SECONDS}\n" + _WAITING_RANK, timeout=HOLD_SECONDS + 120)
    assert (proc.returncode, proc.stdout.strip()) == (130, "interrupted while the other rank hashed"), \
        proc.stderr[-2000:]
