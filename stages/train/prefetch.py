"""The trainer's micro-batches, prepared inline or ahead by a background thread (`train.prefetch`).

A micro-batch is this rank's share of one global batch of the `DataStream`: its samples read from the store,
their σ / noise / caption-dropout draws for the optimizer step the micro-batch belongs to (micro-batch j of a
start at step s0 belongs to step s0 + j // grad_accum), and the packed, noised batch (`models.flow.FlowBatch`)
on the device. The draws depend on (seed, step, key) only - and, for a sample the step already held in an earlier
micro-batch (its accumulation ran on into the next epoch), on how many times it did (`models.randomness`: a
draw of its own, not the first one counted twice) - so preparing ahead changes no number.

With `depth` > 0 a thread prepares up to `depth` micro-batches ahead: on the CPU the same ops as inline (bit-
identical); on CUDA it builds the batch on the CPU, pins it and copies it on a side stream, and the consumer's
stream waits for that copy (an event) before using it. The stream runs ahead of training, so the data position
a checkpoint records is the position after the last micro-batch *consumed* (`MicroBatch.position`).
A thread, not DataLoader workers: the work is a few mmap'd reads and small tensor ops that release the GIL,
and the stream position must stay in this process.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Callable, Iterator

import torch

from models.flow import FlowBatch, prepare_flow_batch
from models.randomness import draw_caption_dropout, draw_noise, draw_sigma, with_control_dropout
from models.sample import TrainSample
from schemas import interruptible
from schemas.config import TrainConfig
from stages.train.damaged import DamagedRows
from stages.train.data import DataStream, load_at
from stages.train.elastic import micro_split
from store.join import JoinedTables


@dataclass
class MicroBatch:
    epoch: int
    global_batch: list[list[int]]  # every rank's batch (indices into tables.keys)
    ends_epoch: bool
    position: tuple[int, int]  # the stream position after this micro-batch (what a checkpoint records)
    step: int  # the optimizer step it belongs to (the draws' step)
    flows: list[FlowBatch]  # this rank's prepared share, on the device: one batch, or its planned-size parts
    # after an elastic resume on fewer processes (stages/train/elastic.chunks), accumulated one after the other
    ready: Any = None  # CUDA event the consumer's stream waits for (prefetched copies)
    damaged: dict[int, str] = field(default_factory=dict)  # on_damaged=skip: rows of this rank's share left out


def prepare(tables: JoinedTables, tc: TrainConfig, indices: list[int], step: int, device: torch.device,
            dtype: torch.dtype, samples: list[TrainSample] | None = None,
            repeats: dict[str, int] | None = None) -> FlowBatch:
    """Read the samples (or take `samples`, read already), draw their control dropout / σ / noise / caption
    dropout for `step`, pack and noise them on `device`. `repeats`: sample key -> how many times the step's
    earlier micro-batches held it (absent: none)."""
    samples = [load_at(tables, i) for i in indices] if samples is None else samples
    rep = [(repeats or {}).get(s.key, 0) for s in samples]
    samples = with_control_dropout(samples, tc.seed, step, tc.control_dropout, rep)
    sigmas = torch.stack([draw_sigma(s, tc.seed, step, tc.sigma, n) for s, n in zip(samples, rep)])
    noises = [draw_noise(s, tc.seed, step, n) for s, n in zip(samples, rep)]
    empty = [draw_caption_dropout(s, tc.seed, step, tc.caption_dropout, n) for s, n in zip(samples, rep)]
    weights = (tc.loss.mask_weight.foreground, tc.loss.mask_weight.background)
    return prepare_flow_batch(samples, sigmas, noises, empty, weights, device, dtype)


def prepare_share(tables: JoinedTables, tc: TrainConfig, indices: list[int], global_batch: list[list[int]],
                  step: int, device: torch.device, dtype: torch.dtype, rows: DamagedRows | None = None,
                  repeats: dict[str, int] | None = None) -> FlowBatch:
    """`prepare` of this rank's share (its intact samples, `rows` with train.on_damaged=skip:
    stages/train/damaged.py); an empty share (a step of fewer samples than processes after an elastic resume,
    stages/train/elastic.py, or a share all damaged) becomes a stand-in of zero weight: the step's first intact
    sample with all token weights 0, whose loss and gradient are exactly 0 (`models.flow.per_sample_loss`). The
    rank still runs its forward and backward, so DDP's all-reduce goes on in step; the recipe counts only the
    step's real samples."""
    rows = rows if rows is not None else DamagedRows(skip=False)
    samples = rows.load(tables, indices)
    if samples:
        return prepare(tables, tc, indices, step, device, dtype, samples, repeats)
    stand_in = rows.stand_in(tables, (i for b in global_batch for i in b))
    flow = prepare(tables, tc, [], step, device, dtype, [stand_in])
    return replace(flow, weights=[torch.zeros(t.shape[0], device=t.device) for t in flow.targets])


def prepare_chunks(tables: JoinedTables, tc: TrainConfig, indices: list[int], global_batch: list[list[int]],
                   step: int, device: torch.device, dtype: torch.dtype, rows: DamagedRows | None,
                   split: Callable[[list[int]], list[list[int]]],
                   repeats: dict[str, int] | None = None) -> list[FlowBatch]:
    """`prepare_share` as the micro-batches `split` cuts this rank's intact samples into (each sample's draws
    depend on (seed, step, key) only: the same numbers in any cut)."""
    rows = rows if rows is not None else DamagedRows(skip=False)
    samples = rows.load(tables, indices)
    if not samples:  # every one damaged, or an empty share: the stand-in
        return [prepare_share(tables, tc, [], global_batch, step, device, dtype, rows)]
    damaged = rows.damaged_of(indices)
    flows, pos = [], 0
    for group in split([i for i in indices if i not in damaged]):
        flows.append(prepare(tables, tc, group, step, device, dtype, samples[pos:pos + len(group)], repeats))
        pos += len(group)
    return flows


