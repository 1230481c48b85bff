"""bench/gpu/slim_wheel.py: bitsandbytes' wheel without the native libraries the GPU machine's torch never loads."""

import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))

import slim_wheel  # noqa: E402

LIBS = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm72", "xpu2026"]


def _wheel(path: Path) -> Path:
    names = ["bitsandbytes/__init__.py"] + [f"bitsandbytes/libbitsandbytes_{k}.so" for k in LIBS]
    record = "".join(f"{n},sha256=x,1\n" for n in names) + "bitsandbytes-0.50.2.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.writestr(n, b"\0" * 1000)
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", record)
    return path


def test_only_the_cpu_and_the_machines_cuda_major_libraries_stay(tmp_path):
    whl = _wheel(tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl")
    slim_wheel.slim(str(whl), "13")
    with zipfile.ZipFile(whl) as z:
        libs = sorted(n.split("_", 1)[1] for n in z.namelist() if n.endswith(".so"))
        record = [line.split(",")[0] for line in z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode().splitlines()]
        assert z.read("bitsandbytes/__init__.py") == b"\0" * 1000
    assert libs == ["cpu.so", "cuda130.so", "cuda132.so"]
    assert sorted(n for n in record if n.endswith(".so")) == [f"bitsandbytes/libbitsandbytes_{k}" for k in libs]


def test_a_cuda_major_the_wheel_lacks_is_refused_and_the_wheel_kept(tmp_path):
    whl = _wheel(tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl")
    before = whl.read_bytes()
    with pytest.raises(SystemExit, match="no CUDA 14.x library"):
        slim_wheel.slim(str(whl), "14")
    assert whl.read_bytes() == before
