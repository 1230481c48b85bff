"""How a report names the tables it reads: text / vae by the val split's content, `images` by the rows its
pictures and captions come from, else by version id."""

from __future__ import annotations

from pathlib import Path

from features.open import open_configured
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate.val_pictures import PICTURE_COLUMNS, images_reader
from store import Store
from store.join import JoinedTables


def version_table_ids(store: str | Path) -> dict:
    """The store's current images / text / vae version ids: how a report named its tables before they were named
    by content (`read_table_ids`), and what they fall back to."""
    st = Store(store, create=False)
    return {t: st.version_id(t, v) for t, v in sorted(st.tables().items()) if t in ("images", "text", "vae")}


def read_table_ids(cfg: EvaluateConfig, store: str | Path, model: str, tables: JoinedTables | None = None) -> dict:
    """The tables a report reads, named by content where they have one: text / vae by the val split's content
    ids (`loss_fingerprint.read_tables`), `images` by the rows the pictures and captions come from (`images_rows_id`),
    so an `images` rerun that changed no sample keeps the report. A table without one: its version id."""
    from models.loading import model_files
    from stages.evaluate.loss_fingerprint import read_tables
    from features.damaged import rows_read

    if tables is None:
        with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as opened:
            return read_table_ids(cfg, store, model, opened)
    ids = read_tables(tables, cfg.max_loss_samples)
    st = Store(store, create=False)
    if "images" in st.tables():
        rows = images_rows_id(st, tables, rows_read(tables, cfg.max_loss_samples))
        ids["images"] = f"content:{rows}" if rows else st.version_id("images", st.tables()["images"])
    return dict(sorted(ids.items()))


def images_rows_id(st: Store, tables: JoinedTables, first: int | None = None) -> str | None:
    """`store.join.rows_content_id` of the `images` rows evaluate shows (`images_reader`: the version the vae table
    was built from) for the val keys scored (the first `first`, `features.damaged.rows_read`; None: every one), which
    the pictures are taken from: their bytes (pictures) and `PICTURE_COLUMNS`. None: no such id."""
    from store.join import rows_content_id

    try:
        images = images_reader(st, tables)
    except UserError:  # that version is gone (collected): named by the current version id, as before
        return None
    if images is None:
        return None
    with images:
        keys = tables.keys.array
        return rows_content_id(images, keys if first is None else keys.slice(0, first), PICTURE_COLUMNS)
