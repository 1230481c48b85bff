"""The encode sections' settings: the features hash (declared lineage scheme, plus the hashes written before it),
CLI overrides, and `dtype: auto` resolved to what it means on the device."""

from __future__ import annotations

from typing import Any, TypeVar

from schemas.config import Section
from schemas.lineage import hashed_settings, serving_variants, settings_hash
from stages.encode.ranks import Ranks, current_ranks, rank_device

S = TypeVar("S", bound=Section)

# Device spellings a table hashed before the declared lineage scheme (which held `device`) may have been encoded
# with: with the one configured now, the old hashes tried so that those tables stay current and their samples reusable.
_EARLIER_DEVICES = ("cpu", "cuda", "mps", *(f"cuda:{i}" for i in range(8)))


def resolve_precision(section: S, device: str, stage: str, world: int = 1) -> S:
    """The section with `dtype: auto` replaced by what it means on `device` (printed): the lineage hash and
    the table's recorded config then name the precision that produced the features. With several ranks
    (`world`) one decision of all (`models.precision.agreed_precision`, a collective: every rank calls it): one
    table's rows from one precision, the one its lineage records (the line says why where the ranks differed)."""
    from tqdm.auto import tqdm

    from models.precision import agreed_precision, auto_note, resolve_precision as resolve

    key = f"{stage.replace('-', '_')}.dtype"
    precision = agreed_precision(lambda: resolve(section.dtype, device, what=key), world, key)
    tqdm.write(precision.describe(stage, device, auto_note(section.device)))
    return with_overrides(section, dtype=precision.weights)


def placed(section: S, stage: str, ranks: Ranks | None) -> tuple[S, Ranks, str]:
    """What an encode stage settles before it opens its job, as (section, ranks, device): this process's ranks
    (`ranks`, else the launch's), its device, and the section with `dtype: auto` resolved on that device (a
    collective with several ranks). A bad device is told as `stage`'s setting (encode-text: encode_text.device)."""
    what = f"{stage.replace('-', '_')}.device"
    ranks = ranks or current_ranks(section.device, what)
    target = rank_device(section.device, ranks, what)
    return resolve_precision(section, target, stage, ranks.world_size), ranks, target


# schema attr: the settings a version was encoded with (`settings_record`), so that a later run with others can
# name what differs (`stages.encode.plan`'s new-version line); versions encoded before it was recorded have none
SETTINGS_ATTR = "settings"


def settings_record(section: Section, **extra: Any) -> dict[str, Any]:
    """The settings that determine features (declared in schemas/config.py, derived by schemas.lineage), plus
    whatever else the stage passes (e.g. the effective prompt template): what `config_hash` hashes."""
    return {"section": hashed_settings(section), **extra}


def config_hash(section: Section, **extra: Any) -> str:
    """Fingerprint of `settings_record`."""
    return settings_hash(settings_record(section, **extra))


def earlier_config_hashes(section: Section, **extra: Any) -> tuple[str, ...]:
    """`config_hash` as written before the declared scheme, when it also hashed `device`: the configured device
    first, then the usual spellings. Tables encoded then are still current, and their samples reused."""
    settings = hashed_settings(section)
    devices = [section.model_dump(mode="json")["device"], *_EARLIER_DEVICES]
    hashes = (settings_hash({"section": {**settings, "device": d}, **extra}) for d in devices)
    return tuple(dict.fromkeys(hashes))


def serving_config_hashes(section: Section, earlier: bool = False, **extra: Any) -> tuple[str, ...]:
    """`config_hash` of each setting whose tables serve this section's run (`schemas.lineage.serving_variants`:
    they only add columns, e.g. encode_text.no_control_embeds true for a run with it false), and with `earlier`
    their `earlier_config_hashes` too: a complete version of one of them is up to date."""
    hashes = [h for s in serving_variants(section)
              for h in (config_hash(s, **extra), *(earlier_config_hashes(s, **extra) if earlier else ()))]
    return tuple(dict.fromkeys(hashes))


def with_overrides(section: S, **overrides: Any) -> S:
    """The stage's config section with the CLI/keyword overrides that are not None, validated again."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return type(section).model_validate({**section.model_dump(), **given})
