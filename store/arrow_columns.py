"""Arrow column helpers for million-row manifests: zero-copy fixed-width views of key columns, the narrowest
types kept columns fit, a vectorised sortedness check, counts of a column's values and of (h, w) size pairs, and
giving parse scratch memory back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def fixed_width_view(arr: pa.Array) -> np.ndarray | None:
    """A string array whose values all have one byte length, as a zero-copy numpy `S<width>` view (None when
    they do not, or when there are nulls). Bytewise order = Arrow's string order."""
    if len(arr) == 0 or arr.null_count or not pa.types.is_string(arr.type):
        return None
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    width = int(offsets[1] - offsets[0])
    if width == 0 or not np.all(np.diff(offsets) == width):
        return None
    return np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].view(f"S{width}")


# Columns every rank keeps parsed, stored in the narrowest of these types their values fit (tried in order; the
# values read back - `cell`, `locate`, `image_tokens` - are the same ints): [frames, h, w] of latent patches fit
# int16 (~35 -> ~23 MB at 1M samples), a sample's offset in its shard and its size fit uint32 (shards are far
# below 4 GiB: 8 -> 4 MB each, per table).
NARROWER = {
    "img_shapes": (pa.list_(pa.list_(pa.int16())), pa.list_(pa.list_(pa.int32()))),
    "sample_offset": (pa.uint32(),),
    "sample_nbytes": (pa.uint32(),),
}


def narrowed(col: pa.Array, types: tuple[pa.DataType, ...]) -> pa.Array:
    for t in types:
        if col.type == t:
            return col
        try:
            return col.cast(t)  # safe cast: a value that does not fit raises, and the next type is tried
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    return col


def _libc_trim():
    """glibc's malloc_trim, or None (another libc). No library exposes it; it is one call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_memory() -> None:
    """Give freed scratch memory back to the system: Arrow's pool and glibc's heap keep what a parse or a
    million-row compute freed (~85 MB at 1M samples, in every rank) unless asked to return it."""
    pa.default_memory_pool().release_unused()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def value_counts(column: pa.Array | pa.ChunkedArray) -> Counter:
    """Each value's row count (nulls as None), as `Counter(column.to_pylist())` without a Python object per row."""
    counted = pc.value_counts(column)
    return Counter(dict(zip(counted.field("values").to_pylist(), counted.field("counts").to_pylist())))


def size_counts(sizes: pa.Array | pa.ChunkedArray, width: int, scale: int = 1) -> dict[tuple[int, int], int]:
    """(H, W) -> row count, in size order, of a list column of `width` numbers per row whose last two are H and W
    (x `scale`); null rows are skipped. ValueError for a row of another length."""
    if isinstance(sizes, pa.ChunkedArray):
        sizes = sizes.combine_chunks()
    sizes = sizes.drop_null()
    if not len(sizes):  # e.g. no sample with a control: a column of null type, which list_flatten refuses
        return {}
    if not pc.all(pc.equal(pc.list_value_length(sizes), width)).as_py():
        raise ValueError(f"sizes of other than {width} numbers in {sizes.type} column")
    hw = pc.list_flatten(sizes).to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, width)[:, -2:] * scale
    # one number per size (h, w), sorted as the pairs: np.unique over rows (axis=0) sorts ~10x slower
    found, counts = np.unique(hw[:, 0] * 2**32 + hw[:, 1], return_counts=True)
    return {(v >> 32, v & (2**32 - 1)): n for v, n in zip(found.tolist(), counts.tolist())}


def strictly_increasing(keys: pa.Array) -> bool:
    """Manifests are sorted by key: strictly increasing keys are unique (a vectorised check, no hash set)."""
    if len(keys) < 2:
        return True
    return bool(pc.all(pc.less(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py())
