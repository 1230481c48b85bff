"""Shared fixtures: tiny offline models (built once per session through the real save/from_pretrained path)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch (OpenMP) thread per test process, and per process a test starts (they inherit it): the suite runs two
# test processes on two cores, each starting ranks of its own, and OpenMP's spinning threads oversubscribed the
# cores; the tiny models gain nothing from a second thread. Two test files side by side (test_train.py beside
# test_evaluate_base_images.py): 102 s with torch's default of 2 threads, 36 s with 1 (2026-12-02).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from s3_server import s3_env, s3_server  # noqa: E402,F401  (the S3 test server's fixtures)


@pytest.fixture(scope="session", autouse=True)
def _session_temp_and_cache_folders(tmp_path_factory):
    """The tests and the subprocesses they start keep their temp files and caches in the session's folder (removed
    with it after a green run): torchrun's agent makes a /tmp/torchelastic_* folder per launch and never removes
    it, and the caches the user's home would hold (the file-hash database, the remote stores' cache: keyed by URL,
    and every session's buckets have the same names) would be shared with another run meanwhile and the next."""
    folders = {"TMPDIR": "subprocess-tmp", "XDG_CACHE_HOME": "cache"}
    old = {name: os.environ.get(name) for name in folders}
    for name, folder in folders.items():
        os.environ[name] = str(tmp_path_factory.mktemp(folder))
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_edit_model(tmp_path_factory) -> str:
    from models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-edit"
    make_tiny_model(out, variant="edit", seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_plus_model(tmp_path_factory) -> str:
    from models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-edit-plus"
    make_tiny_model(out, variant="edit-plus", seed=0)
    return str(out)


@pytest.fixture(autouse=True)
def _no_reader_threads_left():
    """Every stage stops the background threads it starts (check-ahead, prefetch), on success and on error: a
    thread left behind keeps a reader (its maps, its descriptors) alive and competes for the CPU."""
    import threading
    import time

    yield
    names = ("check-ahead-", "train-prefetch")
    deadline = time.monotonic() + 60  # a bound for a loaded 2-core machine: a green run waits for nothing here
    while (left := [t for t in threading.enumerate() if t.name.startswith(names)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"background threads left running: {[t.name for t in left]}"


@pytest.fixture(autouse=True)
def _remote_read_leases_released():
    """A command reading a store URL holds its lease object until the process exits (store/remote_lease.py); the
    tests run many commands in one process: each test's leases go with it (and their heartbeat threads)."""
    yield
    from store.remote_lease import release_all

    release_all()


@pytest.fixture(scope="session")
def tiny_21_model(tmp_path_factory) -> str:
    from models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny-qwen-image-2.1"
    make_tiny_model(out, variant="qwen-image-2.1", seed=0)
    return str(out)


# No file order of our own: xdist's loadfile hands files out by their number of tests (`--loadscope-reorder`, its
# default). Longest files first, forced over that, measured slower on the 2-core machine (2026-12-03, one idle run
# each: 944 s against 876 s): the multi-rank files then run side by side and oversubscribe the two cores.
