"""The one join of tables by sample key: train and evaluate read `text` + `vae` as one sample through it.

`JoinedTables` is an inner join on key (optionally of one split); keys missing from some table are counted in
`unmatched` and logged, never silently lost. `open_features` is the trainer's view of a store: `text` + `vae`
built with the expected model, the same keys in both, sequence lengths from the manifests alone.
"""

from __future__ import annotations

import logging
from math import prod
from pathlib import Path
from typing import Any

from schemas.errors import UserError
from store.partition import epoch_order
from store.reader import TableReader

log = logging.getLogger("store")

STAGE_OF = {"images": "resize-bucket", "text": "encode-text", "vae": "encode-vae"}  # table -> the stage that writes it


class JoinedTables:
    """Inner join on key of several tables (the first one that records img_shapes gives them)."""

    def __init__(self, readers: dict[str, TableReader], split: str | None = None, store_root: Path | None = None):
        if len(readers) < 2:
            raise UserError("a join needs at least two tables")
        self.readers, self.split = readers, split
        self.store_root = Path(store_root) if store_root is not None else next(iter(readers.values())).dir.parents[1]
        key_sets = {t: set(split_keys(r, split)) for t, r in readers.items()}
        common = set.intersection(*key_sets.values())
        self.only = {t: ks - common for t, ks in key_sets.items()}  # keys each table holds alone
        if any(self.only.values()):
            log.warning("join of %s: keys only in one side dropped: %s", list(readers), self.unmatched)
        self.keys: list[str] = sorted(common)
        self.lengths: list[int] = []  # filled by `open_features`: joint sequence length per key
        self.damaged: dict[str, str] = {}  # open_features(on_damaged="skip"): key -> problem, left out of `keys`

    @property
    def unmatched(self) -> dict[str, int]:
        return {t: len(ks) for t, ks in self.only.items()}

    def __len__(self) -> int:
        return len(self.keys)

    def __getattr__(self, table: str) -> TableReader:  # `joined.text`, `joined.vae`
        readers = self.__dict__.get("readers", {})
        if table in readers:
            return readers[table]
        raise AttributeError(table)

    def get(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.get(key) for t, r in self.readers.items()}

    def meta(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.meta(key) for t, r in self.readers.items()}

    def tensors(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.tensors(key) for t, r in self.readers.items()}

    def features(self, key: str) -> tuple[dict, dict, list[tuple[int, int, int]], str]:
        """(text tensors, vae tensors, img_shapes, where): the arguments of `models.sample.from_features`."""
        return self.readers["text"].tensors(key), self.readers["vae"].tensors(key), self.img_shapes(key), self.where("vae")

    def img_shapes(self, key: str) -> list[tuple[int, int, int]]:
        return self._shapes_reader().img_shapes(key)

    def where(self, table: str) -> str:
        r = self.readers[table]
        return f"'{table}' v{r.version} ({r.dir})"

    def versions(self) -> dict[str, str]:
        """Identities of the joined tables (version + manifest hash; see `Store.version_id`)."""
        from store.store import Store

        st = Store(self.store_root, create=False)
        return {t: st.version_id(t, r.version) for t, r in self.readers.items()}

    def iter_keys(
        self, rank: int = 0, world_size: int = 1, seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """Same ordering rules as one table (`TableReader.iter_keys`), grouped by the first table's shards."""
        keep = set(self.keys)
        groups = [[k for k in g if k in keep] for g in next(iter(self.readers.values())).shard_groups(self.split)]
        return epoch_order([g for g in groups if g], rank, world_size, seed, epoch, buffer_size)

    def _shapes_reader(self) -> TableReader:
        return self.readers.get("vae") or next(iter(self.readers.values()))


def split_keys(r: TableReader, split: str | None) -> list[str]:
    if split is None:
        return r.keys()
    if "split" not in r.manifest.column_names:
        raise UserError(f"table '{r.table}' v{r.version} ({r.dir}) has no split column; rebuild it with the current code")
    splits = r.manifest.column("split").to_pylist()
    return sorted(k for k, s in zip(r.keys(), splits) if s == split)


def _name_keys(keys: set[str], limit: int = 5) -> str:
    shown = sorted(keys)[:limit]
    return ", ".join(shown) + (f" … ({len(keys)} in all)" if len(keys) > limit else "")


def open_features(
    store: str | Path, model: str, model_fingerprint: str, split: str = "train", on_damaged: str = "stop",
    max_damaged_fraction: float = 0.0,
) -> JoinedTables:
    """`text` + `vae` of one split: built with the model whose fingerprint is given, the same keys in both, not
    empty; `lengths` holds each sample's joint sequence length. UserError (what, where, what to do) otherwise.

    on_damaged="stop": a damaged sample raises when it is first read (a missing / short shard on open).
    "skip": every sample of the split is checked now; damaged ones are left out and listed in `damaged`
    (more than `max_damaged_fraction` of them: UserError).
    """
    from store.store import Store

    st = Store(store, create=False)
    readers = {t: _open_table(st, t, model, on_damaged) for t in ("text", "vae")}
    for r in readers.values():
        found = r.schema.lineage.model_fingerprint
        if found != model_fingerprint:
            raise UserError(
                f"table '{r.table}' v{r.version} in {st.root} was built with a different model (fingerprint "
                f"{found or 'none'}) than --model {model} ({model_fingerprint}); use the model that encoded the "
                f"store, or re-run `pipeline run {STAGE_OF[r.table]} --model {model}`"
            )
    joined = JoinedTables(readers, split, st.root)
    text, vae = readers["text"], readers["vae"]
    if any(joined.only.values()):
        parts = [f"only in '{t}' v{readers[t].version}: {_name_keys(ks)}" for t, ks in joined.only.items() if ks]
        raise UserError(
            f"the '{split}' splits of the text and vae tables in {st.root} hold different keys ({'; '.join(parts)}); "
            "re-run the encode stages so both are built from the same `images` table version"
        )
    if not joined.keys:
        raise UserError(
            f"the '{split}' split is empty in store {st.root} (text v{text.version}, vae v{vae.version}); "
            "add training samples (resize-bucket puts val_fraction of them in 'val', the rest in 'train')"
        )
    if on_damaged == "skip":
        joined.damaged = find_damaged(text, vae, joined.keys)
        if len(joined.damaged) > max_damaged_fraction * len(joined.keys):
            raise UserError(
                f"{len(joined.damaged)} of {len(joined.keys)} '{split}' samples in {st.root} are damaged, more than "
                f"max_damaged_fraction {max_damaged_fraction} (e.g. {next(iter(joined.damaged.values()))}); "
                f"run `pipeline store repair {st.root}`"
            )
        joined.keys = [k for k in joined.keys if k not in joined.damaged]
        if not joined.keys:
            raise UserError(f"every '{split}' sample in {st.root} is damaged; run `pipeline store repair {st.root}`")
    joined.lengths = sequence_lengths(text, vae, joined.keys)
    return joined


def find_damaged(text: TableReader, vae: TableReader, keys: list[str]) -> dict[str, str]:
    """key -> first problem found, over both tables (reads and checks every sample's bytes once)."""
    from tqdm import tqdm

    out: dict[str, str] = {}
    for k in tqdm(keys, desc="check samples", unit="sample", leave=False):
        problem = text.damaged(k) or vae.damaged(k)
        if problem is not None:
            out[k] = problem
    return out


def _open_table(st, table: str, model: str, on_damaged: str = "stop") -> TableReader:
    if table not in st.tables():
        raise UserError(
            f"store {st.root} has no '{table}' table (tables: {sorted(st.tables()) or 'none'}); "
            f"run `pipeline run {STAGE_OF[table]} --store {st.root} --model {model}` first"
        )
    return st.reader(table, on_damaged=on_damaged)


def sequence_lengths(text: TableReader, vae: TableReader, keys: list[str]) -> list[int]:
    """Token count of each sample's joint sequence (image tokens + text tokens), from the manifests only."""
    if "length" in text.manifest.column_names:
        text_len = dict(zip(text.keys(), text.manifest.column("length").to_pylist()))
    else:  # the manifest records every tensor's shape too
        rows = text.manifest.column("tensors").to_pylist()
        text_len = {k: next(t["shape"][0] for t in r if t["name"] == "prompt_embeds") for k, r in zip(text.keys(), rows)}
    return [sum(prod(s) for s in vae.img_shapes(k)) + int(text_len[k]) for k in keys]
