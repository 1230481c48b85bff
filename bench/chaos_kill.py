"""Kill each stage at a random moment, rerun the same command, compare with an uninterrupted run.

"A killed job resumes with nothing lost, nothing silently reused, the result equal to an uninterrupted run", checked
from outside on the tiny demo data: every stage (resize-bucket, encode-text, encode-vae, train, evaluate) runs once
uninterrupted from the state its previous stages left (the reference, timed), then per trial from a copy of that
same state: the stage's process group gets SIGKILL, SIGINT or SIGTERM at a random moment, alternately in its
work (once its main progress bar shows a random share done: on a shared 2-core machine imports and model loads
take most of a tiny stage's time, and their length varies 3x with the load) and in (0, reference duration) from
its start; then the same
command is run again to its end (train: with --resume where the stop's line advises it, and after a SIGKILL). The
outcome is compared with the reference:

- resize-bucket / encode-text / encode-vae: `pipeline store verify` passes and the table's rows equal the
  reference's, key by key (meta and stored bytes, through the store's reader); the rerun's summary counts
  (encoded / skipped (already done)) against the rows the killed run had committed (needless recompute).
- train: the final LoRA's bytes equal the reference's (docs/train.md: N + resume + N is bit-identical to 2N
  straight); the rerun resumes at the last checkpoint on disk (needless recompute otherwise).
- evaluate (`--all-checkpoints --run RUN`): metrics.json's numbers equal the reference's.

Also per trial: the killed run's exit (code, its last line, a traceback or not) and the rerun's (code, last line,
a traceback or not). Settings are the demo's, shortened (train.max_steps 20, checkpoint every 5; evaluate 1
sample, 2 steps) and with small shards (several commits per encode, so a kill has committed rows to keep).

Measured 2026-12-05 on the shared 2-core CPU machine, tiny demo data (24 samples), 4 passes (seeds 0-3), 72 trials
(resize-bucket 12, encode-text 12, encode-vae 12, train 18, evaluate 18; SIGKILL / SIGINT / SIGTERM each, in the
work and from the start; 8 runs finished before their signal). Every rerun that ran to its end was equal to the
reference: store verify passed, every row (meta and bytes, by key) and the
quarantine equal; the final LoRA's sha256 equal (resumed at steps 2, 5, 7 included: SIGTERM checkpoints the step
under way); metrics.json's numbers equal. No rerun redid committed work: encodes skipped exactly the rows of the
shards committed before the kill (e.g. 16 kept -> encoded 8, skipped 16), trains resumed at the last checkpoint on
disk, evaluate kept the checkpoints already appended (2 of 4). No traceback, no hang. Found and fixed: `run train`
stopped by Ctrl-C / SIGTERM before its run folder held a start advised `--resume`, which refused ("nothing to
resume"); a stop inside a `for x in tqdm(...)` loop (evaluate's `generate (base)`) printed its line glued to the
bar; a Ctrl-C during the model stack's import, lost in a finalizer (`Exception ignored in: regex ... __del__ ...
KeyboardInterrupt`), let `run train` train all 20 steps and exit 0 (the loop now takes the CLI's record of it). By
design, left: a SIGKILLed `run train` rerun with --resume before its folder held a start is refused in one
line naming the fix (the bench then reruns without it); SIGTERM in the first ~0.3 s (before the handler) ends
the process silently (-15).

    PYTHONPATH=. python bench/chaos_kill.py --work /tmp/chaos [--demo DONE_DEMO_WORKDIR] [--trials 2] \
        [--stages resize-bucket,encode-text] [--signals KILL,INT,TERM] [--seed 0] [--out chaos.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("resize-bucket", "encode-text", "encode-vae", "train", "evaluate")
MAIN_BAR = {"resize-bucket": "resize-bucket (", "encode-text": "encode-text:", "encode-vae": "encode-vae:",
            "train": "train:", "evaluate": "checkpoints:"}  # the progress bar a kill "in the work" follows
TABLE_OF = {"resize-bucket": "images", "encode-text": "text", "encode-vae": "vae"}
SHORTER = {  # the demo's settings, shortened so that a trial costs seconds; small shards: several commits
    "resize": {"shard_size_mb": 0.02},
    "encode_text": {"shard_size_mb": 0.01, "batch_size": 4},
    "encode_vae": {"shard_size_mb": 0.01, "batch_size": 4},
    "train": {"max_steps": 20, "checkpoint_every": 5, "keep_checkpoints": 4},
    "evaluate": {"num_samples": 1, "num_inference_steps": 2, "noise_seeds": [0], "timesteps": [0.3, 0.7]},
}


def env() -> dict[str, str]:
    # PIPELINE_PROGRESS_SECONDS=0: a bar's line at each redraw, its start included (a pipe's default is one per 30 s)
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", "PIPELINE_PROGRESS_SECONDS": "0"}


def command(stage: str, resume: bool = False) -> list[str]:
    """The stage's command, run in the workdir (relative paths: a copied workdir is the same run); train's rerun
    adds --resume where the stopped run's line advised it (or, SIGKILLed, said nothing: docs/train.md's way)."""
    base = [sys.executable, "-m", "pipeline.cli", "run", stage, "--config", "config.yaml"]
    return base + {"evaluate": ["--all-checkpoints", "--run", "run"]}.get(stage, []) + ["--resume"] * resume


def write_config(work: Path, demo: Path) -> None:
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {"source": str(demo / "data"), "model": str(demo / "tiny-model"), "store": "store", "run": "run",
                    "report": "report"}
    for section, values in SHORTER.items():
        cfg.setdefault(section, {}).update(values)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg))


class Watched:
    """A stage's process, its output read as it comes: when its first progress bar appeared (the work began,
    past imports and model loads, which a kill at a uniform moment would mostly hit on a loaded machine)."""

    def __init__(self, cwd: Path, stage: str, resume: bool = False) -> None:
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(command(stage, resume), cwd=cwd, env=env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.chunks = {"out": [], "err": []}
        self.work_began: float | None = None
        # a bar's log line (pipeline/bars.py), `train:  50% 30/60 [...]`, at a line's start: not "check and hash
        # checkpoints:"
        self.bar = re.compile(rb"(?:^|\n)" + re.escape(MAIN_BAR[stage]).encode() + rb"[^\n]*?\d% ([\d.]+)/([\d.]+)")
        self.done = 0.0  # the share of the stage's main progress bar done, as last drawn
        self.readers = [threading.Thread(target=self._read, args=(pipe, name), daemon=True)
                        for pipe, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self.readers:
            t.start()

    def _read(self, pipe, name: str) -> None:
        for chunk in iter(lambda: os.read(pipe.fileno(), 65536), b""):
            self.chunks[name].append(chunk)
            if self.work_began is None and re.search(rb"\d% [\d.]+/", chunk):
                self.work_began = time.perf_counter() - self.start
            if name == "err" and (drawn := self.bar.findall(chunk)):
                self.done = float(drawn[-1][0]) / max(float(drawn[-1][1]), 1e-9)

    def wait(self, timeout: float | None = None) -> dict:
        self.proc.wait(timeout)
        for t in self.readers:
            t.join()
        out, err = (b"".join(self.chunks[n]).decode(errors="replace") for n in ("out", "err"))
        return {"rc": self.proc.returncode, "s": round(time.perf_counter() - self.start, 2),
                "work_began_s": self.work_began, **said(out, err)}


def run_to_end(cwd: Path, stage: str, resume: bool = False) -> dict:
    return {**Watched(cwd, stage, resume).wait(), "resume": resume}


def said(stdout: str, stderr: str) -> dict:
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", stdout + "\n" + stderr)  # tqdm's cursor moves
    # a line printed right after a progress bar shares its line: what follows the bar's last "]"
    lines = [ln.rsplit("]", 1)[-1] if "|" in ln else ln for ln in text.replace("\r", "\n").splitlines()]
    lines = [ln.strip() for ln in lines if ln.strip()]
    return {"traceback": "Traceback (most recent call last)" in stderr + stdout, "last": lines[-1] if lines else "",
            "summary": next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(stage_prefixes())), ""),
            "out": stdout[-3000:], "err": stderr[-3000:]}


def stage_prefixes() -> tuple[str, ...]:
    return ("images v", "encode-text: table", "encode-vae: table", "trained ", "resumed", "evaluated", "train:",
            "evaluate:", "up to date", "images:", "report ")


def interrupted(cwd: Path, stage: str, sig: signal.Signals, fraction: float, ref: dict, in_work: bool) -> dict:
    """Start the stage; `in_work`: once its main progress bar shows `fraction` done (the machine's load varies
    too much for a time); else after `fraction` of the reference's whole time. Then signal its process group,
    wait for its exit (SIGKILL after 120 s)."""
    job = Watched(cwd, stage)
    deadline = time.perf_counter() + (0 if in_work else fraction * ref["s"])
    while (job.done < fraction if in_work else time.perf_counter() < deadline) and job.proc.poll() is None:
        time.sleep(0.01)
    if job.proc.poll() is not None:
        return {**job.wait(), "finished_before_signal": True}
    at_s, done = round(time.perf_counter() - job.start, 2), round(job.done, 2)
    os.killpg(job.proc.pid, sig)
    try:
        return {**job.wait(timeout=120), "finished_before_signal": False, "hung": False, "at_s": at_s, "done": done}
    except subprocess.TimeoutExpired:
        os.killpg(job.proc.pid, signal.SIGKILL)
        return {**job.wait(), "finished_before_signal": False, "hung": True, "at_s": at_s, "done": done}


# ------------------------------------------------------------------ outcomes


def table_rows(store: Path, table: str) -> dict[str, str]:
    """key -> sha256 of its meta and stored bytes, read through the store's reader (current version)."""
    from store import Store

    reader = Store(store, create=False).reader(table)
    try:
        rows = {}
        for key in reader.keys():
            meta = json.dumps(reader.meta(key), sort_keys=True, default=str)
            files = reader.files(key)
            digest = hashlib.sha256(meta.encode())
            for name in sorted(files):
                digest.update(name.encode() + files[name])
            rows[key] = digest.hexdigest()
        return rows
    finally:
        reader.close()


