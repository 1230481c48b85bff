"""Which `images` version the `text` and `vae` tables were encoded from, checked where train and evaluate open
them (features/open.py). A table encoded from an older `images` version than the current one (resize-bucket rerun,
its encoder not) is said in one warning line naming the command that brings it up to date. Two tables encoded from
different `images` versions are refused when those versions render differently what both encoders read of a
sample (same key = same source bytes and caption, docs/store-format.md): its prompt embeddings and its latents
would come from two different renders of it. Settings only one encoder reads (`schemas/pictures_lineage.py`) may
differ: the pair is then what one resize-bucket run with both tables' settings would give.

The verdict is read from the two versions' immutable schema.json files only, so every rank that opened the same
versions (train checks they did: models/same_versions.py) decides alike."""

from __future__ import annotations

import logging
import os
from typing import Any

from features.tables import PRODUCER
from schemas.errors import UserError

log = logging.getLogger("store")

# (store, table versions, current images) this process has warned about: train's up-to-date check, its start and its
# validator open the same tables, one line is enough
_SAID: set[tuple[str, tuple, int | None]] = set()


def check_images_versions(st, readers: dict[str, Any], section: str) -> None:
    """UserError when `text` and `vae` (their open readers) were encoded from `images` versions that differ in a
    picture both encoders read; a warning line when either was encoded from an `images` version that is not the
    current one (or the two from different ones whose pictures cannot be compared)."""
    up = {t: _version(r.schema.lineage.upstream.get("images")) for t, r in readers.items()}
    current = st.tables().get("images")
    text_v, vae_v = up.get("text"), up.get("vae")
    differences: list[str] | None = []
    if text_v is not None and vae_v is not None and text_v != vae_v:
        differences = shared_differences(st, min(text_v, vae_v), max(text_v, vae_v), readers["text"].schema)
        if differences:
            run = _commands(up, current)
            raise UserError(
                f"store {st.root}: table 'text' v{readers['text'].version} was encoded from images v{text_v} and "
                f"table 'vae' v{readers['vae'].version} from images v{vae_v}, which render the same samples "
                f"differently in pictures both encoders read ({'; '.join(differences)}): each sample's prompt "
                f"embeddings and latents would come from two different renders of it, so {section} does not read them "
                f"together; "
                f"run {run} to encode both from images v{current if current is not None else max(text_v, vae_v)} "
                "(samples whose pictures did not change are carried forward, not encoded again)")
    stale = {t: v for t, v in up.items() if v is not None and current is not None and v != current}
    said = (str(st.root), tuple(sorted((t, r.version) for t, r in readers.items())), current)
    if (not stale and differences is not None) or said in _SAID:
        return
    if os.environ.get("RANK", "0") != "0":  # every rank reads the same immutable schemas: rank 0's line says it
        return
    _SAID.add(said)
    parts = []
    if stale:
        parts.append(" and ".join(f"table '{t}' v{readers[t].version} was encoded from images v{v}"
                                  for t, v in sorted(stale.items()))
                     + f", but images v{current} is current ({_since(st, sorted(set(stale.values())))}): {section} "
                     f"reads features of the older images; run {_commands(up, current)} to encode them from images "
                     f"v{current}")
    if differences is None:
        parts.append(f"text and vae were encoded from images v{text_v} and v{vae_v}, whose render settings are not "
                     "recorded in a form that can be compared: whether each sample's text and latents come from "
                     "the same pictures cannot be checked")
    line = f"{section}: store {st.root}: " + "; ".join(parts)
    log.warning("%s", line)


def _since(st, olds: list[int]) -> str:
    """What made the `images` versions `olds` not current: a repair that replaced them (the damaged version it set
    aside as `v<N>.damaged/`, store/repair.py `set_aside`) or a rerun of resize-bucket."""
    from store import format as fmt

    aside = [v for v in olds if st.version_dir("images", v).with_name(f"v{v}{fmt.SET_ASIDE_SUFFIX}").is_dir()]
    said = [f"a repair replaced the damaged images {' and '.join(f'v{v}' for v in aside)}, set aside as "
            + " and ".join(f"v{v}{fmt.SET_ASIDE_SUFFIX}/" for v in aside)] if aside else []
    if len(aside) < len(olds):
        said.insert(0, "resize-bucket has run since")
    return ", and ".join(said)


