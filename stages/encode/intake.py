"""The input side of an encode job: this rank's `images` samples read checked, the rejected ones quarantined
(rows written at commit), and the damaged-input threshold of on_damaged=skip."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar
from weakref import WeakKeyDictionary

import numpy as np

from schemas.errors import Rejected, UserError
from stages.encode.summary import DAMAGED_INPUT

if TYPE_CHECKING:
    from stages.encode.job import EncodeJob
    from stages.encode.progress import SampleProgress

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, eq=False)
class Todo(Sequence):
    """The keys `open_writer` leaves to encode, with their `images` rows where it looked them up (`rows`: a rule
    that refuses some control count; ~2 s per 1M keys), so `read_inputs` takes them with the keys instead of looking
    them up again. The keys are a tuple: no caller can change them in place and leave the rows misaligned (before,
    the rows waited in `job.todo_rows` and were reused only for the very list object they were looked up for)."""
    keys: tuple[str, ...] = ()
    rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i):
        return self.keys[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys)


def read_inputs(job: EncodeJob, keys: Sequence[str], by_controls: Callable[[int, str], Rejected | None] | None = None
                ) -> Iterator[tuple[str, dict[str, Any] | Rejected]]:
    """(key, `images` sample) in order, every sample's bytes checked before they are returned (a check-ahead
    thread verifies the next ones while the encoder works, store/check_ahead.py). With on_damaged=skip a
    damaged sample comes as a `Rejected` (quarantined as DAMAGED_INPUT by `accepted`) instead of raising.
    `by_controls(num_controls, key)`: the model's rule on a sample's control count, asked of the manifest's column
    before any byte is read; a sample it rejects comes as its `Rejected`, unread (`refused_by_controls`)."""
    from store.integrity import DamagedData

    at = rows_of(job, keys)
    counts, refused = refused_by_controls(job, keys, by_controls, at)
    job.images.check_ahead(at[(at >= 0) & ~np.asarray(refused, bool)].tolist())
    for key, n, no in zip(keys, counts, refused):
        if no and by_controls is not None and (rejected := by_controls(n, key)) is not None:
            yield key, rejected
            continue
        try:
            sample: dict[str, Any] | Rejected = job.images.get(key)
        except DamagedData as e:
            if job.on_damaged != "skip":
                raise
            sample = Rejected(DAMAGED_INPUT, str(e), key=key)
        yield key, sample


def key_rows(job: EncodeJob, keys: list[str]) -> np.ndarray:
    """The `images` rows of `keys`, in their order (-1: a key the table lacks; its read says so): one batched
    lookup (a `row_of` per key took 7.5 s of one process at 1M keys, bench/encode_input_rows.py)."""
    import pyarrow as pa

    if not keys:
        return np.empty(0, np.int64)
    return job.images.rows_of_keys(pa.array(keys, pa.string()))


def rows_of(job: EncodeJob, keys: Sequence[str]) -> np.ndarray:
    """`key_rows(keys)`: a `Todo`'s own rows where `open_writer` looked them up already, else looked up."""
    if isinstance(keys, Todo):
        return keys.rows if keys.rows is not None else key_rows(job, list(keys.keys))
    return key_rows(job, list(keys))


def refused_by_controls(job: EncodeJob, keys: list[str], rule: Callable[[int, str], Rejected | None] | None,
                        at: np.ndarray) -> tuple[list[int], list[bool]]:
    """Each key's control count (the `images` column `num_controls`) and whether `rule` refuses it, in the order of
    `keys` (`at`: their `key_rows`, `rows_of`). Decided from the column, so a refused sample's
    files are never read: an Edit model run over an Edit-Plus dataset read and checked every byte of the table
    (hours at 1M samples) to end in "would be empty". Two plain lists, not a Rejected per key (a million of them
    held at once). A table none of whose counts the rule refuses (the usual case) is answered from its distinct
    counts alone, the keys not looked up (counts then 0)."""
    import pyarrow as pa

    if rule is None or not keys or not refuses_any(job, rule):
        return [0] * len(keys), [False] * len(keys)
    counts = _control_counts(job.images.column("num_controls").take(pa.array(np.maximum(at, 0))))
    distinct = control_census(job)[0]  # every count a row holds; the rule asked once per distinct count
    no = np.array([rule(int(n), "") is not None for n in distinct], bool)
    refused = no[np.searchsorted(distinct, counts)] & (at >= 0)
    return counts.tolist(), refused.tolist()


def refuses_any(job: EncodeJob, rule: Callable[[int, str], Rejected | None] | None) -> bool:
    """Does `rule` refuse any control count the `images` table holds?"""
    if rule is None or not job.images.has_column("num_controls"):
        return False
    return any(rule(int(n), "") is not None for n in control_census(job)[0])


