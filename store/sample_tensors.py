"""A sample's tensors as views of its bytes (no copy): from its safetensors member's own header, or else from the
manifest's `tensors` layout (a store written by hand). Part of the reader (store/reader.py), which hands it the
sample's checked bytes."""

from __future__ import annotations

import json
from functools import cache
from typing import TYPE_CHECKING, Any

from schemas.errors import UserError
from store.shard import SAFETENSORS_NAMES

if TYPE_CHECKING:  # imported where tensors are made: the store's commands that read no tensor start without it
    import torch


@cache  # per tensor of every sample read
def torch_dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UserError(f"unknown tensor dtype {name!r} in manifest")
    return dt


_TAR_BLOCK = 512


def member_tensors(buf: Any, at: int) -> dict[str, torch.Tensor] | None:
    """The tensors of a sample whose first tar member (header at `at` in `buf`) is its `.safetensors` file, as
    views of `buf`, from that file's own (checked) header; None when the first member is something else.

    Read from the sample's bytes rather than from the manifest's `tensors` column: that column, parsed, is the
    largest thing a reader holds (~400 MB per process at 1M samples), and the bytes are read anyway."""
    with memoryview(buf) as mv:
        name = bytes(mv[at : at + 100]).split(b"\0", 1)[0]
        if not name.endswith(b".safetensors"):
            return None
        data = at + _TAR_BLOCK
        n = int.from_bytes(mv[data : data + 8], "little")
        header = json.loads(bytes(mv[data + 8 : data + 8 + n]))
    first = data + 8 + n
    import torch

    out = {}
    for tname, meta in header.items():
        if tname == "__metadata__":
            continue
        dt = torch_dtype(SAFETENSORS_NAMES[meta["dtype"]])
        begin, end = meta["data_offsets"]
        count = (end - begin) // dt.itemsize
        if count == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
            out[tname] = torch.empty(meta["shape"], dtype=dt)
            continue
        out[tname] = torch.frombuffer(buf, dtype=dt, count=count, offset=first + begin).view(meta["shape"])
    return out


def layout_tensors(buf: Any, base: int, layout: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors a `tensors` manifest cell lays out (name, offset in the shard, nbytes, dtype, shape) as views of
    `buf`, where shard offset 0 lies at `base`: for samples whose first member is not a safetensors file."""
    import torch

    out = {}
    for t in layout:
        dt = torch_dtype(t["dtype"])
        n = t["nbytes"] // dt.itemsize
        if n == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
            out[t["name"]] = torch.empty(t["shape"], dtype=dt)
            continue
        out[t["name"]] = torch.frombuffer(buf, dtype=dt, count=n, offset=t["offset"] + base).view(t["shape"])
    return out
