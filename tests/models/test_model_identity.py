"""Model identity (models.loading fingerprints): what the stored features are checked against. A new revision of a
hub id is another fingerprint, and its weights (hub blobs, named by their sha256) are never read to get it: a 41 GB
20B model costs no hashing. A local folder whose weights are replaced in place is another fingerprint."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import models.file_hashes as fh
from models import loading


def _blob(repo: Path, data: bytes, lfs: bool) -> Path:
    name = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(data).hexdigest()  # as the hub names them
    p = repo / "blobs" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return p


def _revision(repo: Path, commit: str, weights: bytes) -> None:
    snap = repo / "snapshots" / commit
    files = {"model_index.json": (b'{"_class_name": "QwenImageEditPipeline"}', False),
             "vae/config.json": (b'{"z_dim": 16}', False),
             "vae/diffusion_pytorch_model.safetensors": (weights, True)}
    for rel, (data, lfs) in files.items():
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(_blob(repo, data, lfs), (snap / rel).parent), snap / rel)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def _new_process() -> None:
    """What a later stage run starts with: nothing resolved or fingerprinted yet (both are per-process caches)."""
    loading.resolve_model.cache_clear()
    loading.component_fingerprint.cache_clear()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _new_process()
    yield tmp_path / "hub" / "models--owner--tiny"
    _new_process()


def test_a_new_hub_revision_is_another_fingerprint_and_its_weights_are_not_read(hub, monkeypatch):
    read = []
    real = fh.file_sha256
    monkeypatch.setattr(fh, "file_sha256", lambda p: read.append(Path(p).name) or real(p))
    _revision(hub, "a" * 40, b"weights of revision a" * 1000)
    first = loading.component_fingerprint("owner/tiny", ("vae",))
    assert loading.model_fingerprint("owner/tiny")
    _revision(hub, "b" * 40, b"weights of revision b" * 1000)  # refs/main moved on (a download of a newer one)
    _new_process()
    assert loading.component_fingerprint("owner/tiny", ("vae",)) != first
    assert read and all(len(name) == 40 for name in read)  # the small git blobs only, never a weight file


def test_weights_replaced_in_place_in_a_local_folder_are_another_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = tmp_path / "m" / "vae" / "diffusion_pytorch_model.safetensors"
    weights.parent.mkdir(parents=True)
    (tmp_path / "m" / "vae" / "config.json").write_text("{}")
    (tmp_path / "m" / "model_index.json").write_text('{"vae": ["diffusers", "AutoencoderKLQwenImage"]}')
    weights.write_bytes(b"\0" * 4096)
    _new_process()
    first = loading.component_fingerprint(str(tmp_path / "m"), ("vae",))
    st = weights.stat()
    weights.write_bytes(b"\1" * 4096)  # same size, mtime put back (cp -p / rsync -a --inplace)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    _new_process()
    assert loading.component_fingerprint(str(tmp_path / "m"), ("vae",)) != first
    _new_process()


def test_a_rerun_download_s_bookkeeping_is_no_new_model(tmp_path, monkeypatch):
    """`hf download --local-dir M` keeps its bookkeeping in M/.cache/huggingface/ and rewrites it (a fresh
    timestamp) on every rerun, unchanged weights or not. Before, that changed the model's fingerprint: every table
    re-encoded, every run retrained. Hidden files (and .git) are no part of the model; its files are."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "m"
    (root / "vae").mkdir(parents=True)
    (root / "vae" / "config.json").write_text("{}")
    (root / "model_index.json").write_text('{"vae": ["diffusers", "AutoencoderKLQwenImage"]}')
    (root / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 4096)
    meta = root / ".cache" / "huggingface" / "download" / "vae" / "diffusion_pytorch_model.safetensors.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text("0123abcd\netag\n1764000000.0\n")
    _new_process()
    first = loading.model_fingerprint(str(root)), loading.component_fingerprint(str(root), ("vae",))
    meta.write_text("0123abcd\netag\n1764999999.0\n")  # the rerun's timestamp
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    _new_process()
    assert (loading.model_fingerprint(str(root)), loading.component_fingerprint(str(root), ("vae",))) == first
    (root / "vae" / "config.json").write_text('{"z_dim": 16}')  # a file of the model: another model
    _new_process()
    assert loading.model_fingerprint(str(root)) != first[0]


def test_the_walk_gives_each_file_and_the_fingerprint_it_always_gave(tmp_path, monkeypatch):
    """`model_files` (what an encoder records in attrs.model_files, what a refusal compares) comes from the walk
    the fingerprint hashes: every file with its size and sha256, by path parts ("a/b" before "a.b/c"), each read
    once; and the fingerprint is the one every stored table recorded before (a change would re-encode them all)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "m"
    for rel, data in {"model_index.json": b"{}", "a/b": b"1" * 10, "a.b/c": b"22", "a-b": b"", "z/y/x": b"3" * 7,
                      ".cache/huggingface/x": b"hidden"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    read = []
    real = fh.file_sha256
    monkeypatch.setattr(fh, "file_sha256", lambda p: read.append(Path(p).name) or real(p))
    _new_process()
    files = loading.model_files(str(root))
    assert [(f.path, f.size) for f in files] == [("a/b", 10), ("a-b", 0), ("a.b/c", 2), ("model_index.json", 2),
                                                 ("z/y/x", 7)]
    assert all(f.sha256 == hashlib.sha256((root / f.path).read_bytes()).hexdigest() for f in files)
    # the fingerprint as models.loading computed it before the walk returned the files: sorted Paths, str names
    h = hashlib.sha256()
    for p in sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts):
        h.update(str(p.relative_to(root)).encode())
        h.update(hashlib.sha256(p.read_bytes()).hexdigest().encode())
    assert loading.model_fingerprint(str(root)) == h.hexdigest()[:16]
    assert sorted(read) == ["a-b", "b", "c", "model_index.json", "x"]  # each once: the second walk finds them cached
