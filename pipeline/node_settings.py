"""The same settings on every rank of a launch. Each node reads --config and --set itself, so a config file at the
same path with other contents on one node passed every read check, and its settings then held on that node
alone: a fingerprinted setting was refused later (train, evaluate, encode compare their fingerprints), but one
outside the fingerprints (train.checkpoint_every, validate_every, max_steps under a constant rate, on_damaged,
evaluate.batch_size, ...) had the ranks wait in different collectives or decide differently, saying nothing.

At the start of a command whose ranks share their work, every rank's effective settings are compared before
any process group exists (`models.collective.gather_before_group`): a digest each, then, only when they differ,
the settings themselves, so the one line names the first differing rank and key. Left out: what names a node's
own mounts and hardware (`paths.*`, devices), which may differ between nodes; what those hold is checked where it
is read (the model's fingerprint, the tables' versions)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from schemas.config import PipelineConfig

WHAT = "the settings"
NODE_OWN_KEYS = ("device", "devices")  # a section's devices: each node names its own


def shared_settings(cfg: PipelineConfig) -> dict[str, str]:
    """Every setting but a node's own, by dotted key in the config's order, as JSON text."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            out[prefix] = json.dumps(value, sort_keys=True)

    for section, values in cfg.model_dump(mode="json").items():
        if section != "paths":
            walk(section, {k: v for k, v in values.items() if k not in NODE_OWN_KEYS})
    return out


def refuse_differing_settings(world: int, cfg: PipelineConfig) -> None:
    """Every rank's `shared_settings` are rank 0's, or every rank raises the same `UserError` naming the first
    rank that differs and its first differing key. Called by every rank of the launch (one process: nothing)."""
    from models.collective import RankFailed, gather_before_group

    if world <= 1:
        return
    mine = shared_settings(cfg)
    text = json.dumps(mine)
    digests = gather_before_group(world, WHAT, hashlib.sha256(text.encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    # every rank takes this branch; the refusal is recorded before the exchange's last wait (`ending`): under
    # torchrun a SIGTERM there (another worker of the node ended on it first) ends this rank with it too
    ranks = _parsed(gather_before_group(world, WHAT, text, ending=lambda texts: _differing(_parsed(texts))))
    # taken by every rank from the same data (nothing to publish): ends the ranks' watch for failures too
    raise RankFailed(_differing(ranks))


def _parsed(texts: list[str]) -> list[dict[str, str]]:
    return [json.loads(t) for t in texts]


def _differing(ranks: list[dict[str, str]]) -> str:
    """The line naming the first rank whose settings differ from rank 0's, and its first differing key."""
    rank = next(r for r in range(1, len(ranks)) if ranks[r] != ranks[0])
    theirs, first = ranks[rank], ranks[0]
    key = next(k for k in [*first, *theirs] if first.get(k) != theirs.get(k))
    return (f"the ranks do not run with the same settings: rank {rank}'s {key} is {_shown(theirs.get(key))}, "
            f"rank 0's {_shown(first.get(key))} (each node reads --config and --set itself, and the nodes' "
            "copies of the config or their flags differ); use one config and the same flags on every node")


def _shown(value: str | None) -> str:
    if value is None:
        return "unset"
    return value if len(value) <= 60 else value[:57] + "..."
