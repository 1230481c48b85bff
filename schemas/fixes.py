"""Corrections made after tables existed, and which stored samples each one changes (decided from the metadata
stored with the sample, so a rerun recomputes exactly those and carries the rest forward).

A fix bumps its stage's feature revision (`code_version`); the feature lineage under the revision before it is
still accepted for a sample the fix leaves unchanged (store/reuse.py `reusable(..., changed=...)`). Each
predicate below answers "does the fix change this stored sample?" and errs towards yes when the metadata cannot
tell (a sample recomputed needlessly costs time; one reused wrongly is a silently wrong feature). A predicate
is asked once per distinct value of the columns declared with it (stages/encode/plan.py `Fixes.reads`,
stages/resize/images_table.py `FIXES`; store/row_rule.py), never per row: it reads those columns only (not the key).
"""

from __future__ import annotations

import re
from typing import Any, Sequence, TypeVar

Rule = TypeVar("Rule")

# resize-bucket before the EXIF mask fix (e532fe5): a mask drawn on an EXIF-rotated (5..8) target's stored pixels
# was resized across the other axis instead of turned. Such a sample's old row holds both notes below; a row
# with both is re-rendered (a superset: the EXIF note may also come from a control or the mask).
_ROTATED_90 = re.compile(r"EXIF orientation [5-8] applied")
MASK_RESIZED = "mask resized to its target"
MASK_TURNED = "mask turned as its target"  # the fixed code's note (prefix; the orientation follows)
# features/decode.py's note for an RGB/L/1/16-bit grey picture whose one transparent colour (a PNG's tRNS chunk)
# it takes as alpha since resize-bucket revision 4 (images.4); before, those pixels kept their stored colour
TRANSPARENT_COLOUR = "transparent colour as alpha"
# resize.keep_alpha kept this sample's picture as RGBA (features/decode.py's note)
KEPT_ALPHA = "kept with its alpha"
# resize.keep_alpha off: a picture's alpha or transparent colour composited over white (features/decode.py's notes
# end so; a mask's, composited over black, does not)
OVER_WHITE = "composited over white"
# resize-bucket before revision 3 (18eac2c, 7016b9b): a mask of another aspect than its target was stretched onto
# it (now bad-mask: quarantined, or the sample's next copy with a fitting mask kept instead), and a copy kept
# instead of its rejected first copy was stored with caption ''. Such a copy's row says so since (this note).
KEPT_INSTEAD = "kept instead of its first copy, which the rendering rejected"
# a caption stored before revision 3 that it cleans (stages/resize/caption_text.py: every Cc character but tab and
# newline, CR included), as an RE2 pattern matched over a whole column
UNCLEANED_CAPTION = r"[\x00-\x08\x0b-\x1f\x7f-\x9f]"


# A stage's fixes: (the revision a fix was made after, its rule: which stored samples it changes), oldest first
# (resize-bucket's `FIXES`; an encoder's own and the images' ones, stages/encode/plan.py `Fixes`). A table of
# revision r is carried forward but for the samples a fix made since r changes, however many revisions behind.
def made_since(fixes: Sequence[tuple[int, Rule]], revision: int | None) -> list[Rule]:
    """The rules of the fixes made since `revision` (None: none; 0: every one)."""
    return [] if revision is None else [rule for r, rule in fixes if r >= revision]


def revisions_before(fixes: Sequence[tuple[int, Any]], current: int) -> list[int]:
    """The earlier revisions whose tables stay current but for what a fix made since changes (oldest first)."""
    return [r for r, _ in fixes if r < current]


def _notes(meta: dict[str, Any]) -> list[str] | None:
    notes = meta.get("conversions")
    return None if notes is None else [str(n) for n in notes]


def mask_orientation_changes(old_images_row: dict[str, Any]) -> bool:
    """An `images` row rendered before the EXIF mask fix that the fix may render differently."""
    if not old_images_row.get("has_mask"):
        return False
    notes = _notes(old_images_row)
    if notes is None:  # a table from before the conversions column: cannot tell
        return True
    return MASK_RESIZED in notes and any(_ROTATED_90.fullmatch(n) for n in notes)


def mask_may_misfit(old_images_row: dict[str, Any]) -> bool:
    """An `images` row rendered before revision 3 whose mask may be of another aspect than its target (now
    bad-mask): every mask that was resized (its size was not its target's; the rows record no mask size, so a
    superset: a resized mask of its target's aspect renders the same bytes again)."""
    if not old_images_row.get("has_mask"):
        return False
    notes = _notes(old_images_row)
    return notes is None or MASK_RESIZED in notes


def was_kept_instead(images_row: dict[str, Any]) -> bool:
    """An `images` row of a copy kept instead of its rejected first copy (revision 3 on): stored before with
    caption '' (its instruction, so its text features, changed), or in place of a mask now refused (its mask:
    encode-vae compares every carried row's `mask_sha256` with the images row's, so needs no rule for it)."""
    return KEPT_INSTEAD in (_notes(images_row) or ())


def prompt_was_emptied(images_row: dict[str, Any], stored_row: dict[str, Any]) -> bool:
    """A text row of a copy kept instead (`was_kept_instead`) encoded from the caption '' revision 2 stored it
    with: its prompt is then the empty prompt with the same pictures, so of the empty prompt's length (`length` ==
    `empty_length`; any caption adds a token). A row of the same key whose first copy revision 2 kept (its mask
    refused now) was encoded from the caption it has now: carried. A row recording no lengths: yes."""
    if not was_kept_instead(images_row):
        return False
    length, empty = stored_row.get("length"), stored_row.get("empty_length")
    return length is None or empty is None or int(length) == int(empty)


def took_transparent_colour(images_row: dict[str, Any]) -> bool:
    """An `images` row one of whose pictures had a transparent colour that revision 4 takes as alpha (its pixels,
    so its latents and the VLM's view of it, changed; the note names no picture: the text of a sample whose target
    alone had one is encoded again too)."""
    return any(TRANSPARENT_COLOUR in n for n in _notes(images_row) or ())


def mask_was_turned(images_row: dict[str, Any]) -> bool:
    """An `images` row the EXIF mask fix rendered differently (its mask, so its mask weights, changed)."""
    return any(n.startswith(MASK_TURNED) for n in _notes(images_row) or ())


def has_alpha_picture(images_row: dict[str, Any]) -> bool:
    """An `images` row holding an RGBA picture (resize.keep_alpha): an Edit/Edit-Plus encoder read it as black
    where transparent before the RGBA fix (f6aa89f), over white since. A row without the conversions column
    predates keep_alpha, so holds none."""
    return any(KEPT_ALPHA in n for n in _notes(images_row) or ())


def alpha_flattened(images_row: dict[str, Any]) -> bool:
    """An `images` row one of whose pictures had transparency that resize-bucket composited over white
    (resize.keep_alpha off): a Qwen-Image-2.1 VAE, which reads RGBA, sees it opaque."""
    return any(n.endswith(OVER_WHITE) for n in _notes(images_row) or ())


def transparency_noted(images_row: dict[str, Any]) -> bool:
    """An `images` row one of whose pictures had transparency (kept as RGBA, or composited over white: what
    resize.keep_alpha decides), or that records no notes (cannot tell). Any other row renders the same bytes under
    either keep_alpha."""
    return _notes(images_row) is None or has_alpha_picture(images_row) or alpha_flattened(images_row)
