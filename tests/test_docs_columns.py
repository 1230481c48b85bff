"""docs/architecture.md's table of tables names exactly the tensors, files and manifest columns that the stages
write (read back from the schema.json of tables written by the real resize-bucket, encode-text and encode-vae)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALWAYS = {"key", "split", "img_shapes"}  # documented once above the table, for every table


def documented() -> dict[str, tuple[set[str], set[str]]]:
    """table -> (tensor / file names, manifest column names): the backticked names of its row's two cells."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"\| `(images|text|vae)` \| (.*) \| (.*) \|$", line)
        if m:
            names = lambda cell: set(re.findall(r"`([A-Za-z0-9_{}.]+)`", cell))  # noqa: E731
            rows[m.group(1)] = (names(m.group(2)) - {"encode_text.no_control_embeds", "train.control_dropout"},
                                names(m.group(3)))
    return rows


@pytest.fixture(scope="module")
def written(tiny_plus_model, tmp_path_factory) -> dict[str, tuple[set[str], set[str]]]:
    from pipeline.config import load_config
    from pipeline.demo_data import make_demo_data
    from stages.encode import text, vae
    from stages.resize.stage import run as resize
    from store import Store

    root = tmp_path_factory.mktemp("docs_columns")
    make_demo_data(root / "data", n=3, fmt="folder", max_controls=2, seed=1, with_masks=True)
    cfg = load_config(None, {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64,
                             "resize.control_vl_area": 64 * 64, "encode_text.no_control_embeds": True})
    resize(cfg, root / "data", root / "store")
    text.run(cfg, root / "store", tiny_plus_model, device="cpu")
    vae.run(cfg, root / "store", tiny_plus_model, device="cpu")
    st = Store(root / "store", create=False)
    out = {}
    for table, version in st.tables().items():
        fields = json.loads((st.version_dir(table, version) / "schema.json").read_text())["fields"]
        out[table] = ({f["name"] for f in fields if f["kind"] in ("tensor", "file")},
                      {f["name"] for f in fields if f["kind"] == "column"} - ALWAYS)
    return out


def test_documented_table_columns_are_the_written_ones(written):
    docs = documented()
    assert set(docs) == set(written) == {"images", "text", "vae"}
    for table in written:
        assert docs[table][0] == written[table][0], f"{table}: tensors / files documented vs written"
        assert docs[table][1] == written[table][1], f"{table}: manifest columns documented vs written"
