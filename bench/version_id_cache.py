"""Reading version notes again and again (store/version_notes.py `read_note`, each tied to `Store.version_id`):
before, every read hashed that version's manifest (~140 MB at 1M rows); now the id is kept per process by the
manifest file's identity (store/store.py `_VERSION_IDS`), so each manifest is hashed once per process.

`--versions` complete `images` versions with a `--mb` MB manifest each (random bytes: only the hashing is
measured), a note beside each; then `--rounds` rounds of reading every version's note (a resize rerun reads each
version's pixel-limit note, then the newest one's source-tars note; `run all` and evaluate read ids again), timed
before (the old `Store.version_id`: hash on every call) and now, in the same run, files in the page cache. The
first round costs the same in both (a new process hashes each manifest once): the gain is the rounds after it.
2-core dev machine, 20 x 140 MB, 2 rounds: before 8.28 s, now 4.37 s (1.9x), the first round alone 4.56 s.

    python bench/version_id_cache.py --versions 20 --mb 140 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from schemas.errors import UserError  # noqa: E402
from store import Store  # noqa: E402
from store import format as fmt  # noqa: E402
from store import store as store_module  # noqa: E402
from store.version_notes import read_note, write_note  # noqa: E402


def old_version_id(self: Store, table: str, version: int) -> str:
    """`Store.version_id` before the cache: the manifest hashed on every call."""
    manifest = self.version_dir(table, version) / fmt.MANIFEST
    if not manifest.is_file():
        raise UserError(f"table '{table}' v{version} is not complete (no {manifest})")
    return fmt.version_id(version, manifest)


def reads(st: Store, versions: list[int], rounds: int) -> float:
    """Seconds to read every version's note `rounds` times (a fresh process: nothing kept yet)."""
    store_module._VERSION_IDS.clear()
    t = time.perf_counter()
    for _ in range(rounds):
        for v in versions:
            assert read_note(st, "images", v, "pixel-limit") == v
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--versions", type=int, default=20, help="complete images versions (default 20)")
    ap.add_argument("--mb", type=float, default=140, help="manifest size per version, MB (default 140: ~1M rows)")
    ap.add_argument("--rounds", type=int, default=2, help="times every note is read (default 2)")
    ap.add_argument("--dir", type=Path, default=None, help="where to build the store (default: a temp folder)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="version-id-bench-", dir=args.dir))
    try:
        st = Store(tmp / "store")
        versions = list(range(1, args.versions + 1))
        chunk = os.urandom(1 << 20)
        for v in versions:
            vdir = st.version_dir("images", v)
            vdir.mkdir(parents=True)
            with open(vdir / fmt.MANIFEST, "wb") as f:  # each its own bytes: a 16-byte version tag per MB
                for i in range(int(args.mb)):
                    f.write(v.to_bytes(8, "little") + i.to_bytes(8, "little") + chunk[16:])
            write_note(st, "images", v, "pixel-limit", v)
        print(f"{args.versions} versions x {args.mb:.0f} MB manifest, every note read {args.rounds} times")
        new_version_id = Store.version_id
        Store.version_id = old_version_id  # type: ignore[method-assign]
        try:
            reads(st, versions, 1)  # page cache warm for both
            before = reads(st, versions, args.rounds)
        finally:
            Store.version_id = new_version_id  # type: ignore[method-assign]
        now = reads(st, versions, args.rounds)
        first = reads(st, versions, 1)
        print(f"  before (hash on every read): {before:7.2f} s")
        print(f"  now    (hash once a process): {now:7.2f} s   ({before / now:.1f}x faster)")
        print(f"  of which the first round, the same in both: {first:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
