"""A batch that runs the device out of memory: encode-text and encode-vae halve it and go on (the table equals the
one a run at the halved batch size writes); a single sample that does not fit stops with one line naming it, and
the rerun resumes."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import load_config
from schemas.errors import UserError
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store

F32 = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"}


def _limited(monkeypatch, module, most: int) -> list[int]:
    """The module's batch forward raises CUDA's out-of-memory error above `most` items; returns the sizes run."""
    real, sizes = module.encode_batch, []

    def forward(model, batch, *args, **kwargs):
        if len(batch) > most:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        sizes.append(len(batch))
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(module, "encode_batch", forward)
    return sizes


def _tables_equal(a, b, table: str) -> None:
    ra, rb = Store(a).reader(table), Store(b).reader(table)
    assert sorted(ra.keys()) == sorted(rb.keys())
    for key in ra.keys():
        ta, tb = ra.tensors(key), rb.tensors(key)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta), key


@pytest.mark.parametrize("module", [encode_text, encode_vae], ids=["text", "vae"])
def test_a_batch_out_of_memory_is_halved_and_the_table_is_whole(module, tiny_edit_model, tmp_path, images_fixture,
                                                                capsys, monkeypatch):
    fx = images_fixture
    samples = [fx.Sample(f"make the square {c}", (64, 64), [(160, 160)], [(160, 160)]) for c in "rgbkwy"]
    two, halved = tmp_path / "two", tmp_path / "halved"
    fx.write(two, samples)
    fx.write(halved, samples)
    # the same pairs as the halved run (a VAE batch of other size may differ by a bf16 step: docs/encode.md)
    module.run(load_config(None, F32), two, tiny_edit_model, batch_size=2)
    sizes = _limited(monkeypatch, module, most=2)
    summary = module.run(load_config(None, F32), halved, tiny_edit_model, batch_size=8)
    assert summary.encoded == len(samples) and max(sizes) == 2
    # the mean batch counts each forward that ran (a halved batch is two), not the batch given
    assert (summary.forwards, summary.forward_items) == (len(sizes), sum(sizes))
    _tables_equal(two, halved, module.TABLE)
    out = capsys.readouterr().out
    assert "ran out of memory on a batch of" in out and "batches of at most 2 from now on" in out


def test_one_sample_that_does_not_fit_stops_in_one_line_and_the_rerun_resumes(tiny_edit_model, tmp_path,
                                                                               images_fixture, monkeypatch):
    fx = images_fixture
    store = tmp_path / "s"
    keys = list(fx.write(store, [fx.Sample(f"make the square {c}", (64, 64), [(160, 160)], [(160, 160)])
                                 for c in "rgb"]))
    _limited(monkeypatch, encode_vae, most=0)
    with pytest.raises(UserError, match=r"ran out of memory encoding sample \w+'s target \(64x64 pixels\) alone"):
        encode_vae.run(load_config(None, F32), store, tiny_edit_model, batch_size=4)
    monkeypatch.undo()
    summary = encode_vae.run(load_config(None, F32), store, tiny_edit_model, batch_size=4)
    assert summary.encoded == len(keys) and sorted(Store(store).reader("vae").keys()) == sorted(keys)


@pytest.mark.parametrize("module", [encode_text, encode_vae], ids=["text", "vae"])
def test_a_stop_out_of_memory_keeps_the_samples_encoded_before_it(module, tiny_edit_model, tmp_path, images_fixture,
                                                                  monkeypatch):
    """Two samples encoded (two forwards each at batch 1: prompt and empty, or target and control), the third
    runs out of memory alone: the stop commits the open shard (one shard holds all three), so the rerun encodes
    only the third. Before, the open shard was dropped and the rerun encoded all three again."""
    fx = images_fixture
    store = tmp_path / "s"
    keys = list(fx.write(store, [fx.Sample(f"make the square {c}", (64, 64), [(160, 160)], [(160, 160)])
                                 for c in "rgb"]))
    real, calls = module.encode_batch, []

    def forward(model, batch, *args, **kwargs):
        calls.append(len(batch))
        if len(calls) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(module, "encode_batch", forward)
    with pytest.raises(UserError, match="the samples encoded so far are kept and a rerun encodes only the rest"):
        module.run(load_config(None, F32), store, tiny_edit_model, batch_size=1)
    monkeypatch.undo()
    summary = module.run(load_config(None, F32), store, tiny_edit_model, batch_size=1)
    assert (summary.skipped, summary.encoded) == (2, 1)
    assert sorted(Store(store).reader(module.TABLE).keys()) == sorted(keys)


def test_other_errors_are_not_taken_for_out_of_memory():
    from stages.encode.batching import MemoryBoundForward, out_of_memory

    assert out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    forward = MemoryBoundForward(lambda part: 1 / 0, "encode-vae", str, "cpu", "encode_vae.batch_size")
    with pytest.raises(ZeroDivisionError):
        forward([1, 2])


def test_a_stop_whose_open_shard_cannot_be_kept_still_stops_the_other_ranks():
    """Keeping the open shard meets a full disk: the other ranks are told of the stop all the same (`failed`), not
    left waiting at the commit for a rank that is gone. Before, the keep came first and its error skipped it."""
    from types import SimpleNamespace

    from stages.encode.batching import TooLargeAlone
    from stages.encode.job import EncodeJob

    def full_disk():
        raise UserError("table 'vae' v1: No space left on device")

    told: list[BaseException] = []
    job = SimpleNamespace(writer=SimpleNamespace(keep_open_shard=full_disk), failed=told.append, close=lambda: None)
    with pytest.raises(UserError, match="No space left"):
        with EncodeJob.working(job):
            raise TooLargeAlone("encode-vae: cpu ran out of memory encoding sample k's target alone")
    assert [type(e) for e in told] == [TooLargeAlone]
