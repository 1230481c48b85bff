"""Which split, 'train' or 'val', resize-bucket puts a sample in: the one rule every reader of a split uses.

A hash decides it, deterministic across runs and tables. Of what is `resize.split_by`, recorded per `images`
version in its schema attrs (`split_by`):

  pictures  the target and controls alone (their file sha256s, the `source_hashes` column): a pair listed under
            several captions lands in one split, so the held-out loss never scores pictures trained on.
  key       the sample key (target + controls + caption): the rule of every store made before the record.
            Such a pair lands in both splits (the summary's `val: N of M val samples have the target ...`).

Unset (None), the rule is the store's: that of its current `images` version (`key` where it records none), and
`pictures` for a new store. A store's samples never move between splits unless the user sets the rule."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from store import Store

ATTR = "split_by"  # the images schema attr recording the rule a version was split by
RULES = ("pictures", "key")
BEFORE_RECORD = "key"  # a version that records no rule was split by key
FOR_NEW_STORE = "pictures"


def pictures_id(source_hashes: Iterable[str]) -> str:
    """The identity of a sample's pictures: a hash of its target's and controls' sha256s, in order (each 64 hex
    chars, so their concatenation is unambiguous)."""
    return hashlib.sha256("".join(source_hashes).encode("ascii")).hexdigest()[:32]


def split_for(key: str, pictures: str | None, val_fraction: float, rule: str) -> str:
    """'val' with probability `val_fraction`, by a hash of the pictures (`pictures_id`) or of the key (`rule`)."""
    if rule not in RULES:
        raise ValueError(f"unknown split rule {rule!r}")
    of = key if rule == "key" else pictures
    if of is None:
        raise ValueError("the pictures rule needs the pictures' identity")
    return "val" if int(of[:8], 16) / 2**32 < val_fraction else "train"


def recorded_rule(attrs: dict[str, Any]) -> str:
    """The rule an `images` version was split by, from its schema attrs."""
    rule = attrs.get(ATTR)
    return rule if rule in RULES else BEFORE_RECORD


def store_rule(st: Store, table: str = "images") -> str | None:
    """The rule of the store's current `images` version; None: it has none. Its schema.json unreadable, refused in
    one line: an older version's rule may be another, and guessing it would move samples between the splits."""
    from schemas.errors import UserError
    from schemas.newer import WrittenByNewer
    from store import format as fmt
    from store import integrity
    from store.manifest_files import checked_schema

    current = st.tables().get(table)
    if current is None:
        return None
    try:  # checked: a flipped bit in a schema.json that still parses would name another rule
        return recorded_rule(checked_schema(st.version_dir(table, current)).attrs)
    except WrittenByNewer:
        raise
    except (UserError, OSError, ValueError) as e:
        older = st.newest_complete(table)
        hint = "" if older is None or older[0] == current else \
            f"; v{older[0]}, the newest that reads, was split by {recorded_rule(older[1].attrs)}"
        # the damage's own advice (rerun the stage) is left out: that rerun is this one, which needs the rule
        vdir = st.version_dir(table, current)
        what = str(e)
        for name in (fmt.SCHEMA_JSON, fmt.CHECKSUMS):
            what = what.removesuffix(f"; {integrity.repair_hint(vdir, name)}")
        what = what.removeprefix(f"{integrity.where(vdir)}: ")
        if str(vdir) not in what:  # "schema.json is damaged (...)": the file named whole, as other causes name it
            what = f"{vdir / fmt.SCHEMA_JSON}: {what}"
        raise UserError(f"{what}: table '{table}' v{current}'s {fmt.SCHEMA_JSON} records the train/val split rule a "
                        "rerun keeps; rerun `pipeline run resize-bucket` with --set resize.split_by=pictures or =key, "
                        f"the rule it was made with (it writes a new version){hint}") from None


def rule_in_force(st: Store, split_by: str | None) -> str:
    """`resize.split_by` where set, else the store's rule, else (a new store) `pictures`."""
    return split_by or store_rule(st) or FOR_NEW_STORE
