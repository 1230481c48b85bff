"""The full-size rehearsal at --layers 1 on the CPU (real transformer widths; a minimal 3584-wide text encoder
to keep the test short), the full-width model folder it builds, and `pipeline plan`'s weight bytes against
the real loaded (and quantised) transformer. The 2.1 rehearsal runs in tests/models/test_tiny_model_21.py, on the
full-width 2.1 folder that module's other tests read (built once)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from rehearse import rehearse


def test_rehearsal_layers_1_on_cpu(tmp_path):
    runs = rehearse(tmp_path)
    assert [r["quantize"] for r in runs] == ["int8"]
    for r in runs:
        for key in ("quantize", "offload", "gradient_checkpointing", "batch_size", "layers", "device", "s_per_step",
                    "tokens_per_s", "peak_device_bytes", "peak_host_rss_bytes", "baseline_rss_bytes", "mfu"):
            assert key in r, key
        assert r["layers"] == 1 and r["device"] == "cpu" and r["peak_device_bytes"] is None
        assert r["s_per_step"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"]
        assert r["peak_host_rss_bytes"] > r["baseline_rss_bytes"] > 0
        assert all(map(lambda x: x == x, r["losses"]))  # finite (not NaN)

    # the model folder: real widths, one layer, sharded, loads with the stock classes
    model = tmp_path / "w" / "model"
    tr = json.loads((model / "transformer" / "config.json").read_text())
    assert (tr["num_layers"], tr["num_attention_heads"], tr["attention_head_dim"], tr["joint_attention_dim"],
            tuple(tr["axes_dims_rope"]), tr["in_channels"]) == (1, 24, 128, 3584, (16, 56, 56), 64)
    assert len(list((model / "transformer").glob("*.safetensors"))) > 1  # shard by shard, like the real one
    te = json.loads((model / "text_encoder" / "config.json").read_text())
    assert te["text_config"]["hidden_size"] == 3584
    vae = json.loads((model / "vae" / "config.json").read_text())
    assert (vae["base_dim"], vae["z_dim"], vae["dim_mult"]) == (96, 16, [1, 2, 4, 4])

    # plan's weight bytes = the transformer's bytes as the run loaded it (int8), and as a plain load has it
    from models.loading import load_component
    from models.memory_plan import transformer_counts, transformer_weight_bytes
    from models.quantize import stored_bytes

    counts = transformer_counts(str(model))
    assert transformer_weight_bytes(counts, "bfloat16", "int8") == pytest.approx(runs[0]["base_weight_bytes"], rel=0.001)
    plain = load_component(str(model), "transformer", dtype=torch.bfloat16, device="cpu")  # mmap: reads nothing
    assert transformer_weight_bytes(counts, "bfloat16", "none") == sum(stored_bytes(p) for p in plain.parameters())


@pytest.mark.parametrize("quantize", ["fp8", "nf4"])
def test_plan_weight_bytes_equal_the_loaded_base(quantize, tiny_edit_model):
    """The other quantisations' bytes on the tiny model (loading a full-width one quantised takes ~15-25 s)."""
    from models.loading import load_component
    from models.memory_plan import transformer_counts, transformer_weight_bytes
    from models.quantize import stored_bytes

    loaded = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize=quantize)
    actual = sum(stored_bytes(p) for p in loaded.parameters())
    assert transformer_weight_bytes(transformer_counts(tiny_edit_model), "bfloat16", quantize) == pytest.approx(actual, rel=0.001)


def test_plan_cli_says_fit_or_not(tiny_edit_model):
    from pipeline.cli import app

    ok = CliRunner().invoke(app, ["plan", "--model", tiny_edit_model, "--gpu-memory", "80"])
    assert ok.exit_code == 0 and "fits" in ok.output and "train" in ok.output
    small = CliRunner().invoke(app, ["plan", "--model", tiny_edit_model, "--gpu-memory", "0.0001"])
    assert small.exit_code == 1 and "DOES NOT FIT" in small.output and "quantize_base" in small.output


def test_plan_names_the_options_of_the_stage_that_does_not_fit(tiny_edit_model):
    """Only encode-vae over --gpu-memory (its VAE batch at 1024²; the tiny transformer fits): the options line
    named the train settings (quantize or offload the transformer, checkpointing), none of which encode-vae
    reads. Now each stage that does not fit gets its own settings."""
    from pipeline.cli import app

    r = CliRunner().invoke(app, ["plan", "--model", tiny_edit_model, "--gpu-memory", "1"])
    assert r.exit_code == 1 and "encode-vae" in r.output, r.output
    stages_over = [line.split()[0] for line in r.output.splitlines() if "DOES NOT FIT" in line]
    assert stages_over == ["encode-vae"], r.output
    options = [line for line in r.output.splitlines() if line.startswith("options")]
    assert options == ["options for encode-vae (try one with --set KEY=VALUE): a smaller encode_vae.batch_size / "
                       "resize.target_area"], r.output
