"""`store gc` while a writer commits: the version its manifest just completed is not current yet (store.json
is switched next), and no lease names it. gc kept only *incomplete* versions of a table with a live writer, so
it removed that complete one, and the writer then failed ("not complete; cannot make it current"): the
whole table written was lost. The writer is a real process that stops itself (STORE_PAUSE_AT) right after
its manifest, holding its writer lock, while gc runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store import Store, gc
from store_samples import fill, key_of

HERE = Path(__file__).resolve().parent

WRITE = """
import sys
from store import Store
from store_samples import fill
print("version", fill(Store(sys.argv[1]), 5, tag="b"), flush=True)
"""


def test_gc_while_a_writer_commits_keeps_the_version_it_completes(store: Store) -> None:
    fill(store, 3)  # v1, current: the writer below makes v2
    env = {**os.environ, "STORE_PAUSE_AT": "commit_after_manifest",
           "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    writer = subprocess.Popen([sys.executable, "-c", WRITE, str(store.root)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240  # a bound for a hung writer, not a timing assertion

        def stopped() -> bool:  # state "T": the writer stopped itself right after its manifest
            return Path(f"/proc/{writer.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

        while writer.poll() is None and not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.poll() is None and stopped(), writer.stdout.read()
        assert (store.root / "vae" / "v2" / "manifest.parquet").is_file() and store.tables()["vae"] == 1
        kept = gc.collect(store.root, echo=lambda line: None)
        assert store.root / "vae" / "v2" not in kept.remove
    finally:
        writer.send_signal(signal.SIGCONT)
    out = writer.communicate(timeout=240)[0]
    assert writer.returncode == 0 and "version 2" in out, out
    assert store.tables()["vae"] == 2
    with store.reader("vae") as reader:
        assert sorted(reader.keys()) == sorted(key_of(i) for i in range(5))
        for k in reader.keys():
            assert reader.damaged(k) is None
    gc.collect(store.root, echo=lambda line: None)  # the writer is done: v1 goes now, v2 stays
    assert store.versions("vae") == [2]
