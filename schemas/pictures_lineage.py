"""The `images` table's per-sample feature lineage: the render settings of its pictures (resize-bucket), whole, or
as one encoder reads them.

An encoder reads only some of the pictures: the VAE reads target.png, control_{i}.png and mask.png, never the VL
views; the text encoder never reads target.png. A change to a setting it does not read (`control_vl_area`,
`target_area`) re-renders the table, but leaves the bytes it reads as they were, so its features are carried
forward rather than encoded again (hours at 1M samples)."""

from __future__ import annotations

from typing import Any

from schemas.config import ResizeConfig
from schemas.lineage import code_version, feature_lineage, hashed_settings

IMAGES_STAGE = "resize-bucket"
# an `images` schema attr: the code versions its pictures' lineages before this revision's fixes were hashed with
# (so an encoder can derive the part it read of those pictures too), aligned with store/reuse.py
# LINEAGE_BEFORE_FIXES_ATTR: one string each in a revision 2 version, lists (oldest first) since revision 3
CODE_BEFORE_FIXES_ATTR = "code_version_before_fixes"

# render settings the VAE encoder does not read: they size or skip the VL views alone (stages/resize/rendering.py
# `_render`: target, control VAE views and mask are sized by target_area / control_vae_area and the bucket rules)
VAE_UNREAD = ("control_vl_area", "vl_views")
# render settings the text encoder does not read, by pipeline family (`models.loading.pipeline_family`): none reads
# target.png; Edit reads control_0.png (the VAE view: control_vae_area), Edit-Plus (2509, 2511) each
# control_{i}_vl.png (control_vl_area), Qwen-Image-2.1 each control_{i}.png (control_vae_area). What the target
# size still decides of a text row - its img_shapes and whether its prompt fits next to them - is taken from the
# images when the row is carried forward (`EncodeJob.prompt_fits`, stages/encode/output.py).
TEXT_UNREAD = {"edit": ("target_area", "control_vl_area", "vl_views"),
               "edit-plus": ("target_area", "control_vae_area"),
               "qwen-image-2.1": ("target_area", "control_vl_area", "vl_views")}


def pictures_lineage(rc: ResizeConfig, code_version: str, unread: tuple[str, ...] = (), as_set: bool = False) -> str:
    """The feature lineage of the pictures resize-bucket renders under `rc` (all of them; or those an encoder
    reads, without the settings in `unread`). `as_set`: as recorded before a setting was hashed only where read
    (control_vl_area without VL views)."""
    render = {k: v for k, v in hashed_settings(rc, "sample", as_set=as_set).items() if k not in unread}
    return feature_lineage(IMAGES_STAGE, render, code_version=code_version)


def earlier_pictures_lineage(rc: ResizeConfig, code_version: str) -> str | None:
    """`pictures_lineage` as recorded before the settings `rc` does not read were hashed as their defaults, where
    that differs (None: the same): pictures made then are these (carried, not rendered again)."""
    earlier = pictures_lineage(rc, code_version, as_set=True)
    return earlier if earlier != pictures_lineage(rc, code_version) else None


def read_lineage(resize: Any, recorded: str | None, code_version: str | None, unread: tuple[str, ...]) -> str | None:
    """The lineage of what an encoder reads of an `images` version, from its recorded settings (schema attrs:
    `resize`, the feature lineage `recorded`, its lineage's code version); None where it cannot be derived (no
    settings recorded, or a feature lineage recorded under another scheme than `pictures_lineage`): the whole
    lineage is used there, as before."""
    if not isinstance(resize, dict) or recorded is None or code_version is None:
        return None
    try:
        rc = ResizeConfig.model_validate(resize)
    except ValueError:  # pydantic's ValidationError: settings of another release
        return None
    # the lineage as hashed now, or as recorded before unread settings were hashed as their defaults
    # (`earlier_pictures_lineage`, which would hash the first again)
    if recorded not in (pictures_lineage(rc, code_version), pictures_lineage(rc, code_version, as_set=True)):
        return None
    return pictures_lineage(rc, code_version, unread)


def other_alpha_lineages(resize: Any, recorded: str | None, code_version: str | None,
                         unread: tuple[str, ...]) -> tuple[str, ...]:
    """The lineages (as an encoder reads them, `unread` left out, and whole) of the pictures of an `images` version
    (`read_lineage`'s arguments) rendered under the other resize.keep_alpha; () where they cannot be derived. An
    opaque picture renders the same bytes under either (features/decode.py `decode_keeping_alpha` gives what
    `decode_image` gives), so features encoded from it under the other value stay current; which pictures had
    transparency the images' conversion notes tell (schemas/fixes.py `transparency_noted`)."""
    if read_lineage(resize, recorded, code_version, ()) is None:
        return ()
    rc = ResizeConfig.model_validate(resize)
    other = rc.model_copy(update={"keep_alpha": not rc.keep_alpha})
    return tuple(dict.fromkeys((pictures_lineage(other, code_version, unread), pictures_lineage(other, code_version))))


def images_code_version(revision: int) -> str:
    """The code version resize-bucket's `revision` records (its pictures' lineage is hashed with it)."""
    return code_version(f"images.{revision}")


def images_revision(code: str) -> int | None:
    """The resize-bucket revision of a recorded code version; None: not one this code wrote."""
    head, _, tail = code.rpartition("+images.")
    return int(tail) if head and tail.isdigit() and images_code_version(int(tail)) == code else None


def recorded_before_fixes(lineages: Any, codes: Any) -> list[tuple[str, str]]:
    """(code version, pictures' feature lineage) of each earlier revision an `images` version records as current
    but for what a fix made since changes (the two attrs above), oldest first. A revision 2 version recorded one,
    as two strings; none where nothing (or something unreadable) is recorded."""
    if isinstance(lineages, str) and isinstance(codes, str):
        return [(codes, lineages)]
    if isinstance(lineages, list) and isinstance(codes, list) and len(lineages) == len(codes) and \
            all(isinstance(v, str) for v in (*lineages, *codes)):
        return list(zip(codes, lineages))
    return []
