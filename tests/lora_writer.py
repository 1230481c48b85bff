"""Checkpoint LoRAs of known weights for the evaluate and LoRA-file tests, written in this process
(`write_checkpoint`) or in cold processes of their own (`write_in_processes`: `python tests/lora_writer.py`).

The processes are cold interpreters on purpose, not forks of a warm parent (`warm_start`): what made the same
weights give other bytes is state each new process draws for itself (Rust's HashMap seed in safetensors' writer,
Python's str hash seed behind peft's `target_modules` set), and a fork inherits its parent's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def add_checkpoint_lora(transformer) -> None:
    """The adapter every checkpoint here is written from (rank 4, alpha 4; lora_A as peft draws it under seed 3)."""
    import torch

    from models.lora import add_lora
    from schemas.config import LoraConfig

    # peft draws lora_A from the global RNG: seeded, so the "far" LoRA is the same in any test order (it was
    # not, and after tests/stages/test_train_ddp.py it lowered this tiny random model's loss: a random direction
    # can; with this seed it raises it)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        add_lora(transformer, LoraConfig(rank=4, alpha=4.0))


def add_random_b_lora(transformer, seed: int = 0, std: float = 0.2) -> None:
    """The trainer's adapter at rank 4, alpha 8 (alpha != rank: a loader must read the scale), lora_B drawn
    N(0, `std`) under `seed`: peft's B = 0 would leave every output the base model's, and 0.2 is a trained
    adapter's size, its effect far above float32 rounding."""
    import torch

    from models.lora import add_lora
    from schemas.config import LoraConfig

    add_lora(transformer, LoraConfig(rank=4, alpha=8.0))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)


def write_checkpoint(transformer, folder: Path, scale: float) -> None:
    """A LoRA with B = scale x a fixed random matrix (scale 0: exactly the base model) at FOLDER/lora, and the
    resume.json that marks a committed checkpoint (stages/train/state.py)."""
    import torch

    from models.lora import save_lora

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    save_lora(transformer, folder / "lora")
    (folder / "resume.json").write_text("{}")


def write_in_processes(model: str, jobs: dict[int, list[tuple[Path, float]]]) -> None:
    """One cold process per PYTHONHASHSEED of `jobs` (all at once), each writing its (folder, scale) checkpoints
    (`write_checkpoint` from `add_checkpoint_lora`'s adapter): the same weights saved by other processes. The
    seed is set so the str hash order differs as it does between two runs."""
    # the suite's PYTHONPATH after ours: a `pip --target` stack (bench/gpu/rehearse) has its libraries only there
    suite = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), *suite])}
    procs = [subprocess.Popen([sys.executable, __file__, model, *(f"{folder}={scale}" for folder, scale in todo)],
                              env={**env, "PYTHONHASHSEED": str(seed)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for seed, todo in jobs.items()]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out


def main(model: str, *checkpoints: str) -> None:
    from models.loading import load_component

    transformer = load_component(model, "transformer")
    add_checkpoint_lora(transformer)
    for arg in checkpoints:
        folder, scale = arg.rsplit("=", 1)
        write_checkpoint(transformer, Path(folder), float(scale))


if __name__ == "__main__":
    main(*sys.argv[1:])
