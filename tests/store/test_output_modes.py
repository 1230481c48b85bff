"""Files the pipeline writes are readable as the umask says (0644 under 022), as every file `open` creates is:
safetensors writes its files 0600 (a temp file renamed), so a LoRA, a checkpoint or a merged model's weights
could not be read by the group or another user (a shared cluster's ComfyUI or evaluation account)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from store.format import atomic_dir


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_atomic_dir_leaves_safetensors_files_as_the_umask_says_and_a_hard_link_alone(tmp_path, umask_022):
    base = tmp_path / "base.bin"
    base.write_bytes(b"x")
    base.chmod(0o600)  # another owner's choice: a hard-linked file keeps it (its mode is the source's too)
    with atomic_dir(tmp_path / "out") as tmp:
        save_file({"w": torch.ones(2)}, tmp / "lora.safetensors")
        os.link(base, tmp / "linked.bin")
    assert _mode(tmp_path / "out" / "lora.safetensors") == umask_022
    assert _mode(tmp_path / "out" / "linked.bin") == 0o600 and _mode(base) == 0o600


def test_lora_export_file_is_as_the_umask_says(tmp_path, umask_022):
    from pipeline.cli import app

    src = tmp_path / "lora.safetensors"
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2)}, src)
    out = tmp_path / "comfy.safetensors"
    result = CliRunner().invoke(app, ["lora", "export", str(src), "--format", "comfyui", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert _mode(out) == umask_022
