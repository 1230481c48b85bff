"""The same LoRA saved by two processes is the same file (`models.canonical_safetensors`): the sha256 that names a
checkpoint, a report's LoRA and train's init LoRA is a function of the weights, and readers read the file as
before."""

from __future__ import annotations

import json
import random

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from fsync_record import fsynced
from lora_writer import write_in_processes
from models.canonical_safetensors import canonicalize, spelled
from models.lora import WEIGHT_NAME, lora_sha256
from stages.evaluate.lora_bytes import digest


def _header(data: bytes) -> tuple[int, dict]:
    size = int.from_bytes(data[:8], "little")
    return size, json.loads(data[8 : 8 + size])


def test_the_same_lora_saved_by_other_processes_is_the_same_file(tiny_edit_model, tmp_path):
    """Before, each process wrote the metadata in its own HashMap order (safetensors' writer) and peft's
    target_modules set in its own str hash order: three sha256 for one LoRA. Other weights: another file."""
    same, other = [tmp_path / f"same-{i}" for i in (1, 2)], tmp_path / "other"
    write_in_processes(tiny_edit_model, {1: [(same[0], 0.5)], 2: [(same[1], 0.5), (other, 0.7)]})
    files = [f / "lora" / WEIGHT_NAME for f in (*same, other)]
    assert files[0].read_bytes() == files[1].read_bytes()
    # what evaluate (`lora_bytes.digest`) and train's init_lora record (`lora_sha256`) name the files by
    assert digest(files[0]).sha256 == digest(files[1]).sha256 == lora_sha256(same[1] / "lora")
    assert digest(files[2]).sha256 != digest(files[0]).sha256


def test_a_canonical_file_is_the_writers_spelling_with_its_metadata_sorted_and_reads_as_written(tmp_path):
    """Same header length and JSON as safetensors' own writer, the data section untouched; safe_open, load_file
    (what diffusers' and ComfyUI's loaders call) read the tensors and the metadata back; every insertion order of
    the metadata gives the same bytes."""
    g = torch.Generator().manual_seed(0)
    tensors = {"transformer.b.lora_A.weight": torch.randn(4, 8, generator=g),
               "transformer.a.lora_B.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
               "transformer.a.lora_A.weight": torch.randn(4, 8, generator=g)}
    meta = {f"key{i}": f'value "{i}"\n\u00e9' for i in range(6)}
    written = []
    for i in range(4):
        items = list(meta.items())
        random.Random(i).shuffle(items)
        path = tmp_path / f"{i}.safetensors"
        save_file(tensors, path, metadata=dict(items))
        canonicalize(path)
        written.append(path.read_bytes())
    assert len(set(written)) == 1
    ours = written[0]
    theirs = save(tensors, metadata=meta)  # the library's own bytes for the same content, in some order
    (size, header), (their_size, their_header) = _header(ours), _header(theirs)
    assert size == their_size and header == their_header and list(header["__metadata__"]) == sorted(meta)
    assert ours[8 + size :] == theirs[8 + their_size :]
    assert spelled(header) == ours[: 8 + size]
    with safe_open(tmp_path / "0.safetensors", framework="pt") as f:
        assert f.metadata() == meta
    loaded = load_file(tmp_path / "0.safetensors")
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_keys_added_while_canonical_are_in_the_metadata_and_no_temp_file_is_left(tmp_path):
    path = tmp_path / "lora.safetensors"
    save_file({"w": torch.ones(2)}, path, metadata={"format": "pt"})
    canonicalize(path, {"base_model_class": "X"})
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "base_model_class": "X"}
    assert [p.name for p in tmp_path.iterdir()] == ["lora.safetensors"]


def test_a_saved_lora_keeps_its_name_after_a_power_loss(tmp_path, monkeypatch):
    """The rewritten file is fsynced, renamed over the library's, then its folder fsynced: before, the folder was
    not, and a power loss after a run said its LoRA was saved could leave the folder without that name."""
    path = tmp_path / "lora.safetensors"
    save_file({"w": torch.ones(2)}, path, metadata={"format": "pt"})
    paths = fsynced(monkeypatch)
    canonicalize(path)
    assert len(paths) == 2 and paths[0].startswith(str(tmp_path.resolve() / ".lora.safetensors.tmp-"))
    assert paths[1] == str(tmp_path.resolve())
