"""The sizes in force are said (resize summary, `store inspect`), and `--area` / `resize.area` scales targets
and the controls' VAE views together, through the CLI."""

from __future__ import annotations

import re

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
    with pytest.raises(ConfigError, match="resize.area = 9216 sets target_area and control_vae_area, but target_area is 4096: set area alone, or "
                       "target_area without area"):
        load_config(None, {"resize.area": 9216, "resize.target_area": 4096})


def test_a_flag_wins_over_the_files_area_or_its_two_keys(tmp_path):
    """`--set resize.area=A` on a config that sets target_area and control_vae_area (every shipped one) was
    refused with 'drop target_area, control_vae_area or area' (`run all` has no --area flag: the documented
    small-scale switch could not be used without editing the file); and `--target-area` on a file setting `area`
    likewise. A flag or --set wins over the file's value, as for every other key; two flags clashing are still
    refused (above)."""
    keys = tmp_path / "keys.yaml"
    keys.write_text("resize:\n  target_area: 1048576\n  control_vae_area: 1048576\n  control_vl_area: 147456\n")
    for cfg in (load_config(keys, sets={"resize.area": 9216}), load_config(keys, {"resize.area": 9216})):
        assert (cfg.resize.target_area, cfg.resize.control_vae_area, cfg.resize.control_vl_area) == (9216, 9216, 147456)
    area = tmp_path / "area.yaml"
    area.write_text("resize:\n  area: 9216\n")
    cfg = load_config(area, {"resize.target_area": 4096})
    assert (cfg.resize.target_area, cfg.resize.control_vae_area) == (4096, 9216)
    cfg = load_config(area, sets={"resize.control_vae_area": 4096})
    assert (cfg.resize.target_area, cfg.resize.control_vae_area) == (9216, 4096)
    clash = tmp_path / "clash.yaml"  # a file clashing with itself is still refused
    clash.write_text("resize:\n  area: 9216\n  target_area: 4096\n")
    with pytest.raises(ConfigError, match="resize.area = 9216 sets target_area"):
        load_config(clash, {"resize.control_vae_area": 4096})


def test_store_inspect_of_a_small_store_says_its_size_and_where_the_quarantine_rows_are(tmp_path):
    """A table under 50 kB read `0.0 MB` (an empty table, to a new user), the splits came in the manifest's order
    (`{'val': 1, 'train': 3}` in one store, train first in the next), and the quarantine line counted the rows
    without saying where they are to be read."""
    make_demo_data(tmp_path / "data", n=3, fmt="folder", max_controls=1, seed=3)
    (tmp_path / "data" / "target" / "orphan.txt").write_text("a caption without its picture")
    _cli("run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "st"), "--area", "1024",
         "--val-fraction", "0.5")
    inspect = _cli("store", "inspect", str(tmp_path / "st"))
    version = next(line for line in inspect.splitlines() if "* v1:" in line)
    assert re.search(r" shards?, \d+ KiB", version) and "0.0 MiB" not in version, version
    splits = version.split("splits ")[1]
    assert splits.index("'train'") < splits.index("'val'"), version
    assert f"{{'orphan-file': 1}} (each file's reason and detail: {tmp_path / 'st'}/quarantine.parquet)" in inspect
