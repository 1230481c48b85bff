"""The advice for a damaged schema.json / checksums.json names the stage to rerun from the version's own records
(store/ holds no table -> stage map): the schema's lineage, its copy in checksums.json, or a sibling version's."""

from __future__ import annotations

import json

from store import format as fmt
from store.checksum import seal
from store.integrity import repair_hint


def _version(table_dir, n, stage=None, copy=None):
    vdir = table_dir / f"v{n}"
    vdir.mkdir(parents=True)
    (vdir / fmt.SCHEMA_JSON).write_text(json.dumps({"lineage": {"stage": stage}}) if stage else "{damaged")
    record = {"format": 1, "files": {}, **({"stage": copy} if copy else {})}
    (vdir / fmt.CHECKSUMS).write_bytes(seal(record))
    return vdir


def test_the_stage_comes_from_the_versions_own_records(tmp_path):
    table = tmp_path / "store" / "vae"
    v1 = _version(table, 1, copy="encode-vae")  # schema.json damaged: checksums.json's copy
    assert "rerun `pipeline run encode-vae` with the same store" in repair_hint(v1, fmt.SCHEMA_JSON)
    v2 = _version(table, 2, stage="encode-vae")  # checksums.json damaged: the schema
    (v2 / fmt.CHECKSUMS).write_bytes(b"garbage")
    assert "`pipeline run encode-vae`" in repair_hint(v2, fmt.CHECKSUMS)


def test_an_older_version_without_the_copy_asks_a_sibling_else_says_the_stage(tmp_path):
    table = tmp_path / "store" / "text"
    old = _version(table, 1)  # written before checksums.json kept the stage, and its schema.json is damaged
    assert "rerun the stage that wrote it" in repair_hint(old, fmt.SCHEMA_JSON)
    _version(table, 2, stage="encode-text")
    assert "`pipeline run encode-text`" in repair_hint(old, fmt.SCHEMA_JSON)