def control_census(job: EncodeJob) -> tuple[np.ndarray, np.ndarray]:
    """The `images` table's distinct control counts, sorted, and how many samples hold each: taken once per job
    (the plan's check, the writer's open and the reads asked it each, ~3 passes over a 1M-row column)."""
    if job.control_census is None:
        job.control_census = np.unique(_control_counts(job.images.column("num_controls")), return_counts=True)
    return job.control_census


def _control_counts(column) -> np.ndarray:
    """A `num_controls` column as int64 (a null: 0, as `meta` gives it)."""
    import pyarrow.compute as pc

    return pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64)


def check_any_allowed(job: EncodeJob, rule: Callable[[int, str], Rejected | None] | None, model: str) -> None:
    """Before the model loads: a table whose every sample `rule` refuses for its control count (an Edit model over
    an Edit-Plus dataset) is one line naming the counts. Decided from the `images` column alone, the same on every
    rank (they read one version, `plan._agreed_plan`); it used to load the model (minutes for a 20B/7B one), then
    quarantine each sample unread and end in "would be empty". A sample refused later (damaged, caption too long)
    still ends there, at the commit."""
    if rule is None or not len(job.images) or not job.images.has_column("num_controls"):
        return
    distinct, n = control_census(job)
    refusals = [rule(int(c), "") for c in distinct]
    if any(r is None for r in refusals):
        return
    counts = ", ".join(f"{k} with {c} control{'s' if c != 1 else ''}" for c, k in zip(distinct.tolist(), n.tolist()))
    first = refusals[0]
    advice = first.detail.split("; ", 1)[-1]
    raise UserError(f"table '{job.summary.table}' would be empty: all {len(job.images)} samples of table 'images' "
                    f"v{job.images.version} in {job.store.root} are refused for their control count ({counts}): "
                    f"{model}: {first.reason}; {advice}; nothing was encoded")


# NFC (the Qwen tokenizers' normalizer) makes a text at most 3x shorter in UTF-8 (a Hangul syllable's three
# 3-byte jamo become one 3-byte syllable); a byte-level BPE token then covers at most its own longest spelling
NFC_SHRINK = 3


def least_caption_tokens(caption: str, tokenizer, lock: AbstractContextManager | None = None) -> int:
    """A lower bound on the tokens of any prompt holding `caption`, from its UTF-8 length alone (no tokenizing:
    a 20 MB caption took the tokenizer minutes and gigabytes before "caption too long" rejected it). `lock`: the
    one held around the tokenizer's calls, taken only for its first vocabulary read (`_longest_token_bytes`)."""
    return len(caption.encode("utf-8")) // (NFC_SHRINK * _longest_token_bytes(tokenizer, lock))


# tokenizer -> the most UTF-8 bytes a vocabulary entry spells; weak: a tokenizer no longer used is let go
_LONGEST_TOKEN_BYTES: WeakKeyDictionary = WeakKeyDictionary()


def _longest_token_bytes(tokenizer, lock: AbstractContextManager | None = None) -> int:
    """The most UTF-8 bytes a vocabulary entry (added tokens too) spells: the most text one token covers (a
    byte-level entry's mapped characters count 1-2 bytes each: an overestimate, so a lower bound still). Read once
    per tokenizer, under `lock` (the fast tokenizer is not safe to call from two threads at once); once known, no
    lock is taken (before, every sample waited for it behind the other threads' tokenizing). Threads that race on
    the first read: the first reads, the others find its value under the lock."""
    known = _LONGEST_TOKEN_BYTES.get(tokenizer)
    if known is not None:
        return known
    with lock or nullcontext():
        known = _LONGEST_TOKEN_BYTES.get(tokenizer)
        if known is None:
            known = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1) or 1
            _LONGEST_TOKEN_BYTES[tokenizer] = known
    return known


def caption_hopeless(key: str, caption: str, tokenizer, rejects: Callable[[int], Rejected | None],
                     lock: AbstractContextManager | None = None) -> Rejected | None:
    """The encoder's "caption too long" for a caption whose `least_caption_tokens` its length rule
    (`rejects(tokens)`) already refuses: the verdict the tokenized prompt gets (it has at least as many tokens),
    reached before any tokenizing. `lock`: as `least_caption_tokens`'s."""
    least = least_caption_tokens(caption, tokenizer, lock)
    if not least or (refused := rejects(least)) is None:
        return None
    return Rejected(refused.reason, f"the caption is {len(caption.encode('utf-8'))} bytes (not tokenized: at least "
                    f"{least} tokens), past the transformer's text positions next to this sample's images (its RoPE "
                    "table); shorten the caption", key=key)


def unless_rejected(prepare: Callable[[tuple[str, Any]], R]) -> Callable[[tuple[str, Any]], R | Rejected]:
    """`prepare` for read samples; a `Rejected` input (a damaged one) passes through as it is."""
    return lambda item: item[1] if isinstance(item[1], Rejected) else prepare(item)