def map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    """`fn` on every tensor of a FlowBatch (dataclasses, lists, None), the rest as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: map_tensors(getattr(obj, f.name), fn) for f in fields(obj)})
    return obj


class MicroBatches:
    """`next()` gives the next micro-batch, prepared inline (depth 0) or by a background thread."""

    def __init__(self, stream: DataStream, tables: JoinedTables, tc: TrainConfig, rank: int, start_step: int,
                 device: torch.device, dtype: torch.dtype, depth: int = 0):
        self.stream, self.tables, self.tc, self.rank = stream, tables, tc, rank
        self.device, self.dtype, self.depth = device, dtype, depth
        self._count = 0
        self._start = start_step
        self._in_step: Counter[int] = Counter()  # the current optimizer step's samples so far (all ranks')
        self._split = micro_split(stream.sampler)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self.rows = DamagedRows(skip=tables.on_damaged == "skip")  # used by the one thread that prepares
        # The read order is the sampler's plan from the stream's position on: a thread checks the samples' bytes
        # ahead of the reads (store/check_ahead.py), so the checksum costs no read time.
        if tc.check_ahead > 0:
            tables.check_ahead(lambda: read_order(stream, rank), window=tc.check_ahead)
        if depth > 0:
            self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._work, name="train-prefetch", daemon=True)
            self._thread.start()

    def as_run(self, global_batch: list[list[int]]) -> list[list[int]]:
        """Every rank's micro-batches of a global micro-step as they run (the padding figures): after a resume on
        fewer processes a rank's share runs as several of the planned size (`elastic.micro_split`), each padded to
        its own longest; counted as one batch its padding was that of a forward no rank ran."""
        return [part for share in global_batch for part in self._split(share)]

    def _make(self) -> MicroBatch:
        epoch, global_batch, ends = self.stream.next()
        step = self._start + self._count // self.tc.grad_accum
        if self._count % self.tc.grad_accum == 0:  # a start begins at a step's first micro-batch
            self._in_step.clear()
        self._count += 1
        indices = global_batch[self.rank]
        repeats = {self.tables.keys[i]: self._in_step[i] for i in indices if self._in_step[i]}
        self._in_step.update(i for b in global_batch for i in b)
        if self._queue is None or self._side is None:  # inline, or a CPU prefetch: the same ops as inline
            flows = prepare_chunks(self.tables, self.tc, indices, global_batch, step, self.device, self.dtype,
                                   self.rows, self._split, repeats)
            return MicroBatch(epoch, global_batch, ends, self.stream.position, step, flows,
                              damaged=self.rows.damaged_of(indices))
        flows = prepare_chunks(self.tables, self.tc, indices, global_batch, step, torch.device("cpu"), self.dtype,
                               self.rows, self._split, repeats)
        with torch.cuda.stream(self._side):
            flows = map_tensors(flows, lambda t: t.pin_memory().to(self.device, non_blocking=True))
            ready = torch.cuda.Event()
            ready.record(self._side)
        return MicroBatch(epoch, global_batch, ends, self.stream.position, step, flows, ready,
                          self.rows.damaged_of(indices))

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._make()
            except BaseException as e:  # handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next(self) -> MicroBatch:
        if self._queue is None:
            return self._make()
        item = interruptible.get(self._queue)  # a Ctrl-C the prefetch thread took ends a wait for a stalled read
        if isinstance(item, BaseException):
            raise item
        if item.ready is not None:  # the compute stream waits for the side-stream copy, and owns the memory
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.ready)
            map_tensors(item.flows, lambda t: t.record_stream(current) or t)
        return item

    def close(self) -> None:
        self._stop.set()
        if self._queue is not None:
            self._thread.join(timeout=5)
        self.tables.stop_check_ahead()


def read_order(stream: DataStream, rank: int) -> Iterator[int]:
    """This rank's joined sample indices in the order the stream reads them, from its position now on, endless
    (the position is taken here, not when the check-ahead thread starts walking the order)."""
    start = stream.position

    def walk(epoch: int, batch: int) -> Iterator[int]:
        while True:
            steps = stream.steps(epoch)
            for k in range(batch, len(steps)):  # by index: a slice of an elastic plan would split every step
                yield from steps[k][rank]
            epoch, batch = epoch + 1, 0

    return walk(*start)


# The share of step time spent waiting for data above which the end of a run suggests `train.prefetch`.
DATA_WAIT_HINT_SHARE = 0.2


def data_wait_line(data_seconds: list[float], step_seconds: list[float], depth: int) -> str | None:
    """The line the end of a run prints when its steps waited for their micro-batches for a noticeable share of
    their time (inline reads and preparation stall the device every step), or None."""
    total = sum(step_seconds)
    if not total:
        return None
    share = sum(data_seconds) / total
    if share < DATA_WAIT_HINT_SHARE:
        return None
    advice = ("set train.prefetch 2 to prepare them ahead in a thread" if depth == 0 else
              f"prefetch {depth} did not keep up: reads are the bottleneck (a faster store, or a local cache of a "
              "remote one)")
    return f"steps waited for their data {share:.0%} of the time (train/data_wait_share): {advice}"
