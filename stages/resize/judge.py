"""The checks of a source sample that need no decoding: the reader's problems, its caption, its control count and
its content key, a duplicate of a key met before (docs/resize-bucket.md, 'Quarantine')."""

from __future__ import annotations

from schemas.config import ResizeConfig
from schemas.errors import Rejected
from stages.resize.caption_text import CAPTION_TOO_LONG, caption_too_long, clean_caption, not_utf8
from stages.resize.images_table import sample_key
from stages.resize.sources import SourceSample


def judge(rec: SourceSample, rc: ResizeConfig, first_source: dict[str, str]) -> tuple[str, str]:
    """Checks that need no decoding: reader problems, caption, control count, duplicate content."""
    if rec.problem is not None:
        raise Rejected(rec.problem_kind, rec.problem)
    assert rec.target is not None
    if rec.caption is None:
        raise Rejected("missing-caption", "no caption (.txt / caption field) for this sample")
    _check_caption_size(rec, rc)
    try:
        caption = clean_caption(rec.caption)
    except UnicodeDecodeError as e:
        raise Rejected("caption-not-utf8", not_utf8(rec.caption, e)) from None
    if not caption:
        raise Rejected("empty-caption", "caption is empty, or whitespace or control characters only")
    n = len(rec.controls)
    key = sample_key(rec.target, rec.controls, caption)  # before the count check: its row names the key, so its
    # would-be split is known (`run all`'s val check tells a val split emptied by this quarantine from the hash's)
    _check_count(n, rc, key)
    claim(key, rec.source, first_source)
    return key, caption


def judge_known(rec: SourceSample, rc: ResizeConfig, first_source: dict[str, str]) -> str:
    """`judge` of a sample found with its recorded key (its caption checked against the recorded one)."""
    _check_caption_size(rec, rc)  # a folder's or JSONL line's caption, read again (a tar's: known_tars.py)
    _check_count(rec.known.controls, rc, rec.known.key)
    claim(rec.known.key, rec.source, first_source)
    return rec.known.key


def _check_caption_size(rec: SourceSample, rc: ResizeConfig) -> None:
    """A caption read over resize.max_caption_bytes (a JSONL field, a parquet cell: read with their line or row;
    a folder's file and a tar's member are refused from their size, unread, by the readers)."""
    if rec.caption is not None and len(rec.caption) > rc.max_caption_bytes:
        raise Rejected(CAPTION_TOO_LONG, caption_too_long("", len(rec.caption), rc.max_caption_bytes))


def _check_count(n: int, rc: ResizeConfig, key: str) -> None:
    if not rc.min_controls <= n <= rc.max_controls:
        raise Rejected(
            "control-count", f"{n} control image(s), outside resize.min_controls..max_controls = {rc.min_controls}..{rc.max_controls}",
            key=key,
        )


def claim(key: str, source: str, first_source: dict[str, str]) -> None:
    """The first copy of a content key; a later one is a duplicate."""
    if key in first_source:
        raise Rejected("duplicate", f"same content (target, controls, caption) as {first_source[key]}", key=key)
    first_source[key] = source
