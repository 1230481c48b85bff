"""The val samples' stored pictures: the `images` version the vae table was encoded from, and each pictured
sample's caption, control pictures and target read from it."""

from __future__ import annotations

from features.pictures import open_png
from models.sample import TrainSample
from schemas.errors import UserError
from store import Store, TableReader
from store.join import JoinedTables


def images_reader(st: Store, tables: JoinedTables, on_damaged: str = "stop",
                  max_open_shards: int = 256) -> TableReader | None:
    """The `images` version the vae table was built from (the pictures of exactly these samples). Gone since (a
    `store repair` replaced it, or a gc collected it): a line naming the encoders whose rerun brings the val tables
    to the current images (the store's "inspect lists the versions" said nothing of that)."""
    from store import format as fmt
    from store.remote_parts import source_url

    version = tables.vae.schema.lineage.upstream.get("images")
    if "images" not in st.tables():
        return None
    if version is not None and not st.version_dir("images", int(version)).is_dir():
        aside = st.version_dir("images", int(version)).with_name(f"v{int(version)}{fmt.SET_ASIDE_SUFFIX}")
        url = source_url(st.root)  # a store URL's cache holds the versions read, not every one
        why = ("replaced by a repair (set aside as " + aside.name + "/)" if aside.is_dir() else
               f"not in this node's copy of {url}" if url else "collected")
        raise UserError(f"the val samples' pictures are in images v{version}, which table 'vae' "
                        f"v{tables.vae.version} was encoded from, but {st.root} does not hold it ({why}): run "
                        "`pipeline run encode-text` and `pipeline run encode-vae` to encode from images "
                        f"v{st.tables()['images']} (samples whose pictures did not change are carried forward, not "
                        "encoded again), then evaluate")
    return st.reader("images", version, on_damaged=on_damaged, max_open_shards=max_open_shards)


#: the `images` meta columns `stored_pictures` reads (with the sample's bytes: the pictures): what names those rows
#: in a report's inputs (`images_rows_id`; not `source`, a path that moves with the source folder)
PICTURE_COLUMNS = ("caption",)


def stored_pictures(images, picked: list[TrainSample], on_damaged: str, damaged: dict | None) -> list[tuple]:
    """Each picked val sample's (caption, control pictures, target) from the `images` table (empty when the table
    or the sample is absent; a damaged sample under on_damaged=skip loses only its pictures, recorded in
    `damaged`). The captions and the pictures' places are read for those rows only, in one pass over the row groups
    holding them (`meta_and_files_of`): `meta` and `files` would keep every meta column of the table parsed, and its
    `files` column (~735 + 95 MB at 1M samples)."""
    held = [s.key for s in picked if images is not None and s.key in images]
    lost: dict[str, str] | None = {} if on_damaged == "skip" and damaged is not None else None
    metas, pictures = images.meta_and_files_of(held, PICTURE_COLUMNS, lost) if held else ({}, {})
    for key, why in (lost or {}).items():
        damaged[f"images:{key}"] = why  # type: ignore[index]
    out = []
    for s in picked:
        files = pictures.get(s.key, {})
        target = open_png(files["target.png"]) if "target.png" in files else None
        controls = [open_png(files[f"control_{i}.png"]) for i in range(len(s.controls))
                    if f"control_{i}.png" in files]
        out.append((str(metas.get(s.key, {}).get("caption", "")), controls, target))
    return out
