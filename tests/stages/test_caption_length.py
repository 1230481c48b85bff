"""A caption longer than the transformer can take (200k characters) is quarantined by encode-text with the reason,
so nothing unusable reaches the `text` table (before, it crashed train in the RoPE table)."""

from __future__ import annotations

from typer.testing import CliRunner

from models.multires import text_positions_left
from pipeline.cli import app
from store import Store


def test_text_positions_follow_the_stock_rope_table():
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    table = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True).pos_freqs.shape[0]
    assert text_positions_left([]) == table
    assert text_positions_left([[1, 64, 32], [1, 20, 90]]) == table - 45  # text starts after the largest extent


def test_a_caption_too_long_is_quarantined_at_encode_text(tiny_edit_model, tmp_path, images_fixture):
    fx = images_fixture
    samples = fx.edit_samples()[:2] + [fx.Sample("make it blue " * 16000, (64, 64), [(64, 64)], [(64, 64)])]
    keys = list(fx.write(tmp_path / "s", samples))
    r = CliRunner().invoke(app, ["run", "encode-text", "--store", str(tmp_path / "s"), "--model", tiny_edit_model,
                                 "--device", "cpu"])
    assert r.exit_code == 0, r.output
    st = Store(tmp_path / "s")
    assert sorted(st.reader("text").keys()) == sorted(keys[:2])
    rows = {q["key"]: q for q in st.quarantine().to_pylist() if q["stage"] == "encode-text"}
    assert rows[keys[2]]["reason"] == "caption too long"
    assert "text positions" in rows[keys[2]]["detail"] and "shorten the caption" in rows[keys[2]]["detail"]
