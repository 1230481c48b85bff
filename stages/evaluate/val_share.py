"""`evaluate --all-checkpoints` under a launcher: each rank reads only the val samples whose held-out loss it
computes. Before, every rank read every val sample (up to `evaluate.max_loss_samples`, 256 by default) and kept
them in memory to compute 1/world of them: world x the store reads and the host memory of the whole set per rank.

The samples are the ones one process takes (`features.damaged.read_intact`: the first n intact rows in row
order): rank r reads the candidate rows r, r + world, ...; the damaged ones are agreed on by all ranks (a max
all-reduce of flags) and replaced by the next rows, round by round, so every rank holds the same list. Rows a
rank does not read are outlines: key, img_shapes (the manifest's) and the edit mask, sent by the rank that read
it (an all-reduce of the float32 values in float64: exact). That is all the report needs of them; rank 0 reads
the few val samples it pictures in full before generating them (`complete`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from models.sample import TrainSample, from_features


@dataclass
class Share:
    samples: list[TrainSample]  # every val sample: full where this rank read it, else its outline
    mine: list[int]  # positions in `samples` this rank read (its share of every loss pass)
    rows: list[int]  # each sample's row in the joined tables


def loss_sample_count(cfg, tables) -> int:
    """How many val samples the loss passes read: the first `evaluate.max_loss_samples`, all when unset."""
    return min(len(tables), cfg.max_loss_samples) if cfg.max_loss_samples else len(tables)




def loss_keys(cfg, tables) -> list[str]:
    """The keys of the val samples the loss passes read when none is found damaged (`loss_sample_count`): the
    loss array's sample axis, known before a sample is read (the up-to-date check's line)."""
    return [str(tables.keys[i]) for i in range(loss_sample_count(cfg, tables))]


def read_share(cfg, store: str | Path, model: str, ranks):
    """(tables, Share): this rank's share of the val split's first `max_loss_samples` intact samples, the
    others as outlines. evaluate.on_damaged=skip: a damaged one is left out on every rank (recorded in
    `tables.damaged`: the reading rank's line, on the others a line naming that rank) and the next row taken;
    the limit `max_damaged_fraction` judged as one process judges it. "stop": the reading rank's line stops
    every rank."""
    from features.open import open_configured
    from models.same_versions import check_same_versions
    from models.loading import model_files

    from models.collective import together

    with together(ranks.world, "open the val split"):
        tables = open_configured(cfg, "evaluate", store, model, model_files(model), "val")
    try:
        check_same_versions(ranks.world, tables.versions(), tables.store_root, "evaluate")
        return tables, _read(tables, cfg, ranks)
    except BaseException:
        tables.close()
        raise


def _read(tables, cfg, ranks) -> Share:
    from features.damaged import check_some_intact, limit_message, over_limit
    from models.collective import together
    from schemas.errors import UserError
    from store.integrity import DamagedData

    n = loss_sample_count(cfg, tables)

    def ours(row: int) -> bool:
        return row % ranks.world == ranks.rank

    tables.check_ahead(lambda: (r for r in range(len(tables)) if ours(r)))  # only the rows this rank reads
    rows: list[int] = []
    loaded: dict[int, TrainSample] = {}
    tried = 0
    try:
        with tqdm(total=n, desc="read val samples (this rank's share)", unit="sample", leave=False,
                  disable=not ranks.main) as bar:
            while len(rows) < n and tried < len(tables):
                candidates = list(range(tried, min(len(tables), tried + n - len(rows))))
                damaged = [0] * len(candidates)
                with together(ranks.world, "read the val samples"):
                    for j, r in enumerate(candidates):
                        if not ours(r):
                            continue
                        try:
                            loaded[r] = from_features(*tables.features_at(r))
                        except DamagedData as e:
                            if tables.on_damaged != "skip":
                                raise
                            tables.damaged[tables.keys[r]] = " ".join(str(e).splitlines())
                            damaged[j] = 1
                damaged = ranks.any(damaged)
                for r, bad in zip(candidates, damaged):
                    if bad:
                        tables.damaged.setdefault(tables.keys[r], f"damaged (met by rank {r % ranks.world}, "
                                                                  "whose output names the problem)")
                    else:
                        rows.append(r)
                bar.update(len(candidates) - sum(damaged))
                tried = candidates[-1] + 1
    finally:
        tables.stop_check_ahead()
    count = len(tables.damaged)  # the same keys on every rank
    if count and over_limit(count, tried, len(tables), tables.max_damaged_fraction):
        keys = sorted(tables.damaged)
        listed = ", ".join(keys[:5]) + (f" ... ({count} in all)" if count > 5 else "")
        raise UserError(limit_message(count, tried, len(tables), tables.max_damaged_fraction, tables.section,
                                      tables.split, tables.store_root, listed))
    check_some_intact(len(rows), tables)  # the same rows on every rank: all refuse alike
    mine = [i for i, r in enumerate(rows) if ours(r)]
    samples = [loaded.pop(r) if ours(r) else _outline(tables, r) for r in rows]
    _share_masks(samples, mine, ranks)
    return Share(samples, mine, rows)


def _outline(tables, row: int) -> TrainSample:
    """What the report needs of a sample another rank read: its key and img_shapes (the mask follows)."""
    empty = torch.empty(0)
    shapes = [tuple(int(x) for x in s) for s in tables.vae.img_shapes_at(int(tables.rows["vae"][row]))]
    return TrainSample(key=tables.keys[row], target=empty, controls=[], prompt_embeds=empty, empty_embeds=empty,
                       img_shapes=shapes)


def _share_masks(samples: list[TrainSample], mine: list[int], ranks, chunk: int = 256) -> None:
    """Each read edit mask ([target tokens] float32) onto the outlines of the other ranks: summed as float64
    (exact), one all-reduce of [chunk samples, most target tokens] per `chunk` samples (a bounded buffer whatever
    max_loss_samples is); none when no sample has a mask."""
    n, owned = len(samples), set(mine)
    has = ranks.any([int(i in owned and samples[i].mask_weight is not None) for i in range(n)])
    if not any(has):
        return
    width = max(samples[i].target_tokens for i in range(n) if has[i])
    for start in range(0, n, chunk):
        span = range(start, min(n, start + chunk))
        if not any(has[i] for i in span):  # the same on every rank: all skip it together
            continue
        ours = [i for i in span if i in owned]
        part = np.zeros((len(ours), width))
        for j, i in enumerate(ours):
            if has[i]:
                part[j, : samples[i].mask_weight.numel()] = samples[i].mask_weight.double().numpy()
        full = ranks.full_grid(part, [i - start for i in ours], len(span))
        for i in span:
            if has[i] and i not in owned:
                samples[i].mask_weight = torch.from_numpy(full[i - start, : samples[i].target_tokens]).float()


def outline(sample: TrainSample) -> TrainSample:
    """What the report needs of a sample read in full: key, img_shapes and edit mask (the features are read
    again where they are needed: `reader`). The mask is copied: as read it is a view of the sample's whole
    buffer (float32 stored, `.float()` copies nothing), which it would keep alive, latents and all."""
    empty = torch.empty(0)
    mask = None if sample.mask_weight is None else sample.mask_weight.clone()
    return TrainSample(key=sample.key, target=empty, controls=[], prompt_embeds=empty, empty_embeds=empty,
                       img_shapes=sample.img_shapes, mask_weight=mask)


def reader(tables, share: Share):
    """Sample i of `share.samples` in full: as held, or read again from its row where it is an outline."""
    def full(i: int) -> TrainSample:
        s = share.samples[i]
        return s if s.target.numel() else from_features(*tables.features_at(share.rows[i]))

    return full


def complete(tables, share: Share, wanted: list[TrainSample]) -> list[TrainSample]:
    """`share.samples` with the `wanted` ones (those pictured) read in full where they are outlines (before
    generating their images)."""
    at, full = {s.key: i for i, s in enumerate(share.samples)}, reader(tables, share)
    samples = list(share.samples)
    for s in wanted:
        samples[at[s.key]] = full(at[s.key])
    return samples
