"""Role audit (schemas/config.py): `evaluate.batch_size` and `train.batch_size` as validation's rows per forward
are throughput - in no hash - because the held-out loss grid does not depend on them beyond float rounding
(mixed-shape rows padded together). Measured on the tiny model: at most ~2e-7 relative between 1, 2 and 8 rows
per forward."""

from __future__ import annotations

import numpy as np
import torch

from models.held_out import loss_grid
from test_held_out import transformer, val_samples  # noqa: F401 - the module's fixtures


def test_rows_per_forward_change_the_held_out_losses_by_rounding_only(transformer, val_samples):  # noqa: F811
    one = loss_grid(transformer, val_samples, [0, 1], [0.3, 0.7], 1)
    finite = np.isfinite(one)
    assert finite.any()
    for rows in (2, 8):
        other = loss_grid(transformer, val_samples, [0, 1], [0.3, 0.7], rows)
        assert (np.isfinite(other) == finite).all()
        np.testing.assert_allclose(other[finite], one[finite], rtol=1e-6, atol=0)


def test_outlines_read_batch_by_batch_give_the_grid_of_the_full_samples(transformer, val_samples):  # noqa: F811
    """Single-LoRA evaluate keeps outlines (key, img_shapes, mask) and reads each batch's samples through `load`:
    the grid is the one of the samples held in full, bit for bit, and a sample whose rows span two batches (4
    rows a sample, 3 rows a forward) is read once per pass."""
    from stages.evaluate.val_share import outline

    full = loss_grid(transformer, val_samples, [0, 1], [0.3, 0.7], 3)
    reads = []
    outlines = [outline(s) for s in val_samples]
    streamed = loss_grid(transformer, outlines, [0, 1], [0.3, 0.7], 3, load=lambda i: (reads.append(i), val_samples[i])[1])
    np.testing.assert_array_equal(streamed, full)
    assert reads == list(range(len(val_samples)))


def test_an_outline_does_not_keep_its_samples_buffer_alive():
    """A sample as the store reader hands it out: every tensor a view of one buffer of its bytes (float32 mask:
    `from_features`' `.float()` copies nothing). Its outline keeps the mask's values, not the buffer (latents
    and all): before, a masked val sample's whole vae bytes stayed held through both loss passes."""
    import gc
    import weakref

    from models.sample import from_features
    from stages.evaluate.val_share import outline

    buf = np.arange(4 * 16 * 16 + 64, dtype=np.float32)  # the target latents, then 64 mask tokens
    vae = {"target": torch.frombuffer(buf, dtype=torch.float32, count=4 * 16 * 16).view(1, 4, 16, 16),
           "mask_weight": torch.frombuffer(buf, dtype=torch.float32, count=64, offset=4 * 16 * 16 * 4)}
    text = {"prompt_embeds": torch.zeros(3, 8), "empty_embeds": torch.zeros(2, 8)}
    sample = from_features("k", text, vae, [(1, 8, 8)])
    expected = sample.mask_weight.clone()
    gone = weakref.ref(buf)
    small = outline(sample)
    del buf, vae, sample
    gc.collect()
    assert gone() is None
    assert torch.equal(small.mask_weight, expected)


def test_a_cell_computed_alone_equals_that_cell_of_the_whole_grid(transformer, val_samples):  # noqa: F811
    """A grown seed / σ grid computes only its new cells (stages/evaluate/loss_pass.py): each cell's batches hold
    the same samples at that cell alone, so its numbers are those of a whole grid's computation, bit for bit (rows
    batched across cells differed with their neighbours by float rounding). The other cells stay NaN, unrun."""
    whole = loss_grid(transformer, val_samples, [0, 1], [0.3, 0.7], 3)
    cells = np.array([[False, False], [True, False]])
    part = loss_grid(transformer, val_samples, [0, 1], [0.3, 0.7], 3, cells=cells)
    np.testing.assert_array_equal(part[:, 1, 0], whole[:, 1, 0])
    assert np.isnan(part[:, 0]).all() and np.isnan(part[:, 1, 1]).all()
    # and a seed grid of [1] alone gives seed 1's cells of [0, 1]
    np.testing.assert_array_equal(loss_grid(transformer, val_samples, [1], [0.3, 0.7], 3)[:, 0], whole[:, 1])
