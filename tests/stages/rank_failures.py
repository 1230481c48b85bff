"""Run by each of two gloo processes (tests/stages/test_rank_failures.py, not a test module itself): one rank
fails where only it works, and both must stop with the same one line. Rank 0's writes fail with ENOSPC in
turn in a train checkpoint, in train's final LoRA, in the run folder's first files and in an encode commit (each in this process, the error
printed as `RESULT <case>: <line>`); then `pipeline run encode-vae` meets a damaged `images` sample in rank
1's share only, through the CLI (its exit status and output are the test's).

    rank_failures.py TRAIN_STORE MODEL OUT ENCODE_STORE DAMAGED_STORE
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from pipeline.config import load_config
from schemas.errors import UserError

RANK = int(os.environ["RANK"])


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def case(name: str, module, attr: str, failing, call) -> None:
    """`call()` with `module.attr` replaced by `failing` on rank 0; prints the error it ends with."""
    real = getattr(module, attr)
    if RANK == 0:
        setattr(module, attr, failing(real))
    try:
        call()
        print(f"RESULT {name}: no error", flush=True)
    except UserError as e:
        print(f"RESULT {name}: {e}", flush=True)
    finally:
        setattr(module, attr, real)


def main() -> None:
    train_store, model, out, encode_store, damaged_store = map(Path, sys.argv[1:6])
    from stages.encode import vae as encode_vae
    from stages.train import recipe, saving as train_saving, start as train_start
    from stages.train import state as train_state
    from store import writer_commit

    train = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 2}
    case("checkpoint", train_state, "save_optimizer", lambda real: enospc,
         lambda: recipe.run(load_config(None, {**train, "train.checkpoint_every": 1}), train_store, model, out / "a"))

    def final_only(real):  # checkpoints pass; the final LoRA's temp folder is `.lora.tmp`
        return lambda transformer, folder, *a, **k: (enospc() if Path(folder).name == ".lora.tmp"
                                                     else real(transformer, folder, *a, **k))

    case("final", train_saving, "save_lora", final_only,
         lambda: recipe.run(load_config(None, {**train, "train.checkpoint_every": 100}), train_store, model, out / "b"))
    case("run folder", train_start, "atomic_write_bytes", lambda real: enospc,
         lambda: recipe.run(load_config(None, train), train_store, model, out / "c"))
    case("attention record", recipe, "atomic_write_json", lambda real: enospc,
         lambda: recipe.run(load_config(None, train), train_store, model, out / "d"))
    case("commit", writer_commit, "write_version_checksums", lambda real: enospc,
         lambda: encode_vae.run(load_config(None, {"encode_vae.device": "cpu"}), encode_store, model))

    from pipeline.cli import main as cli

    sys.argv = ["pipeline", "run", "encode-vae", "--store", str(damaged_store), "--model", model,
                "--device", "cpu"]
    cli()


if __name__ == "__main__":
    main()
