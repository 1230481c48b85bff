"""The source-hash cache at dataset scale: sqlite (models/file_hashes.py) vs the one-JSON-file cache it replaced
(the baseline, re-implemented here as it was), in the same run.

    python bench/file_hashes.py [--cached 1000000] [--files 20000] [--touched 200]

Both caches are pre-filled with --cached entries (what a million-file dataset leaves behind), then a rerun over
--files real small files of which --touched were touched since the last run (re-read, same bytes) is timed:
every file stat'ed and looked up, the touched ones hashed, the cache saved. Prints time and bytes written per
rerun for each, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.file_hashes import FileHashes  # noqa: E402
from schemas.file_digest import file_sha256  # noqa: E402


class JsonFileHashes:
    """The previous cache: one dict of "path|size|mtime" -> sha256 in one JSON file, rewritten whole on change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> "JsonFileHashes":
        try:
            self.cache = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.cache = {}
        self._known = len(self.cache)
        return self

    def __exit__(self, *exc: object) -> None:
        if len(self.cache) != self._known:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.cache))
            os.replace(tmp, self.path)

    def sha256(self, f: Path) -> str:
        real = os.path.realpath(f)
        st = os.stat(real)
        slot = f"{real}|{st.st_size}|{st.st_mtime_ns}"
        if slot not in self.cache:
            self.cache[slot] = file_sha256(real)
        return self.cache[slot]


def written_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):  # bytes passed to write calls
            return int(line.split()[1])
    return 0


def rerun(make, files: list[Path]) -> tuple[float, int]:
    w0, t0 = written_bytes(), time.perf_counter()
    with make() as h:
        for f in files:
            h.sha256(f)
    return time.perf_counter() - t0, written_bytes() - w0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", type=int, default=1_000_000, help="entries already in the cache")
    ap.add_argument("--files", type=int, default=20_000, help="real files hashed per rerun")
    ap.add_argument("--touched", type=int, default=200, help="files touched (same bytes) before each rerun")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        src = root / "src"
        src.mkdir()
        files = []
        for i in range(args.files):
            p = src / f"{i:07d}.png"
            p.write_bytes(i.to_bytes(8, "little") * 512)  # 4 KB each
            files.append(p)
        fake = [(f"/data/set/{i:07d}.png", 400_000 + i, 1_700_000_000_000_000_000 + i, f"{i:064x}")
                for i in range(args.cached)]
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
        t0 = time.perf_counter()
        with FileHashes("bench.sqlite") as h:  # creates the database
            pass
        with sqlite3.connect(h.path) as db:
            db.executemany("INSERT INTO sha256 (path, size, mtime_ns, sha256) VALUES (?, ?, ?, ?)", fake)
        json_path = root / "cache.json"
        json_path.write_text(json.dumps({f"{p}|{s}|{m}": d for p, s, m, d in fake}))
        print(f"pre-filled {args.cached:,} entries in {time.perf_counter() - t0:.1f} s; sqlite "
              f"{h.path.stat().st_size / 2**20:.0f} MB, JSON {json_path.stat().st_size / 2**20:.0f} MB", file=sys.stderr)
        makers = {"sqlite": lambda: FileHashes("bench.sqlite"), "json": lambda: JsonFileHashes(json_path)}
        for make in makers.values():  # the first run hashes every file: not what is compared
            rerun(make, files)
        best: dict[str, tuple[float, int]] = {}
        for rep in range(args.repeats):
            for f in files[rep * args.touched : (rep + 1) * args.touched]:
                os.utime(f, ns=(10**18 + rep, 10**18 + rep))
            for name in sorted(makers, reverse=rep % 2 == 1):  # interleaved, order alternating
                got = rerun(makers[name], files)
                best[name] = min(best.get(name, got), got)
    (ts, ws), (tj, wj) = best["sqlite"], best["json"]
    print(f"rerun over {args.files:,} files ({args.touched} touched) with {args.cached:,} cached entries, best of "
          f"{args.repeats}: sqlite {ts:.2f} s, {ws / 2**20:.3f} MB written; JSON file (before) {tj:.2f} s, "
          f"{wj / 2**20:.1f} MB written; time sqlite/JSON {ts / tj:.2f}x; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
