"""Each LoRA file is read once per evaluate for its checks (CRC32C against the sealed record and sha256 in one
pass; a checkpoint unchanged since an earlier evaluate checked it, not at all) plus once to load it (the loader
parses the bytes it hashed). Before: the CRC check, the sha256, the load
(twice for the first checkpoint: attach read the file, then load_lora read it again) and a sha256 after the load,
each a full read: 4-5 reads of every evaluated checkpoint, at 60 checkpoints of 1 GB minutes per run."""

from __future__ import annotations

import shutil

from read_counter import WEIGHTS, count_lora_reads
from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from stages.evaluate import stage, val_pictures
from stages.evaluate.checkpoint_files import check_and_hash
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)


def _sealed_copy(run_and_store, tmp_path):
    from stages.train.state import file_checksums
    from store.checksum import seal

    root = tmp_path / "root"
    shutil.copytree(run_and_store / "run", root / "run")
    for step in (10, 20, 30):  # what train commits: every file's size and CRC32C, sealed
        folder = root / "run" / "checkpoints" / f"step-{step}"
        (folder / "resume.json").write_bytes(seal({"files": file_checksums(folder)}))
    return root


def test_all_checkpoints_reads_each_file_once_to_check_and_once_to_load(run_and_store, tiny_edit_model, tmp_path,
                                                                        monkeypatch):
    root = _sealed_copy(run_and_store, tmp_path)
    ckpts, out = _ckpts(root), tmp_path / "report"
    sizes = {str((p / WEIGHTS).resolve()): (p / WEIGHTS).stat().st_size for _, p in ckpts}
    counts = count_lora_reads(monkeypatch)
    assert ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out).evaluated == 3
    # checked and hashed, then loaded; the best (step 20) and the last (step 30) once more when the summary names
    # them: still the bytes evaluated (a training rewriting one meanwhile), pictures or not
    named = {str((p / WEIGHTS).resolve()) for s, p in ckpts if s in (20, 30)}
    assert dict(counts) == {f: (3 if f in named else 2) * n for f, n in sizes.items()}
    counts.clear()
    again = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    # up to date: no file read, their sha256 remembered (`models.file_hashes`); before, each was read whole
    assert again.up_to_date and sum(counts.values()) == 0 and sum(sizes.values()) > 0


def test_one_lora_is_read_once_to_check_and_once_to_load(run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    from store.checksum import write_folder_record

    lora = tmp_path / "lora"
    shutil.copytree(run_and_store / "run" / "checkpoints" / "step-10" / "lora", lora)
    write_folder_record(lora)  # as train seals RUN/lora
    weights = str((lora / WEIGHTS).resolve())
    counts = count_lora_reads(monkeypatch)
    stage.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, lora, tmp_path / "r")
    assert dict(counts) == {weights: 2 * (lora / WEIGHTS).stat().st_size}
    counts.clear()
    again = stage.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, lora, tmp_path / "r",
                      skip_if_done=True)
    assert again.up_to_date and sum(counts.values()) == 0  # remembered unchanged; before: read whole again


def test_two_ranks_read_each_checkpoint_once_between_them(tmp_path):
    """Under a launcher each file is read by one rank (checkpoint i by rank i % 2) and both hold every hash.
    Before, every rank read every file twice (CRC, then sha256). A damaged file that only rank 1 reads stops
    both ranks with its one line."""
    import hashlib
    import json

    import torch
    from safetensors.torch import save_file

    from stages.train.state import file_checksums
    from store.checksum import seal
    from two_ranks import launch_two, results

    for step in (1, 2, 3, 4, 5):
        folder = tmp_path / f"step-{step}"
        (folder / "lora").mkdir(parents=True)
        save_file({"transformer.a.lora_A.weight": torch.full((64, 8), float(step))}, folder / "lora" / WEIGHTS)
        (folder / "resume.json").write_bytes(seal({"files": file_checksums(folder)}))
    files = {step: (tmp_path / f"step-{step}" / "lora" / WEIGHTS).resolve() for step in (1, 2, 3, 4, 5)}
    want = {str(step): hashlib.sha256(f.read_bytes()).hexdigest() for step, f in files.items()}
    outs = launch_two("hash_ranks.py", str(tmp_path))
    assert all(code == 0 for code, _, _ in outs), outs
    ok = [json.loads(results(out)["ok"]) for _, out, _ in outs]
    for rank, got in enumerate(ok):
        assert got["shas"] == want and got["kept"] == [1, 2, 3, 4, 5]
        mine = [s for i, s in enumerate((1, 2, 3, 4, 5)) if i % 2 == rank]
        assert got["read"] == {str(files[s]): files[s].stat().st_size for s in mine}
    lines = [results(out)["damaged"] for _, out, _ in outs]
    assert lines[0] == lines[1] and "checkpoint step 2" in lines[0] and "damaged" in lines[0], lines


