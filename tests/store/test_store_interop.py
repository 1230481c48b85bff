"""The shards are plain webdataset tars: the unmodified library decodes every member; tables join by key."""

from __future__ import annotations

import io
import json

import torch
import webdataset as wds
from safetensors.torch import load as load_safetensors

from schemas import FieldSpec, Lineage, TableSchema
from store import Store
from store_samples import fill, key_of, sample


def test_plain_webdataset_decodes_every_member(store: Store) -> None:
    fill(store, 12)
    r = store.reader("vae")
    urls = [str(p) for p in r.shard_paths()]

    def safetensors_handler(key: str, data: bytes):
        return load_safetensors(data) if key.endswith("safetensors") else None

    ds = wds.WebDataset(urls, shardshuffle=False).decode(safetensors_handler)
    seen = {}
    for s in ds:
        seen[s["__key__"]] = s
    assert sorted(seen) == r.keys()
    for i in range(12):
        s, want = seen[key_of(i)], sample(i)
        members = {k for k in s if not k.startswith("__")}
        assert members == {"safetensors", "json", "target.png"}
        for name, t in want["tensors"].items():
            assert torch.equal(s["safetensors"][name], t) and s["safetensors"][name].dtype == t.dtype
        assert s["target.png"] == want["files"]["target.png"]
        assert s["json"] == json.loads(json.dumps(want["meta"]))  # default decoder parsed the .json member
        got = r.get(key_of(i))  # and the mmap path agrees member for member
        assert got["meta"] == s["json"]


def test_png_members_decode_with_webdataset_pil(store: Store) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 32), (10, 200, 30)).save(buf, format="PNG")
    schema = TableSchema("images", [FieldSpec("target.png", "png", kind="file")], Lineage("resize-bucket", "c"))
    w = store.writer("images", schema)
    w.add("k0", files={"target.png": buf.getvalue()}, meta={"img_shapes": [[1, 2, 3]], "split": "train"})
    w.commit()
    [s] = list(wds.WebDataset([str(p) for p in store.reader("images").shard_paths()], shardshuffle=False).decode("pil"))
    assert s["target.png"].size == (48, 32) and s["target.png"].getpixel((0, 0)) == (10, 200, 30)


def test_join_two_tables_by_key(store: Store, caplog) -> None:
    fill(store, 10)
    schema = TableSchema("text", [FieldSpec("prompt_embeds", "bfloat16", 2)], Lineage("encode-text", "t"))
    w = store.writer("text", schema)
    for i in [9, 3, 5, 1, 0, 2, 4, 6, 7, 11]:  # 8 missing here, 11 missing in vae
        w.add(key_of(i), tensors={"prompt_embeds": torch.full((i + 1, 8), float(i)).bfloat16()},
              meta={"img_shapes": sample(i)["meta"]["img_shapes"], "split": "train", "length": i + 1})
    w.commit()
    j = store.join("text", "vae")
    assert j.unmatched == {"text": 1, "vae": 1} and "dropped" in caplog.text
    assert sorted(j.keys) == sorted(key_of(i) for i in range(10) if i != 8)
    got = j.get(key_of(3))
    assert got["text"]["tensors"]["prompt_embeds"].shape == (4, 8)
    assert torch.equal(got["vae"]["tensors"]["target"], sample(3)["tensors"]["target"])
    parts = [j.iter_keys(rank=r, world_size=2, seed=0) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(j.keys)
