"""`store.format.atomic_dir` replacing an existing folder (a resumed run's final LoRA, a merged model written
again) killed while it removes the old one: before, the old folder was renamed aside and removed *before* the
new one was renamed in, so a kill there (a preemption during the removal of a large merged model) left neither
folder. A real SIGKILL at that step (STORE_CRASH_AT), then the next swap of the same folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from schemas import atomic_write
from store import format as fmt

SWAP = """
import sys
from pathlib import Path
from store.format import atomic_dir
final = Path(sys.argv[1])
with atomic_dir(final) as tmp:
    (tmp / "weights.bin").write_bytes(b"new" * 1000)
"""


def _swap_killed(tmp_path: Path, point: str) -> Path:
    """`tmp_path/lora` holding old weights, then a swap to new ones SIGKILLed at `point` (fmt.CRASH_ENV)."""
    final = tmp_path / "lora"
    final.mkdir()
    (final / "weights.bin").write_bytes(b"old" * 1000)
    env = {**os.environ, fmt.CRASH_ENV: point, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", SWAP, str(final)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    return final


def test_a_kill_while_the_old_folder_is_removed_leaves_the_new_one(tmp_path) -> None:
    final = _swap_killed(tmp_path, "atomic_dir_removing_old")
    assert (final / "weights.bin").read_bytes() == b"new" * 1000
    assert [q.name for q in tmp_path.iterdir() if q.name.startswith(".lora.deleting-")]  # the old one, left
    with fmt.atomic_dir(final) as tmp:  # the next swap finishes the removal
        (tmp / "weights.bin").write_bytes(b"newer")
    assert sorted(q.name for q in tmp_path.iterdir()) == ["lora"]
    assert (final / "weights.bin").read_bytes() == b"newer"


def test_every_folder_inside_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """A subfolder's entries (a checkpoint's lora/ files) are durable only once that subfolder is fsynced: the
    walk fsynced each file and the top folder, never the subfolders, so a power loss after the rename could leave
    `final/lora/` without its files. Now each walked folder is fsynced too."""
    synced = []
    real = atomic_write.fsync_dir
    monkeypatch.setattr(atomic_write, "fsync_dir", lambda p: (synced.append(Path(p).name), real(p))[1])
    final = tmp_path / "ckpt"
    with fmt.atomic_dir(final) as tmp:
        (tmp / "lora" / "deep").mkdir(parents=True)
        (tmp / "lora" / "w.safetensors").write_bytes(b"w")
        (tmp / "lora" / "deep" / "x").write_bytes(b"x")
    assert {"lora", "deep", "w.safetensors", "x"} <= set(synced), synced


FILL = """
import os, signal, sys
from pathlib import Path
from store.format import atomic_dir
with atomic_dir(Path(sys.argv[1])) as tmp:
    (tmp / "weights.bin").write_bytes(b"half" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)  # killed while writing (a preempted `lora merge` of a 40 GB model)
"""


def test_the_temp_folder_of_a_killed_writer_is_removed_by_the_next_write(tmp_path) -> None:
    """A writer killed while filling its `.NAME.tmp-PID` folder left it beside NAME for good: the next write used
    its own pid's name and removed only that, so a killed `lora merge` of a 20B model kept ~40 GB hidden there.
    The next write of NAME removes it (its pid is no live process of this host); a live writer's is kept."""
    final = tmp_path / "merged"
    p = subprocess.run([sys.executable, "-c", FILL, str(final)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    (left,) = [q for q in tmp_path.iterdir() if q.name.startswith(".merged.tmp-")]
    live = tmp_path / f".merged.tmp-{os.getppid()}"  # a live process's (another writer, as far as this host knows)
    live.mkdir()
    with fmt.atomic_dir(final) as tmp:
        (tmp / "weights.bin").write_bytes(b"whole")
    assert not left.exists() and live.exists()
    assert (final / "weights.bin").read_bytes() == b"whole"


def test_a_kill_between_the_two_renames_gives_the_old_folder_back(tmp_path) -> None:
    """Killed after the old folder was renamed aside and before the new one came in: no folder named `final`.
    Before, the next swap removed the old one as a half-removed leftover; now it (or `settle_swap`, what a
    reader-writer of the folder runs first) renames it back: the last commit, whole."""
    final = _swap_killed(tmp_path, "atomic_dir_between_renames")
    assert not final.exists()
    fmt.settle_swap(final)
    assert (final / "weights.bin").read_bytes() == b"old" * 1000
    assert sorted(q.name for q in tmp_path.iterdir() if not q.name.startswith(".lora.tmp-")) == ["lora"]
    with fmt.atomic_dir(final) as tmp:
        (tmp / "weights.bin").write_bytes(b"newer")
    assert sorted(q.name for q in tmp_path.iterdir()) == ["lora"]
    assert (final / "weights.bin").read_bytes() == b"newer"
