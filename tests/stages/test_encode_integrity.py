"""The encode stages refuse a damaged `images` sample (one line naming it), and an encoder that finds its table
completed by another process meanwhile reports "up to date" instead of writing a duplicate version."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from damage import flip_bit, key_at, sample_byte
from pipeline.cli import app
from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.encode.common import EncodeJob
from store import Store
from store.verify import verify_store

F32 = {"encode_vae.dtype": "float32"}


def test_encode_vae_refuses_a_damaged_png_in_images(tiny_edit_model, edit_store):
    key = key_at(edit_store, "images", 1)
    shard, pos = sample_byte(edit_store, "images", key, "target.png")
    flip_bit(shard, pos, 3)  # inside the PNG's pixel data: still decodes, wrong pixels
    res = CliRunner().invoke(app, ["run", "encode-vae", "--store", str(edit_store), "--model", tiny_edit_model,
                                   "--device", "cpu"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    line = [ln for ln in res.output.splitlines() if "error:" in ln][0]
    assert "table 'images' v1" in line and key in line and shard.name in line and "pipeline store repair" in line
    assert "vae" not in Store(edit_store).tables()


def test_encoder_finding_its_table_completed_meanwhile_reports_up_to_date(tiny_edit_model, edit_store, monkeypatch):
    real = EncodeJob.open_writer
    raced = []

    def other_process_finishes_first(self, schema, shard_size_mb):
        if not raced:  # another encoder (same config) completes the table while this one loads its model
            raced.append(1)
            other = encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)
            assert not other.up_to_date and other.version == 1
        return real(self, schema, shard_size_mb)

    monkeypatch.setattr(EncodeJob, "open_writer", other_process_finishes_first)
    summary = encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)
    assert summary.up_to_date and summary.version == 1 and summary.encoded == 0
    st = Store(edit_store)
    assert st.versions("vae") == [1] and st.tables()["vae"] == 1  # no duplicate version
    assert verify_store(Path(edit_store), progress=False) == []
