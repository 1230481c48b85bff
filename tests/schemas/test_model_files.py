"""The record of a model's files (schemas/model_files.py) and the wording of what differs between a table's record
and the model now: a few files by path parts, each with what changed (size, else the sha256), then a count."""

from __future__ import annotations

from schemas.model_files import ModelFile, differing_files, files_record

A, B, C = "a" * 64, "b" * 64, "c" * 64


def test_the_files_that_differ_are_named_with_what_changed_then_counted():
    before = [ModelFile("model_index.json", 10, A), ModelFile("transformer/w-00003.safetensors", 123, A),
              ModelFile("vae/config.json", 5, A), ModelFile("vae/w.safetensors", 7, B)]
    now = [ModelFile("model_index.json", 10, A), ModelFile("transformer/w-00003.safetensors", 456, B),
           ModelFile("vae/config.json", 5, C), ModelFile("vae.notes/x", 1, A)]
    said = differing_files(files_record(before), now)
    # by path parts: "vae/..." before "vae.notes/x" (string order would put "vae.notes" first)
    assert said == ("files that differ: transformer/w-00003.safetensors: size 123 -> 456, vae/config.json: sha256 "
                    "aaaaaaaa -> cccccccc, vae/w.safetensors: not in --model and 1 more"), said
    assert differing_files(files_record(before), now, most=5).endswith(", vae.notes/x: new in --model")


def test_no_record_a_damaged_one_or_no_difference_says_nothing():
    files = [ModelFile("model_index.json", 10, A)]
    assert differing_files(None, files) is None  # a table encoded before the files were recorded
    assert differing_files({"model_index.json": [10, A]}, files) is None
    assert differing_files([["model_index.json", "ten", A]], files) is None
    assert differing_files([["model_index.json"]], files) is None
    assert differing_files(files_record(files), files) is None