def encoded_from_replaced(root, replaced: set[int]) -> str | None:
    """After `store repair` replaced the `images` versions `replaced` (set aside): the line naming the encoders to
    rerun where the current `text`/`vae` table was encoded from one of them, else None. Nothing else brings those
    tables to the repaired images: evaluate reads its pictures from the version they name, no longer in the list."""
    from store.manifest_files import read_schema
    from store.store import Store

    if not replaced:
        return None
    st = Store(root, create=False)
    tables = st.tables()
    current, up = tables.get("images"), {}
    for t in ("text", "vae"):
        try:
            v = _version(read_schema(st.version_dir(t, tables[t])).lineage.upstream.get("images"))
        except Exception:  # noqa: BLE001 - no such table, or its schema unreadable (the repair said so)
            continue
        if v in replaced:
            up[t] = v
    if not up or current is None:
        return None
    named = " and ".join(f"table '{t}' v{tables[t]}" for t in sorted(up))
    return (f"{named} {'were' if len(up) > 1 else 'was'} encoded from images "
            f"{' and '.join(f'v{v}' for v in sorted(set(up.values())))}, which this repair replaced by v{current}: "
            f"run {_commands(up, current)} to encode from images v{current} (samples whose pictures did not change "
            "are carried forward, not encoded again); until then evaluate cannot read their pictures")


def shared_differences(st, a: int, b: int, text_schema) -> list[str] | None:
    """The render settings (and image feature revision) in which `images` versions `a` and `b` differ among those
    both encoders read: [] when none, None when the versions' records cannot tell (missing, or settings not
    recorded under `schemas.pictures_lineage`'s scheme). `text_schema`: the `text` table's, whose encoder's
    family decides what it read."""
    from schemas.config import ResizeConfig
    from schemas.lineage import hashed_settings
    from schemas.pictures_lineage import read_lineage
    from store.manifest_files import read_schema
    from store.reuse import FEATURE_LINEAGE_ATTR

    unread = _unread_by_either(text_schema)
    records = []
    for v in (a, b):
        try:
            schema = read_schema(st.version_dir("images", v))
        except Exception:  # gone (gc'd, not in this node's cache) or damaged: nothing to compare with
            return None
        resize, whole = schema.attrs.get("resize"), schema.attrs.get(FEATURE_LINEAGE_ATTR)
        records.append((resize, whole, schema.lineage.code_version))
    (ra, wa, ca), (rb, wb, cb) = records
    if wa is not None and wa == wb:  # the same render of every picture
        return []
    la, lb = (read_lineage(r, w, c, unread) for r, w, c in records)
    if la is None or lb is None:
        return None
    if la == lb:
        return []
    sa, sb = (hashed_settings(ResizeConfig.model_validate(r), "sample") for r in (ra, rb))
    out = [f"resize.{k} {sa.get(k)} in images v{a}, {sb.get(k)} in v{b}" for k in sorted(set(sa) | set(sb))
           if k not in unread and sa.get(k) != sb.get(k)]
    if ca != cb:
        out.append(f"code version {ca} in images v{a}, {cb} in v{b}")
    return out or ["their pictures' feature lineage"]


def _unread_by_either(text_schema) -> tuple[str, ...]:
    """Render settings one of the two encoders does not read: the text encoder's by the family its table records
    (`attrs.prompt_format.variant`, what it was encoded for); for a table that records none, those no family's
    text encoder reads (comparing more, not less)."""
    from schemas.pictures_lineage import TEXT_UNREAD, VAE_UNREAD

    prompt_format = text_schema.attrs.get("prompt_format")
    variant = prompt_format.get("variant") if isinstance(prompt_format, dict) else None
    text_unread = TEXT_UNREAD.get(variant) or set.intersection(*(set(u) for u in TEXT_UNREAD.values()))
    return tuple(sorted(set(text_unread) | set(VAE_UNREAD)))


def _commands(up: dict[str, int | None], current: int | None) -> str:
    """`pipeline run <encoder>` for each table not encoded from the current images (from the older one: both)."""
    behind = [t for t in ("text", "vae") if up.get(t) is not None and up[t] != current] if current is not None else []
    if not behind:  # no current images version known: the one on the older images
        behind = [min(("text", "vae"), key=lambda t: up.get(t) or 0)]
    return " and ".join(f"`pipeline run {PRODUCER[t]}`" for t in behind)


def _version(v: Any) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None
