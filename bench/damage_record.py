"""Recording damage found while reading (`store.integrity.record_damage`, called by every reader on every rank):
the former per-finding read-merge-write of the whole `v<N>.damaged.json` under the store's damage lock (kept
below as the baseline) against today's, in the same run, on a marker already listing `--recorded` samples:

  repeat     `--repeats` findings already recorded, one call each (every rank of a validation meets the same
             damaged samples; a resumed or next-epoch read meets them again)
  lost       a lost shard of `--lost` samples: before, each sample met was one call (one locked, fsync'd rewrite
             of the growing marker each); today the reader records them all on open in one call and meeting
             each later is a repeat
  scattered  `--scattered` new samples found one at a time (bit rot met sample by sample): one write each,
             then as now; printed to show that what is new still costs its write

Prints each time and old / new, after checking both leave the same samples recorded.

    python bench/damage_record.py --recorded 10000 --repeats 300 --lost 500 --scattered 100
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store import format as fmt  # noqa: E402
from store import integrity  # noqa: E402


def old_record_damage(vdir: Path, samples: dict[str, str] | None = None, shards: dict[str, str] | None = None,
                      problems: list[str] | None = None) -> None:
    """`record_damage` before the repeat check (store/integrity.py at c4c67e3), verbatim but for the warning."""
    version = int(vdir.name.lstrip("v"))
    root = integrity.store_root(vdir)
    path = fmt.damaged_marker(root, vdir.parent.name, version)
    with fmt.flock(root / integrity.DAMAGE_LOCK):
        try:
            rec = json.loads(path.read_text())
            if not isinstance(rec, dict):
                rec = {}
        except FileNotFoundError:
            rec = {}
        except ValueError:
            rec = {}
        before = json.dumps(rec, sort_keys=True)
        rec["version"] = version
        for name, new in (("damaged", samples), ("shards", shards)):
            if new:
                rec[name] = {**(rec.get(name) if isinstance(rec.get(name), dict) else {}), **new}
        if problems:
            known = rec.get("problems") if isinstance(rec.get("problems"), list) else []
            rec["problems"] = sorted(set(map(str, known)) | set(problems))[:50]
        if json.dumps(rec, sort_keys=True) != before:
            fmt.atomic_write_json(path, rec)


def key(i: int) -> str:
    return f"{i * 2654435761 % 2**64:032x}"


PROBLEM = "crc32c mismatch (recorded 1f2e3d4c, read 9a8b7c6d)"
LOST = "shard part-000123.tar is missing (512 samples)"


def scenario(name: str, a: argparse.Namespace, record, vdir: Path) -> float:
    """Seconds for one scenario with `record` as the recorder, on a fresh marker of a.recorded samples."""
    path = fmt.damaged_marker(integrity.store_root(vdir), vdir.parent.name, 1)
    path.unlink(missing_ok=True)
    integrity._RECORDED.clear()
    fmt.atomic_write_json(path, {"version": 1, "damaged": {key(i): PROBLEM for i in range(a.recorded)}})
    first = a.recorded
    t0 = time.perf_counter()
    if name == "repeat":
        for i in range(a.repeats):
            record(vdir, {key(i * 7 % a.recorded): PROBLEM})
    elif name == "lost":
        lost = {key(first + i): LOST for i in range(a.lost)}
        if record is old_record_damage:
            for k, p in lost.items():
                record(vdir, {k: p})
        else:  # the reader's open (store/reader.py: SampleCheck.shard_damage), then each sample met
            record(vdir, lost, shards={"part-000123.tar": LOST})
            for k, p in lost.items():
                record(vdir, {k: p})
    else:
        for i in range(a.scattered):
            record(vdir, {key(first + i): PROBLEM})
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recorded", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--lost", type=int, default=500)
    ap.add_argument("--scattered", type=int, default=100)
    a = ap.parse_args()
    out: dict[str, float | int] = {"recorded": a.recorded}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parents[1]) as tmp:  # the repo's disk, not tmpfs
        vdir = Path(tmp) / "vae" / "v1"
        vdir.mkdir(parents=True)
        marker = fmt.damaged_marker(Path(tmp), "vae", 1)
        for name in ("repeat", "lost", "scattered"):
            t_old = scenario(name, a, old_record_damage, vdir)
            want = set(json.loads(marker.read_text())["damaged"])
            t_new = scenario(name, a, integrity.record_damage, vdir)
            assert set(json.loads(marker.read_text())["damaged"]) == want, f"{name}: the two record different samples"
            out.update({f"{name}_old_s": round(t_old, 3), f"{name}_new_s": round(t_new, 3),
                        f"{name}_old_over_new": round(t_old / t_new, 1)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
