"""The train start hashes a local model folder once per node, not once per rank (8 ranks used to read a 41 GB
folder 8 times at once), and every rank reaches the same fingerprint: a node whose copy differs stops all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from two_ranks import launch_two, results


def test_two_ranks_of_a_node_read_the_model_files_once_and_agree(tiny_edit_model, tmp_path, monkeypatch):
    from models.loading import model_fingerprint

    other = tmp_path / "other-copy"
    shutil.copytree(tiny_edit_model, other)
    (other / "vae" / "config.json").write_text((other / "vae" / "config.json").read_text() + "\n")
    outs = launch_two("fingerprint_ranks.py", str(tmp_path / "cache"), tiny_edit_model, str(other))
    assert all(code == 0 for code, _, _ in outs), outs
    same = [json.loads(results(out)["same"]) for _, out, _ in outs]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "reference-cache"))
    want = model_fingerprint(tiny_edit_model)
    assert same[0]["fingerprint"] == same[1]["fingerprint"] == want
    files = sorted(str(f.relative_to(tiny_edit_model)) for f in Path(tiny_edit_model).rglob("*") if f.is_file())
    read = [r for s in same for r in s["reads"]]  # every file read by one rank, once: the other found it cached
    assert sorted(read) == files and all(n == 1 for s in same for n in s["reads"].values()), same
    lines = [results(out)["differ"] for _, out, _ in outs]
    assert lines[0] == lines[1] and "not the same on every rank" in lines[0], lines
