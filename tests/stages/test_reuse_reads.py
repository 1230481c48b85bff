"""Per-sample reuse looks for carried samples only in versions of the same feature lineage, and decides which
those are from schema.json alone: the versions of another lineage (other settings, another model) are never
opened. Before: every complete version's manifest was read and its shards stat'ed on every encode rerun (a
million-row manifest and 20,000 shards per old version), only to be skipped for its lineage."""

from __future__ import annotations

from pipeline.config import load_config
from stages.encode import vae as encode_vae
from store import reader as store_reader
from store.manifest_view import ManifestView


def test_versions_of_another_lineage_are_not_opened(tiny_edit_model, edit_store, monkeypatch):
    encode_vae.run(load_config(None, {"encode_vae.dtype": "float32"}), edit_store, tiny_edit_model)  # v1
    opened = []
    real = ManifestView.open.__func__

    def counting(cls, vdir, table, version):
        opened.append((table, version))
        return real(cls, vdir, table, version)

    monkeypatch.setattr(store_reader.ManifestView, "open", classmethod(counting))
    s = encode_vae.run(load_config(None, {"encode_vae.dtype": "bfloat16"}), edit_store, tiny_edit_model)  # v2
    assert s.version == 2 and s.reused == 0
    assert ("vae", 1) not in opened
