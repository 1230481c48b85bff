"""The data flow of an encode loop: inputs prepared ahead in threads, grouped into batches of one shape (the
stored PNGs are opened by features/pictures.py)."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterable, Iterator, TypeVar


from models.ordered_map import ordered_map
from schemas.errors import UserError

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


def out_of_memory(error: BaseException) -> bool:
    """A device allocation that failed: CUDA's own error, the RuntimeError other backends raise (MPS, the CPU), or
    cuBLAS / cuDNN failing to allocate their workspace (`CUBLAS_STATUS_ALLOC_FAILED`)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(m in text for m in ("out of memory", "can't allocate memory",
                                                                      "STATUS_ALLOC_FAILED"))


class TooLargeAlone(UserError):
    """A single item that runs the device out of memory: the stage stops, keeping what it finished
    (`EncodeJob.working` commits the open shard first), so the rerun encodes only what is left."""


class MemoryBoundForward:
    """`forward(batch) -> one result per item`, run on parts of the batch small enough for the device's memory.

    A batch that runs out of memory is halved and its parts run in turn; the smaller size holds for the rest of
    the run (said once per halving), so the next batches do not fail first. A single item that does not fit stops
    with one line naming it (`TooLargeAlone`): every sample finished before it is kept (the open shard committed)
    and a rerun resumes from them.
    Before, one batch too large (a few big images together) stopped the stage with a traceback, and the rerun
    failed on the same batch. A smaller batch changes the last float32 bits of the VAE latents (within one bf16
    step, docs/encode.md) and, on a GPU, of the text embeddings.
    """

    def __init__(self, forward: Callable[[list[T]], Iterable[R]], stage: str, name_of: Callable[[T], str],
                 device: object, setting: str) -> None:
        self.forward, self.stage, self.name_of, self.device, self.setting = forward, stage, name_of, device, setting
        self.cap: int | None = None  # the largest part that may run, after an out-of-memory
        self.ran = 0  # the forwards the last call completed: one per part (the summary's mean batch counts each)

    def __call__(self, batch: list[T]) -> list[R]:
        results: list[R] = []
        self.ran = 0
        size = len(batch) if self.cap is None else min(len(batch), self.cap)
        while len(results) < len(batch):
            part = batch[len(results) : len(results) + size]
            done = self._try(part)
            if done is not None:
                results.extend(done)
                self.ran += 1
                continue
            if len(part) == 1:
                raise TooLargeAlone(f"{self.stage}: {self.device} ran out of memory encoding {self.name_of(part[0])} "
                                    "alone: free the device (another process on it?), use one with more memory, or "
                                    "a lower-precision dtype; the samples encoded so far are kept and a rerun "
                                    "encodes only the rest")
            size = self.cap = (len(part) + 1) // 2
            from tqdm import tqdm

            tqdm.write(f"{self.stage}: {self.device} ran out of memory on a batch of {len(part)}: batches of at "
                       f"most {size} from now on (set {self.setting} to {size} to start there)")
        return results

    def _try(self, part: list[T]) -> list[R] | None:
        """The part's results, or None when the device ran out of memory (its memory freed: the error and its
        frames are dropped before the smaller retry)."""
        try:
            return list(self.forward(part))
        except Exception as e:  # noqa: BLE001 - re-raised unless it is an out-of-memory
            if not out_of_memory(e):
                raise
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        return None
