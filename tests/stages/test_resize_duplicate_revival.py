"""A duplicate (same target, controls and caption) of a sample whose first copy the rendering rejects (its mask
is damaged) was dropped as a "duplicate" of a sample the table does not hold: the edit pair was lost although a
good copy of it was in the source. Now the next copy with another mask is rendered instead, the same table
whatever the worker count."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from test_resize_bucket import cfg, png, put, rgb
from stages.resize.stage import run
from store import Store


def _mask(left: int) -> bytes:
    m = Image.new("L", (64, 48), 0)
    m.paste(255, (0, 0, left, 48))
    return png(m)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("dups") / "src"
    target, control = png(rgb(64, 48)), png(rgb(64, 64, (10, 200, 10)))
    put(root, "a1", target, controls=[control], mask=b"\x89PNG\r\n\x1a\n garbage")  # first copy: a damaged mask
    put(root, "a2", target, controls=[control], mask=_mask(16))  # the copy kept instead
    put(root, "a3", target, controls=[control], mask=_mask(40))  # a duplicate of a2
    put(root, "a4", target, controls=[control], mask=b"\x89PNG\r\n\x1a\n garbage")  # same mask as a1: not revived
    put(root, "b1", png(rgb(48, 64, (0, 0, 200))), controls=[control])
    put(root, "b2", png(rgb(48, 64, (0, 0, 200))), controls=[control])  # a plain duplicate of a kept sample
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_the_next_copy_of_a_sample_whose_first_copy_was_rejected_is_kept(source, tmp_path, workers):
    store = tmp_path / "store"
    summary = run(cfg(workers=workers), source, store)
    st = Store(store)
    rows = {r["source"].rsplit("/", 1)[-1]: r for r in st.reader("images").manifest.to_pylist()}
    assert set(rows) == {"a2.png", "b1.png"}, rows
    mask = np.asarray(Image.open(io.BytesIO(st.reader("images").files(rows["a2.png"]["key"])["mask.png"])))
    assert mask[:, :8].min() == 255 and mask[:, 24:].max() == 0  # a2's mask (left 16 px edited), not a3's
    q = {r["source"].rsplit("/", 1)[-1]: r for r in st.quarantine().to_pylist()}
    assert {k: r["reason"] for k, r in q.items()} == {"a1.png": "bad-mask", "a3.png": "duplicate",
                                                      "a4.png": "duplicate", "b2.png": "duplicate"}
    assert q["a3.png"]["detail"].endswith("a2.png")  # names the copy the table holds
    assert summary.written == 2 and summary.quarantined["duplicate"] == 3 and summary.quarantined["bad-mask"] == 1
    kept = {(a.rsplit("/", 1)[-1], b.rsplit("/", 1)[-1]) for a, b in summary.duplicates}
    assert kept == {("a2.png", "a3.png"), ("a1.png", "a4.png"), ("b1.png", "b2.png")}
