"""Whatever a stage opens, it closes: after each stage of `pipeline run all` (resize, both encoders, train with
its validator, evaluate) and after a second `run all` that finds every stage up to date, the process holds the
same open file descriptors as before (shard descriptors of readers, read leases, TensorBoard writer, locks)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from pipeline.config import load_config
from pipeline.orchestrate import run_all


def _open_fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def test_every_stage_of_run_all_closes_what_it_opened(tiny_plus_model, tmp_path) -> None:
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "data", n=12, fmt="folder", max_controls=1, seed=1, with_masks=False)
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {"source": str(tmp_path / "data"), "store": str(tmp_path / "store"), "model": tiny_plus_model,
                    "run": str(tmp_path / "run"), "report": str(tmp_path / "report")}
    cfg["resize"].update(target_area=64 * 64, control_vae_area=64 * 64, val_fraction=0.34)
    cfg["train"].update(max_steps=2, checkpoint_every=1, batch_size=2, validate_every=1)
    cfg["evaluate"].update(num_samples=1, num_inference_steps=2, noise_seeds=[0], timesteps=[0.5])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    config = load_config(tmp_path / "config.yaml", {})

    # zarr v3 runs one asyncio loop per process in a thread (its epoll and self-pipe socketpair live as long as
    # the process, opened at its first use, not per stage): start it before the baseline.
    from zarr.core.sync import _get_loop

    _get_loop()
    start = _open_fds()
    left: list[tuple[str, dict[str, str]]] = []

    def after_each_stage(line: str) -> None:
        if not line.startswith("=="):  # the stage's summary line: the stage has returned
            now = _open_fds()
            extra = {fd: target for fd, target in now.items() if start.get(fd) != target}
            if extra:
                left.append((line, extra))

    first = run_all(config, log=after_each_stage)
    assert not any(o.skipped for o in first.outcomes)
    second = run_all(config, log=after_each_stage)  # every stage's up-to-date check, nothing else
    assert all(o.skipped for o in second.outcomes)
    assert not left, left
