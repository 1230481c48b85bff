"""A JSONL source's file listing (stages/resize/jsonl_source.py `jsonl_files`): the manifest and every file its lines
name, made on every resize-bucket run (up to date or not) for the source's listing hash.

Writes a JSONL of --lines lines (a target and a control each, every --shared-th line naming an earlier line's target
as its control, as edit datasets reuse their pictures; tiny files, in folders of 1,000) into --dir (reused), then
lists it in the same run, inside `folder_listing.remembered()` as a run does (best of --repeat), after checking
both give the same paths:
  old   the former `jsonl_files` and its helpers (`_inside`, `_realpath`, `_resolve`), kept below verbatim: five
        `Path` objects parsed a file, every file stat'ed and resolved again each time a line names it
  new   `jsonl_files` now
Per file the rest is one stat and one lstat (`real_path`), which both make.
2-core shared dev machine (load 4-7), 20,000 lines, best of 3 each: with every 4th control shared (35,001 files)
old 51-83 us a file, new 42-43 us: 1.21x, 1.61x, 1.82x over three runs (the old code against itself: 1.05x);
--shared 0 (40,001 files) old 81 us, new 51 us: 1.58x. A 1M-line JSONL (~1.5M files): ~2 min -> ~1 min of every
resize-bucket run, the up-to-date rerun of `run all` included.

    python bench/jsonl_listing.py [--lines 20000] [--shared 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stages/, not an installed one

from models.file_hashes import real_path  # noqa: E402
from stages.resize import folder_listing  # noqa: E402
from stages.resize.folder_listing import named_on_disk, remembered  # noqa: E402
from stages.resize.jsonl_source import _jsonl_objects, _jsonl_paths, jsonl_files, jsonl_path  # noqa: E402


def _old_realpath(path: Path) -> str:
    return real_path(str(Path(path)), folder_listing._real_folders)


def _old_inside(path: Path, root: Path) -> bool:
    real, base = _old_realpath(path), folder_listing._real_folder(Path(root))
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _old_resolve(base: Path, rel: str) -> Path:
    p = Path(rel)
    return named_on_disk(p if p.is_absolute() else base / p)


def old_jsonl_files(source: Path) -> list[Path]:
    """The former `jsonl_files`, verbatim but for its helpers' names."""
    manifest = jsonl_path(source)
    files = {manifest}
    for _, obj, _ in _jsonl_objects(manifest):
        if isinstance(obj, dict):
            for rel in _jsonl_paths(obj):
                f = _old_resolve(manifest.parent, rel)
                if f.is_file() and (Path(rel).is_absolute() or _old_inside(f, manifest.parent)):
                    files.add(f)
    return sorted(files, key=lambda f: f.parts)


def make_source(root: Path, lines: int, shared: int) -> None:
    if (root / "data.jsonl").is_file():
        return
    rows = []
    for i in range(lines):
        folder = root / "images" / f"{i // 1000:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        target = f"images/{i // 1000:04d}/t{i:07d}.png"
        (root / target).write_bytes(b"t%d" % i)
        if shared and i % shared == shared - 1:
            control = f"images/{(i - 1) // 1000:04d}/t{i - 1:07d}.png"  # an earlier line's target
        else:
            control = f"images/{i // 1000:04d}/c{i:07d}.png"
            (root / control).write_bytes(b"c%d" % i)
        rows.append(json.dumps({"target": target, "controls": [control], "caption": f"edit {i}"}))
    (root / "data.jsonl").write_text("\n".join(rows) + "\n")


def best(fn, source: Path, repeat: int) -> tuple[float, list[Path]]:
    out, secs = [], float("inf")
    for _ in range(repeat):
        with remembered():
            t = time.perf_counter()
            out = fn(source)
            secs = min(secs, time.perf_counter() - t)
    return secs, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=20_000)
    ap.add_argument("--shared", type=int, default=4, help="every Nth line's control is an earlier target (0: none)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-jsonl-listing")
    args = ap.parse_args()
    source = args.dir / f"n{args.lines}-s{args.shared}"
    make_source(source, args.lines, args.shared)
    old_s, old = best(old_jsonl_files, source, args.repeat)
    new_s, new = best(jsonl_files, source, args.repeat)
    assert [str(p) for p in old] == [str(p) for p in new]
    n = len(new)
    print(f"{args.lines} lines, {n} files: old {old_s:.3f} s ({old_s / n * 1e6:.0f} us a file), "
          f"new {new_s:.3f} s ({new_s / n * 1e6:.0f} us a file): {old_s / new_s:.2f}x")


if __name__ == "__main__":
    main()
