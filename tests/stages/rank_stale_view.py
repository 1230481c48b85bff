"""Run by each of two gloo processes (tests/stages/test_rank_stale_view.py, not a test module itself): rank 1's
view of a shared folder lags (a shared filesystem whose directory cache lags on its node). Exit status and output
are the test's.

    rank_stale_view.py train STORE MODEL OUT MAX_STEPS   `pipeline run train --resume`; rank 1's listing of the
                                                        run folder ends one checkpoint earlier
    rank_stale_view.py encode STORE MODEL [V|unseen|settings|listing|hidden]
                                                        `pipeline run encode-text`; rank 1 does not see the
                                                        table's complete version yet, or (V) reads `images` vV
                                                        (its view of store.json lags), or (unseen) cannot make
                                                        that version current either, or (settings) is given
                                                        another hashed setting, or (listing) both ranks encode
                                                        with another hashed setting (a new version) and rank 1
                                                        lists no version in the table's folder when it picks
                                                        the number to write, or (hidden) rank 1 does not see
                                                        the folder of the version rank 0 opened, nor its
                                                        schema.json until its writer's first wait
    rank_stale_view.py evaluate STORE MODEL RUN OUT V|pruned|settings
                                                        `pipeline run evaluate --all-checkpoints`; rank 1 reads
                                                        `text` vV (its view of store.json lags), or does not
                                                        list RUN's oldest checkpoint (pruned in its view), or
                                                        is given another σ grid (as many σ, other values)
    rank_stale_view.py tables STORE MODEL OUT SPLIT V|STORE1|settings|revision
                                                        `pipeline run train` with validation; rank 1 reads the
                                                        SPLIT split's `text` as vV, or the store at STORE1 (its
                                                        own copy, which differs), or is given another learning
                                                        rate, or runs another training revision
    rank_stale_view.py val-damaged STORE MODEL OUT       the train validator (on_damaged=skip) on two ranks;
                                                        rank 1 finds val row 0 damaged (its node's copy)
    rank_stale_view.py val-model STORE MODEL OUT         the train validator on two ranks; rank 1 cannot walk
                                                        the model folder (its node's copy), printed as
                                                        `RESULT error: <line>`
    rank_stale_view.py done STORE MODEL OUT              train.run(skip_if_done=True, resume=True) as `pipeline
                                                        run all` calls it; rank 1 does not see OUT's final LoRA
    rank_stale_view.py damaged STORE MODEL OUT           `pipeline run train --resume --new-run`; rank 1 reads
                                                        every checkpoint of OUT as damaged (its node's copy)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    from pipeline.cli import main as cli

    if sys.argv[1] == "encode":
        store, model, *images = sys.argv[2:5]
        from stages.encode import plan
        from store import Store

        extra = []
        if os.environ["RANK"] == "1" and images == ["settings"]:
            extra = ["--set", "encode_text.batching=padded"]  # its own copy of the config differs
        elif images == ["listing"]:
            extra = ["--set", "encode_text.batching=padded"]
            if os.environ["RANK"] == "1":
                from store import format as fmt, writer_open

                pick, listing = writer_open.candidate_version, fmt.list_versions

                def lagging(root, table, want, world=None):  # its listing of the table folder lags: no version
                    fmt.list_versions = lambda root, table: []
                    try:
                        return pick(root, table, want, world)
                    finally:
                        fmt.list_versions = listing

                writer_open.candidate_version = lagging
        elif images == ["hidden"]:
            extra = ["--set", "encode_text.batching=padded"]
            if os.environ["RANK"] == "1":
                from types import SimpleNamespace

                from schemas import view_lag
                from store import format as fmt, writer

                opening, is_dir, is_file, clock = writer.open_version, Path.is_dir, Path.is_file, view_lag.time
                waits: list[float] = []

                def hidden(root, table, want, version=None):  # the folder rank 0 just made is not in its view yet
                    vdir = fmt.version_dir(root, table, version)
                    Path.is_dir = lambda p: p != vdir and is_dir(p)
                    Path.is_file = lambda p: (p != vdir / fmt.SCHEMA_JSON or bool(waits)) and is_file(p)
                    view_lag.time = SimpleNamespace(monotonic=clock.monotonic, sleep=waits.append)
                    try:
                        return opening(root, table, want, version)
                    finally:
                        Path.is_dir, Path.is_file, view_lag.time = is_dir, is_file, clock
                        print(f"RESULT waits: {len(waits)}", file=sys.__stdout__, flush=True)  # rank 1: no stdout

                writer.open_version = hidden
        elif os.environ["RANK"] == "1" and images == ["unseen"]:
            from schemas.errors import UserError

            def not_complete(self, table, version):  # what set_current says of a version it does not see whole
                raise UserError(f"table '{table}' v{version} is not complete; cannot make it current")

            Store.find_version = lambda self, table, lineage, serving=(): None
            Store.set_current = not_complete
        elif os.environ["RANK"] == "1" and images:
            hold = plan.hold
            plan.hold = lambda root, tables, what: hold(root, {"images": int(images[0])}, what)
        elif os.environ["RANK"] == "1":
            Store.find_version = lambda self, table, lineage, serving=(): None  # the complete version not listed yet
        sys.argv = ["pipeline", "run", "encode-text", "--store", store, "--model", model, "--device", "cpu", *extra]
        cli()
        return
    if sys.argv[1] == "evaluate":
        store, model, run, out, version = sys.argv[2:7]
        from store import lease

        extra = []
        if os.environ["RANK"] == "1" and version == "settings":
            extra = ["--set", "evaluate.timesteps=[0.1, 0.3, 0.5, 0.7, 0.8]"]  # its own copy of the config differs
        elif os.environ["RANK"] == "1" and version == "pruned":
            from stages.train import state as train_state

            real = train_state.complete_checkpoints
            train_state.complete_checkpoints = lambda root: real(root)[1:]  # the oldest gone in its view
        elif os.environ["RANK"] == "1":
            hold = lease.hold
            lease.hold = lambda root, tables, what, *a: hold(root, {**tables, "text": int(version)}, what, *a)
        sys.argv = ["pipeline", "run", "evaluate", "--all-checkpoints", "--set", f"paths.run={run}", "--store",
                    store, "--model", model, "--out", out, "--num-samples", "0", "--device", "cpu", *extra]
        cli()
        return
    if sys.argv[1] == "tables":
        store, model, out, split, view = sys.argv[2:7]
        if os.environ["RANK"] == "1" and view.isdigit():
            from store import lease

            hold = lease.hold
            lease.hold = lambda root, tables, what, *a: hold(
                root, {**tables, "text": int(view)} if f"'{split}'" in what else tables, what, *a)
        elif os.environ["RANK"] == "1" and view == "revision":
            from stages.train import start

            start.training_revision = lambda tc, f=start.training_revision: f(tc) + 1  # another release's code
        elif os.environ["RANK"] == "1" and view != "settings":
            store = view
        extra = ["--set", "train.learning_rate=0.0002"] if os.environ["RANK"] == "1" and view == "settings" else []
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", out, "--device", "cpu",
                    "--max-steps", "2", "--batch-size", "2", "--set", "train.lora.rank=4", "--set",
                    "train.validate_every=2", *extra]
        cli()
        return
    if sys.argv[1] == "val-damaged":
        store, model, out = sys.argv[2:5]
        from accelerate import PartialState

        from pipeline.config import load_config
        from stages.train import validate
        from store.integrity import DamagedData

        PartialState(cpu=True)
        if os.environ["RANK"] == "1":
            real = validate.load_at

            def load_at(tables, i):
                if i == 0:
                    raise DamagedData("val sample 0 is damaged in this node's copy (injected)")
                return real(tables, i)

            validate.load_at = load_at
        cfg = load_config(None, {"train.device": "cpu", "train.on_damaged": "skip", "train.max_damaged_fraction": 0.5,
                                 "train.validate_max_samples": 2})
        v = validate.Validator(cfg.train, store, model, Path(out), 2)
        print(f"RESULT keys: {','.join(s.key for s in v.samples)}")
        print(f"RESULT damaged: {','.join(sorted(v.damaged))}")
        return
    if sys.argv[1] == "val-model":
        store, model, out = sys.argv[2:5]
        from accelerate import PartialState

        import models.loading
        from pipeline.config import load_config
        from schemas.errors import UserError
        from stages.train import validate

        PartialState(cpu=True)
        if os.environ["RANK"] == "1":
            def model_files(model):
                raise UserError(f"model folder {model} cannot be read on this node (injected)")

            models.loading.model_files = model_files
        cfg = load_config(None, {"train.device": "cpu", "train.validate_max_samples": 2})
        try:
            validate.Validator(cfg.train, store, model, Path(out), 2)
        except Exception as e:  # noqa: BLE001 - each rank's outcome is the test's
            print(f"RESULT error: {type(e).__name__}: {' '.join(str(e).splitlines())}", flush=True)
            return
        print("RESULT error: none", flush=True)
        return
    if sys.argv[1] == "done":
        store, model, out = sys.argv[2:5]
        from pipeline.config import load_config
        from stages.train import recipe

        if os.environ["RANK"] == "1":
            recipe.up_to_date = lambda *a, **k: False  # OUT/lora not listed yet on this node
        cfg = load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4,
                                 "train.max_steps": 2, "train.checkpoint_every": 2})
        result = recipe.run(cfg, store, model, out, resume=True, skip_if_done=True)
        print(f"RESULT up_to_date: {result.up_to_date}")
        return
    if sys.argv[1] == "damaged":
        store, model, out = sys.argv[2:5]
        from store import checksum

        if os.environ["RANK"] == "1":  # every checkpoint file fails its CRC32C here
            checksum.file_mismatch = lambda folder, name, *a: f"{name} does not match its CRC32C (injected)"
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", out, "--device", "cpu",
                    "--max-steps", "3", "--batch-size", "2", "--set", "train.lora.rank=4", "--resume", "--new-run"]
        cli()
        return
    store, model, out, steps = sys.argv[2:6]
    from stages.train import state as train_state

    if os.environ["RANK"] == "1":
        real = train_state.complete_checkpoints
        train_state.complete_checkpoints = lambda root: real(root)[:-1]  # the newest not listed yet
    sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", out, "--device", "cpu",
                "--max-steps", steps, "--batch-size", "2", "--set", "train.lora.rank=4", "--set",
                "train.checkpoint_every=2", "--resume"]
    cli()


if __name__ == "__main__":
    main()