def test_a_lora_parsed_from_its_bytes_is_the_file_and_cut_bytes_are_one_line(run_and_store):
    """The loader's bytes path (`read_lora(..., data=)`) gives what reading the file gives, metadata included;
    bytes cut short are refused in one line naming the file, as a file cut short is."""
    import pytest
    import torch

    from models.lora import read_lora
    from schemas.errors import UserError

    lora = run_and_store / "run" / "checkpoints" / "step-10" / "lora"
    data = (lora / WEIGHTS).read_bytes()
    (a, ca), (b, cb) = read_lora(lora), read_lora(lora, data)
    assert ca == cb and ca is not None and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for cut in (data[:100], data[:4], b"[1]" + data[3:]):
        with pytest.raises(UserError, match="not a readable .safetensors file") as e:
            read_lora(lora, cut)
        assert "\n" not in str(e.value) and str(lora / WEIGHTS) in str(e.value)



def test_the_pictured_samples_captions_are_read_for_their_rows_only(edit_store, monkeypatch):
    """The report's captions and pictures (`stored_pictures`) are the `images` table's: a sample the table lacks
    has none. The captions and the pictures' places are read for the pictured rows only, in one pass over the row
    groups holding them (`meta_and_files_of`; `meta_of` then `files_of` decoded them twice); before, `meta(key)`
    parsed every meta column of `images` and kept it while the images were made (~735 MB at 1M samples, on every
    rank), and `files(key)` the `files` column (~95 MB)."""
    from types import SimpleNamespace

    import pyarrow.parquet as pq

    from store import Store

    passes: list[list[str]] = []
    real = pq.ParquetFile.iter_batches

    def iter_batches(self, *a, **kw):
        passes.append(kw.get("columns"))
        return real(self, *a, **kw)

    with Store(edit_store, create=False).reader("images") as images:
        keys = images.keys()
        picked = [SimpleNamespace(key=k, controls=[None]) for k in (keys[3], keys[0])]
        picked.append(SimpleNamespace(key="0" * 32, controls=[None]))  # not in the table
        monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
        got = val_pictures.stored_pictures(images, picked, "stop", None)
        monkeypatch.undo()
        assert passes == [["caption", "files"]]
        assert not set(images.meta_columns()) & images.view.parsed
        assert "files" not in images.view.parsed  # their places too (`files_of`): `files(key)` kept the column
        assert [caption for caption, _, _ in got] == [images.meta(keys[3])["caption"], images.meta(keys[0])["caption"],
                                                     ""]
        for (_, controls, target), s in zip(got[:2], picked):
            assert target.size == (images.meta(s.key)["bucket"][1], images.meta(s.key)["bucket"][0])
            assert len(controls) == 1
        assert got[2][1:] == ([], None)
    assert val_pictures.stored_pictures(None, picked, "stop", None) == [("", [], None)] * 3


def test_a_damaged_pictured_sample_is_refused_or_skipped_alone(edit_store):
    """A flipped bit in a pictured sample's target.png: on_damaged=stop refuses (DamagedData naming the repair), skip
    records it under `images:<key>` and loses only that sample's pictures, the others' are whole."""
    from types import SimpleNamespace

    import pytest

    from damage import flip_bit, sample_byte
    from store import Store
    from store.integrity import DamagedData

    with Store(edit_store, create=False).reader("images") as images:
        keys = images.keys()
    flip_bit(*sample_byte(edit_store, "images", keys[1], "target.png"), 3)
    picked = [SimpleNamespace(key=k, controls=[None]) for k in keys[:3]]
    with Store(edit_store, create=False).reader("images", on_damaged="skip") as images:
        with pytest.raises(DamagedData, match="store repair"):
            val_pictures.stored_pictures(images, picked, "stop", None)
    with Store(edit_store, create=False).reader("images", on_damaged="skip") as images:
        damaged: dict = {}
        got = val_pictures.stored_pictures(images, picked, "skip", damaged)
        assert list(damaged) == [f"images:{keys[1]}"] and "crc32c" in damaged[f"images:{keys[1]}"]
        assert got[1][1:] == ([], None) and got[1][0] == images.meta(keys[1])["caption"]
        assert all(target is not None and len(controls) == 1 for _, controls, target in (got[0], got[2]))


def test_a_flipped_bit_is_refused_though_an_unchecked_hash_of_it_was_remembered_first(run_and_store, tmp_path):
    """A checkpoint damaged since it was sealed is refused by evaluate even when a hasher that checks nothing
    (`pipeline compare` hashing the best checkpoint, train hashing its init_lora) hashed the damaged bytes first:
    evaluate took that remembered sha256 for a checked pass's and evaluated the damaged weights."""
    import pytest

    from damage import flip_bit
    from models.lora import lora_sha256
    from schemas.errors import UserError
    from stages.evaluate.lora_bytes import remembered_sha256

    ckpts = _ckpts(_sealed_copy(run_and_store, tmp_path))
    for (_, path), unchecked in zip(ckpts[1:], (remembered_sha256, lora_sha256)):
        weights = path / WEIGHTS
        flip_bit(weights, weights.stat().st_size - 2, 6)  # a finite value still: only the checksum can tell
        unchecked(weights)
        with pytest.raises(UserError, match="changed after it was written"):
            check_and_hash([(20, path)])