def quarantine_rows(store: Path) -> list:
    import pyarrow.parquet as pq

    path = store / "quarantine.parquet"
    if not path.exists():
        return []
    t = pq.read_table(path)
    cols = [c for c in ("key", "reason", "source", "stage") if c in t.column_names]
    return sorted(json.dumps([str(t.column(c)[i]) for c in cols]) for i in range(t.num_rows))


def verify(store: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "store", "verify", str(store)], env=env(),
                          capture_output=True, text=True)
    return {"rc": proc.returncode, "last": (proc.stdout + proc.stderr).strip().splitlines()[-1:]}


def lora_sha(run: Path) -> str | None:
    files = sorted((run / "lora").glob("*.safetensors"))
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


def numbers(obj, path: str = "") -> dict[str, float]:
    """Every number in a JSON document, by its path; times and paths left out (they differ run to run)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not re.search(r"time|seconds|_s$|elapsed|date|wall", str(k)):
                out.update(numbers(v, f"{path}/{k}"))
        return out
    if isinstance(obj, list):
        return {k: v for i, item in enumerate(obj) for k, v in numbers(item, f"{path}[{i}]").items()}
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return {path: obj}
    return {}


def outcome(workdir: Path, stage: str) -> dict:
    if stage in TABLE_OF:
        out = {"verify": verify(workdir / "store"), "rows": table_rows(workdir / "store", TABLE_OF[stage])}
        if stage == "resize-bucket":
            out["quarantine"] = quarantine_rows(workdir / "store")
        return out
    if stage == "train":
        return {"lora_sha": lora_sha(workdir / "run")}
    from stages.evaluate.report import checked_metrics

    return {"metrics": numbers(checked_metrics(workdir / "report", "run the bench again"))}


def committed_rows(workdir: Path, stage: str) -> int:
    """Rows the killed run left committed in its table's newest version (complete or not): a shard is committed
    once its index is written next to it (docs/encode.md), so the rows of the index files."""
    import pyarrow.parquet as pq

    if stage not in TABLE_OF:
        return 0
    tdir = workdir / "store" / TABLE_OF[stage]
    versions = sorted((p for p in tdir.glob("v*") if p.is_dir() and p.name[1:].isdigit()),
                      key=lambda p: int(p.name[1:])) if tdir.is_dir() else []
    if not versions:
        return 0
    return sum(pq.read_metadata(p).num_rows for p in versions[-1].glob("*.index.parquet"))


def differences(ref: dict, got: dict) -> list[str]:
    diffs = []
    for name in sorted(set(ref) | set(got)):
        if name == "verify":
            if got[name]["rc"] != 0:
                diffs.append(f"store verify rc {got[name]['rc']}: {got[name]['last']}")
        elif name == "rows":
            lost = set(ref["rows"]) - set(got.get("rows", {}))
            extra = set(got.get("rows", {})) - set(ref["rows"])
            changed = [k for k in set(ref["rows"]) & set(got.get("rows", {})) if ref["rows"][k] != got["rows"][k]]
            diffs += [f"{len(lost)} rows lost"] * bool(lost) + [f"{len(extra)} extra rows"] * bool(extra)
            diffs += [f"{len(changed)} rows differ (e.g. {sorted(changed)[:2]})"] * bool(changed)
        elif name == "metrics":
            differ = [k for k in ref[name] if got[name].get(k) != ref[name][k]]
            diffs += [f"{len(differ)} numbers differ (e.g. {differ[:3]})"] * bool(differ)
        elif ref.get(name) != got.get(name):
            diffs.append(f"{name} differs")
    return diffs


# ------------------------------------------------------------------ driver


def references(work: Path, stages: list[str]) -> dict[str, dict]:
    """Run every stage in order in work/ref; before each, keep a copy of the state it starts from."""
    ref = work / "ref"
    refs = {}
    for stage in STAGES:
        shutil.copytree(ref, work / f"before-{stage}", symlinks=True)
        result = run_to_end(ref, stage)
        if result["rc"] != 0:
            raise SystemExit(f"reference {stage} failed: {result['err'][-2000:]}")
        refs[stage] = {"s": result["s"], "work_began_s": result["work_began_s"], "summary": result["summary"]}
        if stage in stages:
            refs[stage]["outcome"] = outcome(ref, stage)
        print(f"reference {stage}: {result['s']} s (work from {result['work_began_s']} s): {result['summary']}",
              flush=True)
        if stage == stages[-1]:
            break
    return refs


def trial(work: Path, stage: str, sig: signal.Signals, fraction: float, ref: dict, in_work: bool) -> dict:
    cwd = work / "trial"
    shutil.rmtree(cwd, ignore_errors=True)
    shutil.copytree(work / f"before-{stage}", cwd, symlinks=True)
    first = interrupted(cwd, stage, sig, fraction, ref, in_work)
    kept = committed_rows(cwd, stage)
    steps_on_disk = sorted(int(p.name.split("-")[1]) for p in (cwd / "run" / "checkpoints").glob("step-*"))
    advised = "rerun with --resume" in first["out"] + first["err"] or (stage == "train" and sig == signal.SIGKILL)
    rerun = run_to_end(cwd, stage, resume=advised)
    refused = None
    if rerun["rc"] != 0 and sig == signal.SIGKILL and "nothing to resume" in rerun["last"]:
        # killed before its run folder held a start, without a word: --resume refuses in one line, by design (a
        # typo in --out is not a new run); the rerun it advises is the same command without --resume
        refused, rerun = rerun["last"], run_to_end(cwd, stage)
    row = {"stage": stage, "signal": sig.name, "in_work": in_work, "at_s": first.get("at_s", first["s"]), "first": first,
           "committed_before_rerun": kept, "checkpoints_before_rerun": steps_on_disk, "rerun": rerun,
           "refused_first": refused}
    if rerun["rc"] == 0:
        row["outcome"] = outcome(cwd, stage)
    return row


def judge(row: dict, ref: dict) -> list[str]:
    problems = []
    first, rerun = row["first"], row["rerun"]
    if first.get("hung"):
        problems.append("did not exit within 120 s of the signal")
    if first["traceback"] and row["signal"] != "SIGKILL":
        problems.append(f"killed run printed a traceback: {first['last']}")
    if rerun["rc"] != 0:
        problems.append(f"rerun rc {rerun['rc']}: {rerun['last']}")
    if rerun["traceback"]:
        problems.append(f"rerun printed a traceback: {rerun['last']}")
    if "outcome" in row:
        problems += differences(ref["outcome"], row["outcome"])
    m = re.search(r"encoded (\d+), reused (\d+), skipped \(already done\) (\d+)", rerun["summary"])
    if m and int(m.group(3)) < row["committed_before_rerun"]:
        problems.append(f"needless recompute: {row['committed_before_rerun']} rows committed before the rerun, "
                        f"it skipped {m.group(3)} (encoded {m.group(1)})")
    m = re.search(r"resumed at step (\d+)", rerun["summary"])
    if m and row["checkpoints_before_rerun"] and int(m.group(1)) < row["checkpoints_before_rerun"][-1]:
        problems.append(f"needless recompute: resumed at step {m.group(1)}, checkpoint step "
                        f"{row['checkpoints_before_rerun'][-1]} was on disk")
    return problems


def table(rows: list[dict]) -> str:
    lines = [f"{'stage':14} {'signal':8} {'when':5} {'at_s':>6} {'first rc':>8} {'kept':>5} {'rerun rc':>8}  outcome"]
    for r in rows:
        fin = " (finished first)" if r["first"].get("finished_before_signal") else ""
        kept = r["committed_before_rerun"] if r["stage"] in TABLE_OF else (r["checkpoints_before_rerun"][-1:] or "-")
        verdict = "; ".join(r["problems"]) or "equal to the reference"
        verdict += " (after --resume refused: nothing to resume)" if r.get("refused_first") else ""
        when = f"{r['first'].get('done', 1):.2f}" if r["in_work"] else "start"  # the main bar's share done
        lines.append(f"{r['stage']:14} {r['signal']:8} {when:5} {r['at_s']:6.1f} {r['first']['rc']:8} {str(kept):>5} "
                     f"{r['rerun']['rc']:8}  {verdict}{fin}  | rerun: {r['rerun']['summary'][:110]}")
    return "\n".join(lines)


def prepare(work: Path, demo: Path | None) -> Path:
    if demo is None:
        demo = work / "demo"
        subprocess.run([sys.executable, "-m", "pipeline.cli", "make-tiny-model", str(demo / "tiny-model"),
                        "--variant", "edit-plus"], env=env(), check=True)
        subprocess.run([sys.executable, "-m", "pipeline.cli", "make-demo-data", str(demo / "data"), "--n", "24"],
                       env=env(), check=True)  # the docstring's figures: 24 samples
    (work / "ref").mkdir(parents=True)
    write_config(work / "ref", demo)
    return demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="scratch folder (emptied first)")
    ap.add_argument("--demo", type=Path, help="a `pipeline demo` workdir whose tiny-model/ and data/ to use")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--signals", default="KILL,INT,TERM")
    ap.add_argument("--trials", type=int, default=2, help="per stage and signal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    stages = [s for s in STAGES if s in args.stages.split(",")]
    prepare(args.work, args.demo)
    refs = references(args.work, stages)
    rng = random.Random(args.seed)
    rows = []
    for stage in stages:
        for k, name in enumerate(args.signals.split(",") * args.trials):  # alternately in the work, from the start
            row = trial(args.work, stage, signal.Signals[f"SIG{name}"], rng.random(), refs[stage], k % 2 == 0)
            row["problems"] = judge(row, refs[stage])
            rows.append(row)
            print(table([row]).splitlines()[1], flush=True)
    print(table(rows))
    if args.out:
        for r in rows:
            r.pop("outcome", None)
        args.out.write_text(json.dumps({"references": {k: {n: v[n] for n in ("s", "work_began_s", "summary")}
                                                      for k, v in refs.items()}, "trials": rows}, indent=1))


if __name__ == "__main__":
    main()