def quarantine(job: EncodeJob, key: str, reason: str, detail: str = "") -> None:
    """Reject one sample (it stays out of the table); the rows land in quarantine.parquet at `finish`."""
    source = job.images.cells(key, ("source",)).get("source") or f"images/v{job.images.version}/{key}"
    job.quarantine_rows.append({
        "key": key, "source": str(source), "stage": job.summary.stage, "reason": reason, "detail": detail,
        "table_version": f"{job.summary.table}/v{job.summary.version}",
    })
    job.summary.quarantined += 1
    by_reason = job.summary.quarantined_by_reason
    by_reason[reason] = by_reason.get(reason, 0) + 1


def accepted(job: EncodeJob, prepared: Iterable[T | Rejected], bar: "SampleProgress") -> Iterator[T]:
    """Pass prepared samples through; quarantine the rejected ones (they count as done on the bar)."""
    for item in prepared:
        bar.sample_read()
        if isinstance(item, Rejected):
            quarantine(job, item.key, item.reason, item.detail)
            bar.skipped()
            if item.reason == DAMAGED_INPUT:
                _damaged_input(job, item.key, item.detail)
        else:
            yield item


def _damaged_input(job: EncodeJob, key: str, problem: str) -> None:
    """The limit is the table's (`max_damaged_fraction` of every sample), as for one process: a rank stops early
    only when its own count alone is over it; the sum over the ranks is judged by all of them at the end
    (`check_damaged_total`). Judged against a rank's share, damage that sits in one shard (a share is whole
    shards) stopped an encode with more ranks that one process finishes."""
    job.summary.damaged[key] = problem
    n, total = len(job.summary.damaged), max(len(job.images), job.total, 1)
    if n > job.max_damaged_fraction * total:
        raise _over_limit(job, n, total, f" (e.g. {problem})")


def check_damaged_total(job: EncodeJob) -> None:
    """Every rank, after its last shard: the damaged inputs summed over the ranks against the table's limit;
    every rank reaches the same verdict from the same sums (models/collective/: only integers travel)."""
    from models.collective import RankFailed, all_sum

    if job.ranks.world_size <= 1:
        return  # judged as each sample came (`_damaged_input`)
    n, total = all_sum(job.ranks.world_size, [len(job.summary.damaged), 0 if job.ranks.rank else len(job.images)])
    if n > job.max_damaged_fraction * max(total, 1):  # known to every rank alike: nothing to publish
        raise RankFailed(str(_over_limit(job, n, total, f" (listed in {job.store.root / 'quarantine.parquet'})")))


def _over_limit(job: EncodeJob, n: int, total: int, example: str) -> UserError:
    section = job.summary.stage.replace("-", "_")
    return UserError(f"{n} of {total} samples of table 'images' v{job.images.version} in {job.store.root} are "
                     f"damaged, more than {section}.max_damaged_fraction {job.max_damaged_fraction}{example}")


def flush_quarantine(job: EncodeJob) -> None:
    """Rows this table version already quarantined are not repeated (a resumed run retries those samples)."""
    job.store.add_quarantine(job.quarantine_rows)
    job.quarantine_rows = []


def control_count_rejection(variant: str, num_controls: int, key: str) -> Rejected | None:
    """The model-variant rule both encode stages apply, so an Edit (v1) model drops the same samples from the
    `text` and the `vae` table: Edit takes exactly one control image, Edit-Plus any number."""
    if variant == "edit" and num_controls != 1:
        return Rejected("edit model needs exactly one control image",
                        f"sample has {num_controls}; use an Edit-Plus model for 0 or several controls", key=key)
    return None


def placeholder_rejection(caption: str, processor, key: str) -> Rejected | None:
    """A caption holding one of the processor's media placeholder tokens (`<|image_pad|>`, `<|video_pad|>`): the
    stock pipelines' processor counts them against the pictures / videos passed and refuses the prompt, so there
    are no stock features to store. Quarantined, as the stock pipeline would fail at inference on that prompt (encoded
    as text it made features no stock pipeline computes; 2.1's stock call raising stopped the whole run)."""
    from models.qwen21_predict import media_placeholders

    held = media_placeholders(caption, processor)
    if not held:
        return None
    return Rejected("prompt does not fit the template",
                    f"the caption holds {', '.join(held)}, a placeholder the model's processor reserves for a "
                    "picture or video (the stock pipeline refuses such a prompt); remove it from the caption", key=key)


def nonfinite_rejection(key: str, tensors: dict[str, Any], dtype_setting: str) -> Rejected | None:
    """A sample whose features hold NaN or inf (float16 overflowing the encoder, a damaged weight, inf from rounding
    to bf16): quarantined, not stored. Stored, it passed for features until train's first step on it stopped with a
    non-finite loss (hours in, `encode` then up to date), or evaluate reported NaN losses."""
    import torch

    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if not bad:
        return None
    return Rejected("non-finite features", f"{', '.join(bad)} hold NaN or inf, encoded with {dtype_setting}; "
                    "float16 can overflow these encoders: use bfloat16 or float32, or check the model's weights",
                    key=key)
