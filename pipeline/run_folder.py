"""Which folders train may write a run into (`pipeline run train --out`, `run all`'s paths.run), and which a new
store may be made in (`run resize-bucket --store`, `run all`'s paths.store, `store pull`)."""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError
from store import format as fmt


# What a run folder holds from its start on (the lock is its first file): a folder with none of them is not one.
RUN_MARKERS = (".train.lock", "train_config.yaml", "checkpoints", "lora", "logs")


def refuse_a_folder_of_other_files(out: Path, what: str = "--out") -> None:
    """--out naming a non-empty folder that is no run (a dataset, a report, a home directory): train wrote its
    lora/, checkpoints/ and logs/ in among those files (and --new-run would move them all to OUT.previous/)."""
    if not out.is_dir() or any((out / name).exists() for name in RUN_MARKERS):
        return
    # dot files are OS litter (.DS_Store, AppleDouble ._x: Finder leaves them in a new folder it showed), as in a
    # source folder (stages/resize/folder_listing.py); a dot folder is a user's (.git, .venv): a keep would move it
    others = sorted(f.name for f in out.iterdir() if not f.name.startswith(".") or f.is_dir())
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(f"{what} {out} holds other files ({shown}) and no training run: train writes lora/, "
                        "checkpoints/ and logs/ there; pass a new or empty folder, or the folder of an earlier run")


# What a store folder holds from its first open on (the lock is taken before store.json is written)
STORE_MARKERS = (fmt.STORE_JSON, fmt.STORE_LOCK)


def refuse_a_store_among_other_files(store: str | Path, what: str = "--store") -> None:
    """A new store only in a new or empty folder: `--store` naming the dataset, a run or a report folder (a typo,
    the wrong variable) made a store there, its tables in among those files. A URL is not checked here."""
    from store.remote import is_url

    if is_url(store):
        return
    root = Path(store)
    if not root.is_dir() or any((root / name).exists() for name in STORE_MARKERS):
        return
    others = sorted(f.name for f in root.iterdir() if not f.name.startswith(".") or f.is_dir())  # as above
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UserError(f"{what} {root} holds other files ({shown}) and no store (no store.json): a new store's "
                        "tables would go in among them; pass a new or empty folder, or the folder of an existing store")


def refuse_inputs_inside(run: Path, inputs: dict[str, str | None]) -> None:
    """`run all` keeps a run on other inputs by renaming paths.run aside (stages/train/previous.py): a store,
    source or model folder inside it would go along, and the stages after it find nothing. Refused on the first
    invocation too: before, a store inside paths.run worked until a kill before train (then 'holds other files')
    or a keep (then the store was gone)."""
    from stages.train.previous import previous_root
    from store.remote import is_url

    for what, where in inputs.items():
        if where is None or is_url(where):  # a store URL, a hub id: not a folder here
            continue
        p = Path(where)
        if what != "paths.store" and not p.exists():  # the model may be a hub id, which names no folder
            continue
        if p.resolve().is_relative_to(run.resolve()):
            raise UserError(f"{what} {p} is inside paths.run {run}: a run on other inputs is kept by renaming "
                            f"paths.run to {previous_root(run)}/N-TIME, which would take it along; put it beside "
                            f"paths.run (e.g. {run.parent / p.name})")
