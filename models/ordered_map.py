"""The one bounded, ordered parallel map: the encoders decode and preprocess inputs in threads through
`ordered_map` on a `concurrent.futures` executor (resize's worker processes: stages/resize/render_pool.py, which
also contains a worker that dies).

Written here because `Executor.map` submits every item at once (before Python 3.14's `buffersize`): over a
million-sample source that holds every sample's bytes in memory. Here at most `ahead` items wait beyond the one
being handed out, so memory stays bounded whatever the dataset size. Each wait for a result is polled
(schemas/interruptible.py): a Ctrl-C that Linux gives to another thread ends it, not only the item's end.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, Iterable, Iterator, TypeVar

from schemas import interruptible

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], executor: Executor | None,
                ahead: int) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) for each item, in input order; with an executor, `fn` runs there with up to `ahead`
    items submitted beyond the one yielded; without one (`None`: no workers), inline. `items` is consumed
    lazily, so its side effects interleave with the results as the window fills."""
    if executor is None:
        for item in items:
            yield item, fn(item)
        return
    window: deque[tuple[T, Future]] = deque()
    for item in items:
        window.append((item, executor.submit(fn, item)))
        while len(window) > ahead:
            done, fut = window.popleft()
            yield done, interruptible.result(fut)
    while window:
        done, fut = window.popleft()
        yield done, interruptible.result(fut)
