"""The data flow of an encode loop: inputs prepared ahead in threads, grouped into batches of one shape (the
stored PNGs are opened by features/pictures.py)."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterable, Iterator, TypeVar


from models.ordered_map import ordered_map

T = TypeVar("T")
R = TypeVar("R")


def prefetched(items: Iterable[T], load: Callable[[T], R], workers: int = 2, depth: int = 32) -> Iterator[R]:
    """`map(load, items)` in order, with up to `depth` loads running ahead in threads (PNG decode and
    preprocessing overlap the model forward; PIL and numpy release the GIL for the heavy parts)."""
    if workers <= 0:
        yield from map(load, items)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _, loaded in ordered_map(load, items, pool, ahead=depth - 1):
            yield loaded


def batches_by_shape(items: Iterable[T], shape_of: Callable[[T], Hashable | None], batch_size: int,
                     window: int | None = None) -> Iterator[list[T]]:
    """Batches whose items all share one input shape, so no padding enters the forward and each result is
    bit-for-bit the one the item gets alone (padding and mixed shapes change float rounding).

    `shape_of` returning None sends the item alone. Items wait in per-shape groups; a full group is emitted at
    once; when more than `window` items wait, the largest group goes out partly filled; at the end every group
    is flushed.
    """
    window = 8 * batch_size if window is None else window  # bounds memory: waiting items hold their pixels
    groups: OrderedDict[Hashable, list[T]] = OrderedDict()
    waiting = 0
    for item in items:
        shape = shape_of(item)
        if shape is None:  # the item must run alone
            yield [item]
            continue
        group = groups.setdefault(shape, [])
        group.append(item)
        waiting += 1
        if len(group) >= batch_size:
            yield groups.pop(shape)
            waiting -= batch_size
        elif waiting > window:
            biggest = max(groups, key=lambda s: len(groups[s]))
            batch = groups.pop(biggest)
            waiting -= len(batch)
            yield batch
    for batch in groups.values():
        yield batch
