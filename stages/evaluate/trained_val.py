"""Val samples a run trained on. evaluate scores a LoRA on the store's current val split; when the split changed
after the run trained (`resize.val_fraction`, `resize.split_by`, a rerun that re-split), some of those samples
were in the run's train split, and their held-out loss scores pictures the LoRA learnt: the best checkpoint then
favours memorisation. Said in one line and recorded in metrics.json `run.trained_val` (a warning, not a refusal:
the numbers are still the LoRA's on those samples, and a user comparing checkpoints of a run trained before a
re-split may want them; the line says how to get a clean figure).

What a run trained on is read from its record (a checkpoint's resume.json `tables`: the text / vae version ids):
the `images` version those tables were encoded from (their lineage), whose manifest's `key` / `split` /
`source_hashes` give its train samples. Vectorised Arrow over those three columns only (no per-row Python).
Rank 0 alone decides (it writes the report); every input is an immutable store file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

_VERSION_ID = re.compile(r"^v(\d+)-")


def run_record(lora: str | Path) -> tuple[Path, dict[str, str]] | None:
    """(the run folder, its `tables` record) of a LoRA train wrote: RUN/checkpoints/step-N/lora (that checkpoint's
    resume.json) or RUN/lora (the last checkpoint's); None for a LoRA with no such record (made elsewhere)."""
    from schemas.record_formats import RESUME_JSON
    from store.checksum import SealError, is_sealed, unseal

    lora = Path(lora)
    folder, run = lora.parent, lora.parent.parent.parent
    if not (folder / RESUME_JSON).is_file():  # RUN/lora: the newest committed step-N (train's `latest_checkpoint`;
        # a stage imports no other stage: the folder rule read here)
        done = [p.parent for p in (lora.parent / "checkpoints").glob(f"step-*/{RESUME_JSON}")
                if p.parent.name[len("step-"):].isdigit()]
        if not done:
            return None
        folder, run = max(done, key=lambda p: int(p.name[len("step-"):])), lora.parent
    try:
        data = (folder / RESUME_JSON).read_bytes()
        record = unseal(data) if is_sealed(data) else json.loads(data)
    except (OSError, ValueError, SealError):
        return None
    tables = record.get("tables") if isinstance(record, dict) else None
    return (run, dict(tables)) if isinstance(tables, dict) and tables else None


def training_images(st, tables: dict[str, str]) -> tuple[int | None, str | None]:
    """(the `images` version the run's text / vae tables were encoded from, None) or (None, why it cannot be
    told: a version collected or rebuilt since)."""
    from schemas.errors import UserError
    from store.manifest_files import checked_schema

    for table in ("vae", "text"):
        vid = tables.get(table)
        m = _VERSION_ID.match(vid or "")
        if not m:
            continue
        version = int(m.group(1))
        try:
            same = st.version_id(table, version) == vid
        except Exception:  # noqa: BLE001 - gone or unreadable: the check cannot be made, said as such
            same = False
        if not same:
            return None, f"table '{table}' {vid} it trained on is no longer in the store (collected or rebuilt)"
        try:  # checked: a flipped digit that still parses would name another images version's val rows
            upstream = checked_schema(st.version_dir(table, version)).lineage.upstream.get("images")
        except UserError as e:  # damaged (recorded, as a reader records it) or unreadable
            return None, f"table '{table}' {vid} it trained on does not read ({e})"
        try:
            return int(upstream), None
        except (TypeError, ValueError):
            return None, f"table '{table}' {vid} records no images version"
    return None, "its record names no text / vae version"


class _Gone(Exception):
    """The images version a run trained on is not in the store any more."""


def _rows(st, version: int) -> Any:
    """The version's key / split / source_hashes; one a repair (or a stage's rerun) replaced is read where it was
    set aside (`v<N>.damaged/`, its manifest checked: the split the run trained on) until `store gc` removes it.
    `_Gone` when neither is there (its missing manifest advised `store repair`, which cannot bring it back)."""
    from store import format as fmt
    from store.manifest_files import checked_manifest
    from store.remote_parts import source_url

    vdir = st.version_dir("images", version)
    if not vdir.is_dir():
        vdir = vdir.with_name(vdir.name + fmt.SET_ASIDE_SUFFIX)
        if not vdir.is_dir():
            url = source_url(st.root)  # a store URL's cache holds the versions read, not every one
            raise _Gone(f"images v{version} it trained on is " + (
                f"not in this node's copy of {url} (it caches the versions read)" if url else
                "no longer in the store (collected, or replaced by a repair and collected since)"))
    return checked_manifest(vdir, ["key", "split", "source_hashes"])


def trained_on(trained, now, val_keys: list[str]) -> tuple[int, int]:
    """(how many of `val_keys` were training samples, how many of those by key): a key in `trained`'s train rows
    (its manifest's key / split / source_hashes), or - with `now`, the val samples' own manifest rows - the same
    pictures (`source_hashes`, joined) as a train row (resize's `val_sharing`: the pair under another caption).
    Vectorised: `is_in` over the columns, no row in Python."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = pa.array(val_keys, pa.string())
    train = trained.filter(pc.equal(trained.column("split"), "train"))
    by_key = pc.is_in(keys, value_set=train.column("key").combine_chunks())
    leaked = by_key
    if now is not None and len(keys):
        from features.same_pictures import sharing_pictures

        now = now.filter(pc.is_in(now.column("key"), value_set=keys))
        hits = pc.filter(now.column("key"), sharing_pictures(now, train)).combine_chunks()
        leaked = pc.or_(by_key, pc.is_in(keys, value_set=hits))
    return int(pc.sum(leaked).as_py() or 0), int(pc.sum(by_key).as_py() or 0)


def check(st, lora: str | Path, val_keys: list[str], val_images: int | None) -> dict | None:
    """metrics.json `run.trained_val` for `lora` scored on `val_keys` (read from `images` v`val_images`), its line
    logged when some were training samples or the check could not be made; None for a LoRA without a run record."""
    found = run_record(lora)
    if found is None:
        return None
    run, tables = found
    trained, why = training_images(st, tables)
    if trained is not None:
        try:
            train = _rows(st, trained)
        except _Gone as e:
            trained, why = None, str(e)
        except Exception as e:  # noqa: BLE001 - damaged or unreadable: the check cannot be made
            trained, why = None, f"images v{trained} it trained on cannot be read ({' '.join(str(e).split())[:200]})"
    if trained is None:
        line = (f"warning: evaluate: cannot tell whether val samples were training samples of run {run}: {why}; "
                "if the split changed since it trained (resize.val_fraction / split_by), its held-out loss may "
                "score pictures it trained on")
        tqdm.write(line)
        return {"run": str(run), "checked": False, "why": why, "warning": line}
    now = None if val_images is None or not val_keys else train if val_images == trained else _rows(st, val_images)
    leaked, same_key = trained_on(train, now, val_keys)
    record = {"run": str(run), "checked": True, "trained_images": trained, "val_images": val_images,
              "val_samples": len(val_keys), "trained_on": leaked, "same_key": same_key}
    if leaked:
        if trained != val_images:
            since = f"the split changed since it trained: images v{trained} vs v{val_images}"
            fix = "retrain on the current split, or evaluate on the split it trained on"
        else:  # one split: pairs listed under several captions in both (resize's val_sharing)
            since = f"the pictures of train samples under other captions, images v{trained}"
            fix = "resize with resize.split_by: pictures, re-encode and retrain"
        record["warning"] = (f"warning: evaluate: {leaked} of {len(val_keys)} val samples were training samples of "
                             f"run {run} ({since}): their held-out loss is not held out and favours memorisation; "
                             f"{fix}")
        tqdm.write(record["warning"])  # and atop the report page (`report.page`), where the figures are read
    return record


def check_checkpoints(st, checkpoints: list[tuple[int, Path]], val_keys: list[str],
                      val_images: int | None) -> list[dict]:
    """`check` once per training among `checkpoints` (their records' `tables`: one run is one list entry)."""
    seen: set[str] = set()
    out = []
    for _, path in checkpoints:
        found = run_record(path)
        ident = json.dumps(found[1], sort_keys=True) if found else None
        if ident is None or ident in seen:
            continue
        seen.add(ident)
        out.append(check(st, path, val_keys, val_images))
    return out


def recorded_warnings(metrics: dict) -> list[str]:
    """The trained-on warning lines a report's metrics.json records (`run.trained_val`: one record, or one per
    training for --all-checkpoints)."""
    trained = (metrics.get("run") or {}).get("trained_val") if isinstance(metrics, dict) else None
    return [t["warning"] for t in (trained if isinstance(trained, list) else [trained])
            if isinstance(t, dict) and isinstance(t.get("warning"), str) and t["warning"]]


def say_recorded(metrics: dict) -> None:
    """An up-to-date report's trained-on warnings said again: its figures are the same, and so is what makes
    them not held out (a rerun said nothing, as if the val split were clean)."""
    for line in recorded_warnings(metrics):
        tqdm.write(line)


def val_images_version(tables) -> int | None:
    """The `images` version the val split's tables were encoded from (their lineage)."""
    try:
        return int(tables.vae.schema.lineage.upstream.get("images"))
    except (TypeError, ValueError, AttributeError):
        return None
