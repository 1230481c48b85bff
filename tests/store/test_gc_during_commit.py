"""`store gc` while a writer commits: the version its manifest just completed is not current yet (store.json
is switched next), and no lease names it. gc kept only *incomplete* versions of a table with a live writer, so
it removed that complete one, and the writer then failed ("not complete; cannot make it current"): the
whole table written was lost. The writer is a real process that stops itself (STORE_PAUSE_AT) right after
its manifest, holding its writer lock, while gc runs."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from store import Store, gc
from store_samples import fill, key_of
import warm_start

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
    # started warm (tests/warm_start.py: fill's samples import torch, ~9 s of CPU cold)
    writer = warm_start.WarmProcess([sys.executable, "-c", WRITE, str(store.root)], env=env)
    try:
        deadline = time.monotonic() + 240  # a bound for a hung writer, not a timing assertion

        def stopped() -> bool:  # state "T": the writer stopped itself right after its manifest
            return Path(f"/proc/{writer.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"

        while writer.poll() is None and not stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert writer.poll() is None and stopped(), writer.output()
        assert (store.root / "vae" / "v2" / "manifest.parquet").is_file() and store.tables()["vae"] == 1
        kept = gc.collect(store.root, echo=lambda line: None)
        assert store.root / "vae" / "v2" not in kept.remove
    finally:
        writer.send_signal(signal.SIGCONT)
    out, err = writer.communicate(timeout=240)
    assert writer.returncode == 0 and "version 2" in out, out + err
    assert store.tables()["vae"] == 2
    with store.reader("vae") as reader:
        assert sorted(reader.keys()) == sorted(key_of(i) for i in range(5))
        for k in reader.keys():
            assert reader.damaged(k) is None
    gc.collect(store.root, echo=lambda line: None)  # the writer is done: v1 goes now, v2 stays
    assert store.versions("vae") == [2]


def _killed_before_the_switch(store: Store, monkeypatch, n: int, tag: str) -> None:
    """A commit killed between its manifest and store.json's switch (no writer holds the lock any more)."""
    import pytest

    def died(*a, **k):
        raise KeyboardInterrupt("killed before the switch")

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(Store, "set_current", died)
        fill(store, n, tag=tag)


def test_gc_keeps_a_complete_version_whose_commit_died_before_switching_store_json(store: Store, monkeypatch) -> None:
    """A commit killed between its manifest and the store.json switch leaves a complete version past the current
    one, which its rerun makes current (`find_version`). gc removed it at once: a gc cron in between threw the
    whole table away. Kept (never current), said so; removed once a newer one is current."""
    fill(store, 3)  # v1, current
    _killed_before_the_switch(store, monkeypatch, 5, "b")  # v2: manifest written, store.json not switched
    assert (store.root / "vae" / "v2" / "manifest.parquet").is_file() and store.tables()["vae"] == 1
    lines: list[str] = []
    p = gc.collect(store.root, echo=lines.append)
    assert store.versions("vae") == [1, 2] and not p.remove
    assert any(line.startswith("keep vae/v2: complete, never current (past the current v1)") for line in lines), lines
    fill(store, 4, tag="c")  # v3 current: v2 is now one a newer version replaced
    gc.collect(store.root, echo=lambda line: None)
    assert store.versions("vae") == [3]


def test_gc_removes_a_version_switched_away_from_and_keeps_a_later_one_of_its_number(store: Store,
                                                                                   monkeypatch) -> None:
    """Switching back to an older version (a rerun of older settings adopting it) leaves the newer one past the
    current one, complete: garbage, unlike a commit's unswitched version. store.json records it (`was_current`), so
    gc removes it (keeping every complete version past the current one kept it for ever, TBs at scale). gc takes
    its number out of the record first: a later v2 whose switch failed is kept, not taken for the old one."""
    from store import format as fmt

    fill(store, 3)  # v1
    fill(store, 4, tag="b")  # v2, current
    store.set_current("vae", 1)  # switched back
    assert fmt.read_store_record(store.root)["tables"]["vae"] == {"current": 1, "was_current": [2]}
    gc.collect(store.root, echo=lambda line: None)
    assert store.versions("vae") == [1]
    assert fmt.read_store_record(store.root)["tables"]["vae"] == {"current": 1}
    _killed_before_the_switch(store, monkeypatch, 5, "c")  # a new v2, never current
    assert store.versions("vae") == [1, 2]
    gc.collect(store.root, echo=lambda line: None)
    assert store.versions("vae") == [1, 2]
    store.set_current("vae", 2)  # its rerun adopts it
    gc.collect(store.root, echo=lambda line: None)
    assert store.versions("vae") == [2] and fmt.read_store_record(store.root)["tables"]["vae"] == {"current": 2}
