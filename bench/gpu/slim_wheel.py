"""Rewrite a downloaded bitsandbytes wheel without the native libraries the GPU machine cannot load.

bitsandbytes 0.50.2's wheel (43.1 MB) packs one CUDA library per toolkit (11.8 ... 13.2), ROCm and XPU builds;
it loads only the one matching `torch.version.cuda`'s major (bitsandbytes/cextension.py: exact version, else the
same major, never another major) and the CPU one. The machine's torch is 2.11.0+cu130 (docs/gpu.md,
bench/gpu/results/h200.json "torch"), so every library but `cpu` and `cuda13*` is dead weight in a call that
carries at most 64 MiB. The wheel keeps its name, and its RECORD loses the removed files' lines (pip installs
what the archive holds; a RECORD line without its file would be left in the installed RECORD).

    python3 bench/gpu/slim_wheel.py .whl/bitsandbytes-*.whl --keep-cuda-major 13
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import zipfile

NATIVE = re.compile(r"(^|/)libbitsandbytes_(?P<kind>[a-z]+)(?P<version>\d*)\.(so|dll|dylib)$")


def kept(name: str, cuda_major: str) -> bool:
    """Whether an archive member stays: everything but native libraries other than cpu and CUDA `cuda_major`."""
    m = NATIVE.search(name)
    if m is None:
        return True
    return m["kind"] == "cpu" or (m["kind"] == "cuda" and m["version"].startswith(cuda_major)
                                  and len(m["version"]) == len(cuda_major) + 1)


def slim(path: str, cuda_major: str) -> tuple[int, int, list[str]]:
    """Rewrite `path` in place without the dropped libraries; (bytes before, bytes after, names dropped)."""
    before = os.path.getsize(path)
    tmp = path + ".slim"
    with zipfile.ZipFile(path) as src:
        dropped = [i.filename for i in src.infolist() if not kept(i.filename, cuda_major)]
        if not any("libbitsandbytes_cuda" in n and kept(n, cuda_major) for n in src.namelist()):
            raise SystemExit(f"slim_wheel: {path} has no CUDA {cuda_major}.x library; pass the machine's torch "
                             f"CUDA major (python3 -c 'import torch; print(torch.version.cuda)' there)")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for info in src.infolist():
                if info.filename in dropped:
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(line for line in data.splitlines(keepends=True)
                                    if line.split(b",", 1)[0].decode() not in dropped)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return before, os.path.getsize(path), dropped


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", nargs="+")
    ap.add_argument("--keep-cuda-major", default="13", help="torch.version.cuda's major on the machine (13: cu130)")
    args = ap.parse_args(argv)
    for path in args.wheels:
        before, after, dropped = slim(path, args.keep_cuda_major)
        print(f"slim_wheel: {os.path.basename(path)} {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
              f"({len(dropped)} native libraries left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
