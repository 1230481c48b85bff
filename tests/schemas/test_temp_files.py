"""Temp names carry their writer's host and pid namespace (`schemas.temp_files`): two hosts (a run folder or
store on NFS) or two containers sharing a folder number their processes apart, and judging another's temp by
`os.kill(pid, 0)` here took a live writer's temp for a dead one and removed it. Now only this host's and
namespace's temps are judged by their pid; another's is removed once untouched for `ABANDONED_S`; the names of
earlier releases (`.NAME.tmp-PID`) are judged as before."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from schemas import temp_files
from schemas.temp_files import ABANDONED_S, remove_dead_temps, temp_of, writer_alive
from store import format as fmt

GONE = 999999999  # past any pid_max: no process here has it


def _named(final: Path, pid: int, host: str | None = None, ns: str | None = "same") -> Path:
    here_host, here_ns = temp_files._here()
    ns = here_ns if ns == "same" else ns
    return final.with_name(f".{final.name}.tmp-{pid}-h{host or here_host}" + (f"-n{ns}" if ns else ""))


def _age(path: Path, seconds: float) -> None:
    """Set the mtime of `path` and everything in it `seconds` into the past."""
    then = time.time() - seconds
    for p in [*path.rglob("*"), path]:
        os.utime(p, (then, then), follow_symlinks=False)


def test_another_hosts_live_temp_is_kept_and_this_hosts_dead_one_removed(tmp_path):
    final = tmp_path / "ckpt"
    other_host = _named(final, GONE, host="0123456789ab")  # pid GONE here says nothing of that host's process
    other_ns = _named(final, GONE, ns="4026531836" if temp_files._here()[1] != "4026531836" else "1")
    dead_here = _named(final, GONE)
    old_dead, old_live = final.with_name(f".ckpt.tmp-{GONE}"), final.with_name(f".ckpt.tmp-{os.getpid()}")
    for folder in (other_host, other_ns, dead_here, old_dead, old_live):
        (folder / "lora").mkdir(parents=True)
        (folder / "lora" / "w.safetensors").write_bytes(b"w")
    abandoned = _named(final, GONE, host="ba9876543210")  # another host's, untouched for over a day
    (abandoned / "lora").mkdir(parents=True)
    (abandoned / "lora" / "w.safetensors").write_bytes(b"w")
    _age(abandoned, ABANDONED_S + 3600)
    slow = _named(final, GONE, host="c0ffee000000")  # another host's, its folder old, a file inside being written
    (slow / "lora").mkdir(parents=True)
    _age(slow, ABANDONED_S + 3600)
    (slow / "lora" / "w.safetensors").write_bytes(b"still streaming")

    with fmt.atomic_dir(final) as tmp:  # what a checkpoint write does first (`remove_dead_temps`)
        (tmp / "weights").write_bytes(b"new")
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"ckpt", other_host.name, other_ns.name, old_live.name, slow.name}, left
    assert (other_host / "lora" / "w.safetensors").read_bytes() == b"w"


def test_a_temp_of_this_host_is_judged_by_its_writers_pid(tmp_path):
    """A real writer: its temp name (`temp_of`, computed in that process) counts as alive while it runs, and is
    removed once it has exited."""
    final = tmp_path / "lora.safetensors"
    child = subprocess.Popen([sys.executable, "-c", "import sys\nfrom pathlib import Path\n"
                              "from schemas.temp_files import temp_of\nprint(temp_of(Path(sys.argv[1])), flush=True)\n"
                              "sys.stdin.read()", str(final)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        temp = Path(child.stdout.readline().strip())
        assert temp.parent == tmp_path and temp != temp_of(final)
        temp.write_bytes(b"half")
        assert writer_alive(temp)
        remove_dead_temps(final)
        assert temp.exists()
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert not writer_alive(temp)
    remove_dead_temps(final)
    assert list(tmp_path.iterdir()) == []


# Final names near the 255-byte limit on one name: ASCII, 2-byte and 3-byte UTF-8 characters
LONG_NAMES = ["a" * 240 + ".safetensors", "é" * 119 + ".safetensors", "日" * 80 + ".safetensors"]


def test_long_names_get_temp_names_within_the_limit_and_their_leftovers_are_found(tmp_path):
    """The writer's tag (`.tmp-PID-hHOST-nNS`) made a temp name ~40 bytes longer than its final name: a 250-byte
    `--out` failed with "File name too long" at its final write. Written on the real file system: a file, a folder,
    a folder swapped over an existing one; a killed writer's shortened temp is removed, a live one's kept, and both
    are litter to `store verify` / repair by the same rule."""
    for name in LONG_NAMES:
        assert 250 <= len(name.encode()) <= 255
        final = tmp_path / name
        fmt.atomic_write_bytes(final, b"one")
        fmt.atomic_write_bytes(final, b"two")
        assert final.read_bytes() == b"two"
        assert len(temp_of(final).name.encode()) <= temp_files.NAME_MAX
        folder = tmp_path / f"d{name}"[:-1]  # a folder of the same length
        for text in ("first", "second"):  # the second swaps the first aside (`.swapped-`) and removes it
            with fmt.atomic_dir(folder) as tmp:
                (tmp / "w").write_text(text)
        assert (folder / "w").read_text() == "second"
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp, no swapped folder
        # a killed writer's temp (this host's, its pid gone) and a live one's (ours), in the shortened form
        dead = temp_of(final).with_name(temp_of(final).name.replace(f".tmp-{os.getpid()}-", f".tmp-{GONE}-"))
        live = temp_of(final)
        for p in (dead, live):
            p.write_bytes(b"half")
        assert fmt.is_litter(dead.name) and fmt.is_litter(live.name)
        assert not writer_alive(dead) and writer_alive(live)
        remove_dead_temps(final)
        assert not dead.exists() and live.exists()
        live.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*LONG_NAMES, *(f"d{n}"[:-1] for n in LONG_NAMES)])


def test_leftovers_of_the_unshortened_forms_are_still_found(tmp_path):
    """A name whose temp is shortened now may have a leftover of the full form (`.NAME.tmp-PID`, an earlier
    release's, which fit): still removed when its writer is gone."""
    final = tmp_path / ("b" * 210)
    old = final.with_name(f".{final.name}.tmp-{GONE}")
    old.write_bytes(b"half")
    assert temp_of(final).name.split(".tmp-")[0] != f".{final.name}"  # this name's temps are shortened now
    fmt.atomic_write_bytes(final, b"whole")
    remove_dead_temps(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_a_name_over_the_limit_is_one_line(tmp_path):
    import pytest

    from schemas.errors import UserError

    too_long = tmp_path / ("é" * 128 + ".png")  # 260 bytes, 132 characters
    with pytest.raises(UserError, match=r"--out .*: its name is 260 bytes, over the 255 bytes"):
        temp_files.check_name_fits(too_long, "--out")
    temp_files.check_name_fits(tmp_path / ("é" * 125 + ".png"), "--out")  # 254 bytes: fits
