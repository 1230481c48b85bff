"""The sizes in force are said (resize summary, `store inspect`), and `--area` / `resize.area` scales targets
and the controls' VAE views together, through the CLI."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError, load_config
from pipeline.demo_data import make_demo_data


def _cli(*args: str) -> str:
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_area_scales_targets_and_controls_and_both_are_reported(tmp_path):
    make_demo_data(tmp_path / "data", n=6, fmt="folder", max_controls=2, seed=3)
    # only --target-area: the controls stay at the Edit-Plus default, and the summary says so
    out = _cli("run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "s1"),
               "--target-area", "4096", "--val-fraction", "0")
    assert "sizes: targets ~64² px (resize.target_area 4096); each control: VAE view ~1024² px" in out
    assert "controls are larger than targets: resize.area sets both" in out

    out = _cli("run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "s2"),
               "--area", "4096", "--val-fraction", "0")
    assert "targets ~64² px (resize.target_area 4096); each control: VAE view ~64² px (resize.control_vae_area 4096)" in out
    assert "controls are larger" not in out
    inspect = _cli("store", "inspect", str(tmp_path / "s2"))
    assert "sizes: targets ~64² px (resize.target_area 4096); each control: VAE view ~64² px" in inspect
    control_line = next(line for line in inspect.splitlines() if "control buckets (VAE view)" in line)
    sides = [tuple(map(int, b.split(" ")[0].split("x"))) for b in control_line.split(": ", 1)[1].split(", ")]
    assert sides and all(h * w <= 2 * 4096 for h, w in sides)  # ~64² buckets (32 px steps), not ~1024²


def test_area_in_a_config_file(tmp_path):
    cfg = load_config(None, {"resize.area": 9216})
    assert (cfg.resize.target_area, cfg.resize.control_vae_area) == (9216, 9216)
    assert cfg.resize.fingerprint() == load_config(None, {"resize.target_area": 9216,
                                                          "resize.control_vae_area": 9216}).resize.fingerprint()
    with pytest.raises(ConfigError, match="resize.area = 9216 sets target_area; drop target_area or area"):
        load_config(None, {"resize.area": 9216, "resize.target_area": 4096})
