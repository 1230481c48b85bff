"""Held-out losses of a run's checkpoints: one zarr v3 group, appended one checkpoint at a time.

    losses.zarr/
      base_loss   float32 (sample, seed, sigma, region)         the model without LoRA: the reference line
      loss        float32 (step, sample, seed, sigma, region)   one chunk per checkpoint step
                  (float64 both in a single-LoRA report's group, `stages.evaluate.lora_losses`: its figures are
                  of the numbers as computed, and a grown grid's kept cells must be those numbers to the bit)
      step        int64   (step)        checkpoint        str (step)  its folder   lora_sha256 str (step)
      sample      str (sample: keys)    bucket  str (sample)   seed int64   sigma float64   region str
      zarr.json   group attrs (settings, fingerprint, trainings: step -> what trained it) + consolidated
                  metadata: the commit record

Read with xarray (dimension names are stored, coordinates are the arrays named like their dimension):

    import xarray as xr
    ds = xr.open_zarr("REPORT/losses.zarr").sortby("step")  # evaluate appends the newest step first
    ds.loss.sel(region="all").mean(["sample", "seed", "sigma"])  # held-out loss per checkpoint step

Commit order (why the append is kill-safe): an append resizes the arrays and writes the new step's chunks,
then rewrites the consolidated metadata in the root zarr.json last (zarr's LocalStore writes each file via a
temporary file + rename). Readers (xarray, and `open` here) take the shapes from that consolidated record, so
a process killed mid-append leaves the group as it was before: the partial step lies beyond the recorded
shape, unseen, and the next append overwrites it.

Durable too (a power loss, a node crash): zarr never fsyncs, and a file system may persist the renamed root
zarr.json before the new chunk files' bytes, so a step recorded as committed (a resumed training does not
validate it again, evaluate does not evaluate it again) could read as NaN / step 0 / an error. Every write
here therefore fsyncs the files it wrote and their folders before the commit, then the root zarr.json and the
group's folder (`_commit`); a new group is written whole in a temp folder, fsynced and renamed in
(`store.format.atomic_dir`), and so is one whose base is written again (`write_base`: zarr would delete the old
base's chunks before the commit). A few fsyncs per validation or checkpoint evaluated, none per sample.

Every chunk on disk (format 2): zarr writes no chunk that holds only the fill value by default, so a chunk
file lost later (a damaged disk, a partial copy or rsync of a run folder) read back as NaN losses, step 0 or an
empty sha, exactly as a step whose losses were all non-finite: the best checkpoint, `compare` and the report
used it silently. Every write here now sets zarr's `write_empty_chunks`, so every chunk inside the committed
shapes is a file, and every read checks that it is (`store.loss_chunks`): one absent is refused naming it (an
open for writing sets the group aside saying so, as a chunk failing its CRC32C). Groups of format 1 (earlier
releases) are read as before, unchecked: an absent chunk there may be a row that was all NaN; a reader says
so in one line where a chunk of their losses is absent (`unchecked`).

A group is for one evaluation setting (`fingerprint`: store tables, model, noise seeds, σ grid, LoRA scale,
dtype, ...). Opening with another fingerprint keeps the old group as `losses.<old fingerprint>.zarr` beside it
and starts a new one, so numbers of different protocols never share an array. With `take_back`, a kept group of
this very fingerprint and samples is renamed back in instead (settings A, B, then A again: A's numbers return, not
computed again); its steps are then judged as any recorded steps are. `start_over(reason, kept)` takes back a
kept group the caller chose among `kept_groups` (evaluate: the one of the run it evaluates, run A, B, then A).

The seed and σ axes are read and written by their coordinates (`_placement`): callers give them in their order
(evaluate: sorted), a group recorded in another order of the same values is used as it is. A group of the same
setting but another seed / σ grid (`cell_donor`) gives a grown or shrunk grid the cells both hold: evaluate
computes only the others, and writes whole rows into the new group as any append (the donor is only read).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from schemas import atomic_write
from store import format as fmt
from store import loss_chunks
from store.loss_chunks import WRITE, ChunkMissing


REGIONS = ("all", "inside", "outside")  # models.held_out computes them in this order
GROUP = "losses.zarr"
# bump when the layout above changes; a group of a format not in _READS is kept aside like a new setting.
# 2: every chunk written, checked on read; earlier releases set it aside (they would not write every chunk)
FORMAT = 2
UNCHECKED = 1  # only the chunks that were not all fill value written: still read, absent chunks unchecked
_READS = (UNCHECKED, FORMAT)
_STR = dict(dtype=str)  # zarr 3 variable-length UTF-8 strings


def _checked() -> dict:
    """Every array's chunks end in a CRC32C: zstd keeps no checksum, and a flipped bit in a chunk decoded into other
    losses (a step of 7e35, or one slightly off: another best checkpoint) without complaint. Groups written
    before keep their codecs (nothing to check there)."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return dict(compressors=(ZstdCodec(level=0), Crc32cCodec()), config=WRITE)


def _damage(e: BaseException) -> str | None:
    """What a read found damaged (zarr's CRC32C codec raises a ValueError; `_verify` a ChunkMissing), else None."""
    if isinstance(e, ChunkMissing):
        return f"{e}: lost after it was written"
    if isinstance(e, ValueError) and "checksum do not match" in str(e):
        return f"a chunk is damaged ({e}): it changed after it was written"
    return None


def _verify(group, path: Path) -> None:
    """Check that every chunk of a format-2 group is on disk (`loss_chunks.check`), then read every array once (a
    few MB at most: steps x val samples x seeds x σ x 3 floats), so a damaged or lost chunk is found when the
    group is opened, not used as numbers later."""
    if group.attrs.get("format") == FORMAT:
        loss_chunks.check(path, group)
    for name in group.array_keys():
        group[name][...]


def unchecked(path: Path, group) -> str | None:
    """The line a reader says for a format-1 group with an absent chunk of losses (`loss_chunks.unchecked_note`),
    else None."""
    return loss_chunks.unchecked_note(path, group) if group.attrs.get("format") == UNCHECKED else None


def _zarr():
    import zarr

    # zarr warns that the variable-length string dtype may change in the v3 spec; we read what we write.
    warnings.filterwarnings("ignore", message=".*not part of the Zarr format 3.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="zarr")
    return zarr


@dataclass
class Axes:
    """The fixed dimensions of one evaluation: which samples (and their buckets), seeds and σ values."""

    keys: list[str]
    buckets: list[str]
    seeds: list[int]
    sigmas: list[float]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.keys), len(self.seeds), len(self.sigmas), len(REGIONS))


class LossGroup:
    """A committed group read: its steps, what trained them, the base and the losses, the seeds and σ in the order
    of `axes` (`_placement`; None: as recorded). `LossStore` writes one; a group kept aside is read as one to judge
    whether to take it back (`kept_groups`)."""

    def __init__(self, path: str | Path, axes: Axes | None = None):
        self.path, self.axes = Path(path), axes
        self.group = _zarr().open_group(self.path, mode="r", use_consolidated=True)
        self._place = _placement(self.group, axes) if axes is not None else (None, None)

    def steps(self) -> dict[int, str]:
        """step -> LoRA sha256 of every committed checkpoint."""
        n = self.group["step"].shape[0]
        if n == 0:
            return {}
        return dict(zip((int(s) for s in self.group["step"][:]), (str(h) for h in self.group["lora_sha256"][:])))

    def trainings(self) -> dict[int, dict]:
        """step -> what trained its checkpoint (`append`'s `training`), for the steps recorded with one."""
        steps = self.steps()
        return {int(k): v for k, v in dict(self.group.attrs.get("trainings") or {}).items()
                if int(k) in steps and isinstance(v, dict)}

    def has_base(self) -> bool:
        return "base_loss" in self.group

    def base(self) -> np.ndarray:
        return self._to_axes(np.asarray(self.group["base_loss"][:], dtype=np.float64), 1)

    def losses(self) -> tuple[list[int], list[str], np.ndarray]:
        """(steps, checkpoint paths, [step, sample, seed, σ, region] losses), in step order."""
        n = self.group["step"].shape[0]
        if n == 0:
            return [], [], np.zeros((0, *self.group["loss"].shape[1:]))
        steps = [int(s) for s in self.group["step"][:]]
        paths = [str(p) for p in self.group["checkpoint"][:]]
        values = self._to_axes(np.asarray(self.group["loss"][:n], dtype=np.float64), 2)
        order = np.argsort(steps, kind="stable")
        return [steps[i] for i in order], [paths[i] for i in order], values[order]

    def _to_axes(self, grid: np.ndarray, seed_axis: int, undo: bool = False) -> np.ndarray:
        """A recorded grid (its seed axis at `seed_axis`, σ next) in the order of `self.axes` (`_placement`);
        `undo`: one in that order in the group's."""
        return _placed(grid, self._place, seed_axis, undo)

    def checkpoints(self) -> dict[int, str]:
        """step -> the checkpoint folder recorded with its losses."""
        n = self.group["step"].shape[0]
        return dict(zip((int(s) for s in self.group["step"][:n]), (str(p) for p in self.group["checkpoint"][:n])))


class LossStore(LossGroup):
    """Open (or start) the group at `folder/losses.zarr` for `fingerprint`; see the module doc."""

    def __init__(self, folder: str | Path, fingerprint: str, axes: Axes, settings: dict,
                 versions: dict | None = None, measured: dict | None = None, take_back: bool = False,
                 spelled: Callable[[dict], bool] | None = None, dtype: str = "float32"):
        self.path = Path(folder) / GROUP
        self.dtype = dtype  # of the losses of a group created here (one opened keeps its own)
        self.spelled = spelled  # `kept_groups`: recorded settings that are these under an earlier spelling
        self.axes, self.fingerprint, self.settings = axes, fingerprint, settings
        # `note`: recorded with a new group (no commit of their own)
        self.notes = {k: v for k, v in (("table_versions", versions), ("measured", measured)) if v is not None}
        self.kept_aside: Path | None = None
        # why the group found there was set aside, for the line the caller writes: a damaged group passed for
        # "evaluation settings changed", which sent the user looking for a setting nobody changed
        self.aside_reason: str | None = None
        self._unreadable: str | None = None  # what `_recorded_fingerprint` found wrong with the group
        self.taken_back: Path | None = None  # the kept group renamed back in (`take_back`)
        self.unchecked: str | None = None  # a format-1 group's absent chunks of losses, for the caller's line
        fmt.settle_swap(self.path)  # a `write_base` killed between its renames: the old group back (its lock held)
        _remove_killed_writes(self.path)
        if self.path.exists() and (recorded := self._recorded_fingerprint()) != fingerprint:
            if take_back and (kept := self._kept_of(fingerprint)) is not None:
                self.start_over("the settings changed", kept)
                return
            self.start_over("the settings changed" if recorded is not None
                            else f"{self.path} could not be read ({self._unreadable})")
        else:
            if not self.path.exists():
                kept = self._kept_of(fingerprint) if take_back else None
                if kept is not None:  # a kill between `start_over`'s two renames left no group: take it back now
                    os.rename(kept, self.path)
                    atomic_write.fsync_dir(self.path.parent)
                    self.taken_back = kept
                    _remove_killed_writes(self.path)
                else:
                    self._create(fingerprint, settings)
            self.group = _zarr().open_group(self.path, mode="r+", use_consolidated=True)
            try:
                _verify(self.group, self.path)
            except ValueError as e:
                if (damage := _damage(e)) is None:
                    raise
                self.start_over(f"{self.path} is damaged ({damage})")
                return
            self.unchecked = unchecked(self.path, self.group)
            keys = [str(k) for k in self.group["sample"][:]]
            if keys != list(axes.keys):  # other samples (e.g. one found damaged and skipped): not one array any more
                self.start_over(f"the val samples changed ({len(keys)} recorded, {len(axes.keys)} now"
                                f"{', other keys' if len(keys) == len(axes.keys) else ''})")
                return
            self._place = _placement(self.group, axes)

    def _kept_of(self, fingerprint: str) -> Path | None:
        """The first group kept aside under `fingerprint` (or an earlier spelling of its settings: `spelled`) and
        these samples (`kept_groups`); None: none."""
        return next((kept.path for kept in kept_groups(self.path.parent, fingerprint, self.axes, self.spelled)), None)

    def start_over(self, reason: str = "the settings changed", kept: Path | None = None) -> None:
        """Keep the current group aside (`losses.<its fingerprint>[.N].zarr`) and begin an empty one, or rename
        `kept` (a group kept aside earlier) back in; `reason`: why, kept in `aside_reason`. A kill between the
        two renames leaves no group: the next run takes its kept one back (`take_back`) or starts an empty one."""
        self.aside_reason, self.unchecked = reason, None
        recorded = (self._recorded_fingerprint() or "unreadable")[:12]
        aside, n = self.path.with_name(f"losses.{recorded}.zarr"), 1
        while aside.exists():
            aside, n = self.path.with_name(f"losses.{recorded}.{n}.zarr"), n + 1
        os.rename(self.path, aside)
        self.kept_aside = aside
        if kept is not None:
            os.rename(kept, self.path)
            atomic_write.fsync_dir(self.path.parent)  # both renames durable before any append to the group
            self.taken_back = kept
            _remove_killed_writes(self.path)  # the group taken back was written (and maybe killed) before
        else:
            self._create(self.fingerprint, self.settings)
        self.group = _zarr().open_group(self.path, mode="r+", use_consolidated=True)
        self._place = _placement(self.group, self.axes)
        if kept is not None:
            self.unchecked = unchecked(self.path, self.group)

    def note_versions(self, versions: dict) -> None:
        """Record the table version ids the losses were read from beside the settings (`table_versions`, not hashed:
        settings that name the tables by content keep the array across versions of the same samples), for readers
        comparing it with an array that names them by version ids (`pipeline compare`). A commit only when they
        changed."""
        self.note(table_versions=versions)

    def note(self, **attrs) -> None:
        """Record attributes beside the settings that are not hashed (`table_versions`; `measured`: how a
        validation curve's numbers were computed, its precision etc., which its settings do not hold), in one
        commit, and only when one changed."""
        changed = {k: v for k, v in attrs.items() if self.group.attrs.get(k) != v}
        if changed:
            self.group.attrs.update(changed)
            self._commit([])

    def refingerprint(self, fingerprint: str, settings: dict, versions: dict | None = None) -> None:
        """Record the group under another spelling of the same setting (a rule that stopped hashing a
        throughput-only value): later opens find it under the current one. `versions`: `note_versions`' in the
        same write. One consolidated-metadata rewrite."""
        self.group.attrs.update({"fingerprint": fingerprint, "settings": settings,
                                 **({"table_versions": versions} if versions is not None else {})})
        self._commit([])  # the attrs live in the root zarr.json, which the commit rewrites and fsyncs
        self.fingerprint, self.settings = fingerprint, settings

    def _recorded_fingerprint(self) -> str | None:
        try:
            g = _zarr().open_group(self.path, mode="r", use_consolidated=True)
            attrs = dict(g.attrs)
        except Exception as e:  # noqa: BLE001 - any unreadable group is replaced, never appended to
            self._unreadable = f"damaged: {type(e).__name__}: {str(e)[:200]}"
            return None
        if attrs.get("format") not in _READS:
            self._unreadable = f"format {attrs.get('format')!r}, this release reads formats {_READS}"
            return None
        return attrs.get("fingerprint")

    def _create(self, fingerprint: str, settings: dict) -> None:
        with fmt.atomic_dir(self.path) as tmp:  # the group appears whole (and fsynced) or not at all
            self._create_in(tmp, fingerprint, settings)

    def _create_in(self, tmp: Path, fingerprint: str, settings: dict) -> None:
        zarr = _zarr()
        g = zarr.open_group(tmp, mode="w", zarr_format=3)
        a, full = self.axes, self.axes.shape
        g.attrs.update({"format": FORMAT, "fingerprint": fingerprint, "settings": settings, **self.notes})
        g.create_array("sample", shape=(len(a.keys),), dimension_names=["sample"], **_STR, **_checked())[:] = np.array(a.keys, dtype=object)
        g.create_array("bucket", shape=(len(a.keys),), dimension_names=["sample"], **_STR, **_checked())[:] = np.array(a.buckets, dtype=object)
        g.create_array("seed", data=np.asarray(a.seeds, dtype="int64"), dimension_names=["seed"], **_checked())
        g.create_array("sigma", data=np.asarray(a.sigmas, dtype="float64"), dimension_names=["sigma"], **_checked())
        g.create_array("region", shape=(len(REGIONS),), dimension_names=["region"], **_STR, **_checked())[:] = np.array(REGIONS, dtype=object)
        g.create_array("loss", shape=(0, *full), chunks=(1, *full), dtype=self.dtype, fill_value=np.nan,
                       dimension_names=["step", "sample", "seed", "sigma", "region"], **_checked())
        g.create_array("step", shape=(0,), chunks=(1,), dtype="int64", dimension_names=["step"], **_checked())
        for name in ("checkpoint", "lora_sha256"):
            g.create_array(name, shape=(0,), chunks=(1,), dimension_names=["step"], **_STR, **_checked())
        g["loss"].attrs["coordinates"] = "bucket checkpoint lora_sha256"  # xarray: these are coordinates
        zarr.consolidate_metadata(tmp)

    def _commit(self, written: list[str]) -> None:
        """Make `written` (files of the group, relative to it) durable, then commit: the consolidated metadata
        rewritten last and fsynced with the group's folder, so no commit on disk counts a row whose bytes are
        not."""
        zarr = _zarr()
        _fsync(self.path, written)
        zarr.consolidate_metadata(self.path)
        _fsync(self.path, ["zarr.json"])
        self.group = zarr.open_group(self.path, mode="r+", use_consolidated=True)

    # ------------------------------------------------------------------------------------------------ writes

    def drop_from(self, step: int) -> None:
        """Forget the steps >= `step` (recorded by a run killed after its last checkpoint, about to be redone)."""
        steps = [int(s) for s in self.group["step"][:]] if self.group["step"].shape[0] else []
        keep = sum(1 for s in steps if s < step)
        if keep == len(steps):
            return
        if steps[:keep] != sorted(steps)[:keep] or any(s < step for s in steps[keep:]):
            raise ValueError(f"{self.path}: steps {steps} are not in order")
        from zarr.core.sync import sync

        for name in ("loss", "step", "checkpoint", "lora_sha256"):
            arr = self.group[name]
            # the chunks past the new end stay until appends overwrite them: zarr's resize deletes them before
            # the commit below, and a kill between left the recorded rows reading as NaN / step 0 for good
            sync(arr.async_array.resize((keep, *arr.shape[1:]), delete_outside_chunks=False))
        self._commit([f"{name}/zarr.json" for name in _PER_STEP])

    def write_base(self, grid: np.ndarray) -> None:
        """The base model's grid. Over one committed (a fresh training start over a curve a killed start recorded),
        zarr's overwrite deleted the old chunks before the commit, and a kill between left the group damaged (set
        aside, its steps evaluated again): the group is then written anew whole, its committed files linked into a
        temp folder with the new base, and swapped in (`store.format.atomic_dir`): the old commit or the new one."""
        zarr = _zarr()
        grid = self._to_axes(grid, 1, undo=True)
        if "base_loss" in self.group:
            with fmt.atomic_dir(self.path) as tmp:
                _link_committed(self.path, tmp, but="base_loss")
                _create_base(zarr.open_group(tmp, mode="r+", use_consolidated=False), grid)
                zarr.consolidate_metadata(tmp)
            self.group = zarr.open_group(self.path, mode="r+", use_consolidated=True)
            return
        _create_base(self.group, grid)  # over an uncommitted one at most (a kill before its commit): unread
        base = self.path / "base_loss"
        self._commit([(Path(folder) / f).relative_to(self.path).as_posix()
                      for folder, _, files in os.walk(base) for f in files])

    def append(self, step: int, checkpoint: str, lora_sha256: str, grid: np.ndarray,
               training: dict | None = None) -> None:
        """One checkpoint's losses: its chunk and coordinates first, the consolidated metadata (commit) last.
        `training`: what trained the checkpoint (its run's inputs, as its resume.json records them), kept in the
        attrs (`trainings`): a step no longer on disk is told apart from another run's by it."""
        if grid.shape != self.axes.shape:
            raise ValueError(f"losses shaped {grid.shape}, the group holds {self.axes.shape}")
        if training is not None:  # the attrs enter the commit below (an entry of an uncommitted step is unread)
            self.group.attrs.update({"trainings": {**dict(self.group.attrs.get("trainings") or {}), str(step): training}})
        n = self.group["step"].shape[0]
        loss = self.group["loss"].with_config(WRITE)  # an all-NaN row is a file too (`store.loss_chunks`)
        loss.resize((n + 1, *self.axes.shape))
        loss[n] = self._to_axes(grid, 1, undo=True).astype(loss.dtype)
        for name, value in (("step", step), ("checkpoint", checkpoint), ("lora_sha256", lora_sha256)):
            arr = self.group[name].with_config(WRITE)  # step 0, an empty sha (validation): files too
            arr.resize((n + 1,))
            arr[n] = value
        written = []
        for name in _PER_STEP:  # each array's metadata (its new shape) and its chunk of row n
            meta = self.group[name].metadata
            written += [f"{name}/zarr.json", f"{name}/{meta.encode_chunk_key((n,) + (0,) * (len(meta.shape) - 1))}"]
        self._commit(written)  # before this, readers still see n steps


_PER_STEP = ("loss", "step", "checkpoint", "lora_sha256")  # the arrays with one chunk per step


def _placement(group, axes: Axes) -> tuple[np.ndarray | None, np.ndarray | None]:
    """For each of `axes`' seeds and σ values, its index in the group's recorded axes (None: as recorded): the
    group's order is layout, its coordinates say which row is which. An earlier release recorded evaluate's seeds
    and σ in the configured order, and evaluate now computes them sorted (`EvaluateConfig.loss_axes`): such a
    group is read and appended to by value. Axes that are not the same values in another order are taken as
    recorded, by position (a validation curve's, whose settings do not hash its σ grid)."""
    placed = []
    for name, wanted in (("seed", axes.seeds), ("sigma", axes.sigmas)):
        recorded = group[name][:].tolist()
        if recorded == list(wanted) or sorted(recorded) != sorted(wanted):
            placed.append(None)
            continue
        index = np.empty(len(wanted), dtype=np.int64)  # the k-th of equal values to the k-th (stable sorts)
        index[np.argsort(wanted, kind="stable")] = np.argsort(recorded, kind="stable")
        placed.append(index)
    return placed[0], placed[1]


def _placed(grid: np.ndarray, place: tuple[np.ndarray | None, np.ndarray | None], seed_axis: int,
            undo: bool = False) -> np.ndarray:
    """A recorded grid (its seed axis at `seed_axis`, σ next) in the order `place` (`_placement`) gives; `undo`:
    one in that order in the group's."""
    for axis, index in enumerate(place, seed_axis):
        if index is not None:
            grid = grid.take(np.argsort(index) if undo else index, axis=axis)
    return grid


def _create_base(group, grid: np.ndarray) -> None:
    """The base grid in the dtype of the group's losses."""
    group.create_array("base_loss", data=grid.astype(group["loss"].dtype), fill_value=np.nan,
                       dimension_names=["sample", "seed", "sigma", "region"], overwrite=True, **_checked())


def _link_committed(group: Path, tmp: Path, but: str) -> None:
    """The committed group in `tmp`, but the array `but`: the root zarr.json (the commit) as it is, each array's
    metadata as the commit records it (not its own zarr.json: a killed append's resize, never committed, is
    there), and its chunk files hard-linked (zarr replaces a file by rename, never writes one in place). A chunk
    past a committed shape comes along unseen, as in the group."""
    root = (group / "zarr.json").read_bytes()
    (tmp / "zarr.json").write_bytes(root)
    for name, meta in json.loads(root)["consolidated_metadata"]["metadata"].items():
        if name == but:
            continue
        (tmp / name).mkdir(parents=True)
        (tmp / name / "zarr.json").write_text(json.dumps(meta))
        for folder, _, files in os.walk(group / name):
            for f in files:
                src = Path(folder, f)
                rel = src.relative_to(group)
                if rel == Path(name, "zarr.json") or _ZARR_TEMP.fullmatch(f):
                    continue
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                fmt.link_or_copy(src, tmp / rel)


_ZARR_TEMP = re.compile(r".*\.[0-9a-f]{32}\.partial")  # zarr's LocalStore: NAME.<uuid4 hex>.partial, then renamed


def _remove_killed_writes(group: Path) -> None:
    """zarr writes each file of the group as a temp file it then renames; a writer killed between left that file
    for good (the next append writes the file itself). Removed when the group is opened to be written, which its
    one writer does holding its folder's lock (evaluate: the report folder's; training: the run folder's), so no
    live write's temp file is taken."""
    if group.is_dir():
        for path in group.rglob("*.partial"):
            if _ZARR_TEMP.fullmatch(path.name):
                path.unlink(missing_ok=True)


def _fsync(group: Path, written: list[str]) -> None:
    """fsync these files of the group and every folder from theirs up to the group's (deepest first): a new
    file's or folder's entry, and a removal, are durable only through their folder. A file not there is
    skipped: a format-1 group's writers wrote no chunk that held only the fill value (step 0, an empty sha) and
    removed one that did (an append over a dropped step), which the folder's fsync makes durable."""
    folders: set[Path] = set()
    for rel in written:
        path = group / rel
        if path.is_file():
            atomic_write.fsync_dir(path)  # os.fsync works on a file's descriptor as on a folder's
        folders.update(group / p for p in Path(rel).parents)
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):
        if folder.is_dir():
            atomic_write.fsync_dir(folder)


def recorded_setting(folder: str | Path) -> tuple[str, dict] | None:
    """(fingerprint, settings) of the group at `folder/losses.zarr`; None when there is none or it is unreadable
    or of another format."""
    path = Path(folder) / GROUP
    if not path.exists():
        return None
    try:
        attrs = dict(_zarr().open_group(path, mode="r", use_consolidated=True).attrs)
    except Exception:  # noqa: BLE001 - unreadable: no setting to adopt, the next open replaces it
        return None
    if attrs.get("format") not in _READS or not isinstance(attrs.get("settings"), dict):
        return None
    return attrs.get("fingerprint"), attrs["settings"]


def recorded_base(folder: str | Path, fingerprint: str, axes: Axes) -> np.ndarray | None:
    """The base grid committed in `folder/losses.zarr` for this fingerprint, when its leading axes are `axes`'
    ([sample, seed, σ]) and every value was written, its seeds and σ in `axes`' order (`_placement`: a curve
    recorded in another order); None otherwise (no such group, none recorded, unreadable)."""
    shape = axes.shape[:3]
    path = Path(folder) / GROUP
    if not path.exists():
        return None
    try:
        g = _zarr().open_group(path, mode="r", use_consolidated=True)
        if g.attrs.get("format") not in _READS or g.attrs.get("fingerprint") != fingerprint or "base_loss" not in g:
            return None
        if g.attrs.get("format") == FORMAT and loss_chunks.absent(path, g):  # lost: computed again, set aside
            return None
        base = np.asarray(g["base_loss"][:], dtype=np.float64)
        if base.shape[:len(shape)] != tuple(shape):
            return None
        base = _placed(base, _placement(g, axes), 1)
    except Exception:  # noqa: BLE001 - unreadable: computed again (and the group replaced where it is opened)
        return None
    return base if not np.isnan(base).all() else None


def recorded_steps(folder: str | Path, fingerprint: str) -> dict[int, str] | None:
    """step -> LoRA sha256 committed in `folder/losses.zarr` for this fingerprint; None when there is no such group
    (or it is unreadable, or a chunk file of it is missing)."""
    return _steps_of(Path(folder) / GROUP, fingerprint)


def kept_groups(folder: str | Path, fingerprint: str, axes: Axes | None = None,
                spelled: Callable[[dict], bool] | None = None) -> Iterator[LossGroup]:
    """The groups kept aside beside `folder/losses.zarr` (`losses.<fingerprint[:12]>[.N].zarr`) recorded under
    exactly `fingerprint`, then (`spelled`: is a group's recorded settings an earlier spelling of these?) those
    recorded under another spelling of the same settings (an earlier release's: seeds and σ in the configured
    order, kept aside under that hash), of a format read here and (with `axes`) these samples, every chunk intact
    (a damaged one is never taken back), in the order an open with `take_back` tries them; lazily: each is read
    whole to be checked, and an open wants only the first."""
    named = sorted(Path(folder).glob(f"losses.{fingerprint[:12]}*.zarr"))
    others = [p for p in sorted(Path(folder).glob("losses.*.zarr")) if p not in named] if spelled else []
    for kept in named + others:
        try:
            group = LossGroup(kept, axes)
            attrs = group.group.attrs
            if kept in others and attrs.get("fingerprint") != fingerprint and not spelled(attrs.get("settings")):
                continue
            if attrs.get("format") not in _READS or (kept in named and attrs.get("fingerprint") != fingerprint) or \
                    (axes is not None and [str(k) for k in group.group["sample"][:]] != list(axes.keys)):
                continue
            _verify(group.group, kept)
        except Exception:  # noqa: BLE001 - a damaged kept group is left where it is, never taken back
            continue
        yield group


GRID = ("noise_seeds", "timesteps")  # the settings that only add or remove (seed, σ) cells of every grid


def same_but_grid(recorded: dict, settings: dict) -> bool:
    """Are two groups' settings the same but their seed / σ grid (`GRID`)? Then every (seed, σ) cell both hold is
    the same numbers: a row's loss depends on its sample, seed and σ alone (noise drawn from (seed, key); the
    batches of one cell, `models.held_out.loss_grid`)."""
    def but(s: dict) -> dict:
        return {**s, "evaluate": {k: v for k, v in dict(s.get("evaluate") or {}).items() if k not in GRID}}

    return isinstance(recorded, dict) and isinstance(recorded.get("evaluate"), dict) and but(recorded) == but(settings)


class CellDonor:
    """A group of the same setting but another seed / σ grid (`same_but_grid`): the (seed, σ) cells it shares
    with `seeds` x `sigmas` (`known`) are taken from it, by coordinates, and only the others are computed (one
    seed added to a grid: its cells alone, for the base and every checkpoint recorded there with the same bytes;
    one removed: nothing computed). Built from the group's index alone (its coordinates, steps and hashes; no
    losses read: `cell_donor` weighs every candidate so); its losses are read where a row is taken. It is only
    read: the group written is filled with whole rows, one commit each."""

    def __init__(self, group: LossGroup, seeds: list[int], sigmas: list[float]):
        self.path, self.group = group.path, group.group
        recorded = [int(s) for s in self.group["seed"][:]], [float(s) for s in self.group["sigma"][:]]
        self._seed = [recorded[0].index(s) if s in recorded[0] else -1 for s in seeds]
        self._sigma = [recorded[1].index(float(t)) if float(t) in recorded[1] else -1 for t in sigmas]
        self.known = np.array([[a >= 0 and b >= 0 for b in self._sigma] for a in self._seed], dtype=bool)
        self._steps: dict[int, str] | None = None  # read on first use (`_index`): a bound weighs it before

    @property
    def steps(self) -> dict[int, str]:
        """step -> LoRA sha256 of every row whose cells may be taken."""
        if self._steps is None:
            self._index()
        return self._steps  # type: ignore[return-value]

    def _index(self) -> None:
        n = self.group["step"].shape[0]
        steps = [int(s) for s in self.group["step"][:]] if n else []
        self._steps = dict(zip(steps, (str(h) for h in self.group["lora_sha256"][:]))) if n else {}
        self._rows = {s: i for i, s in enumerate(steps)}
        self._base = "base_loss" in self.group
        if self.group.attrs.get("format") == UNCHECKED:
            # an earlier release wrote no chunk that was all NaN: one absent is a lost file or a non-finite row,
            # which a group that writes every chunk would record as checked numbers; those rows are computed
            lost = loss_chunks.absent(self.path, self.group, loss_chunks.NUMBERS)
            self._base = self._base and not any(c.startswith("base_loss/") for c in lost)
            per = self.group["loss"].chunks[0]
            rows = {int(c.split("/")[2]) * per + j for c in lost if c.startswith("loss/") for j in range(per)}
            self._steps = {s: h for s, h in self._steps.items() if self._rows[s] not in rows}

    def bound(self, base: bool, rows: dict[int, str]) -> int:
        """The most `saves` can be, from the commit record and the coordinates alone (no step read)."""
        return int(self.known.sum()) * (int(base and "base_loss" in self.group) + len(rows))

    def saves(self, base: bool, rows: dict[int, str]) -> int:
        """The cells (per sample) a plan takes from here instead of computing them: the cells shared, for the
        base when the plan computes it (`base`) and for each of its checkpoints (`rows`: step -> sha256) recorded
        here with the same bytes."""
        served = int(base and self.has_base()) + sum(1 for step, sha in rows.items() if self.holds(step, sha))
        return int(self.known.sum()) * served

    def _fill(self, recorded: np.ndarray, computed: np.ndarray) -> np.ndarray:
        """`computed` ([sample, seed, σ, region] in `seeds` x `sigmas` order, NaN where not computed) with every
        known cell taken from `recorded` (the group's own order)."""
        out = np.array(computed, dtype=np.float64)
        for k, a in enumerate(self._seed):
            for t, b in enumerate(self._sigma):
                if a >= 0 and b >= 0:
                    out[:, k, t] = recorded[:, a, b]
        return out

    def base(self, computed: np.ndarray) -> np.ndarray:
        return self._fill(np.asarray(self.group["base_loss"][:], dtype=np.float64), computed)

    def has_base(self) -> bool:
        self.steps  # noqa: B018 - the index read (an earlier release's absent base chunk: no base)
        return self._base

    def holds(self, step: int, sha: str) -> bool:
        """Is this step recorded here with these LoRA bytes?"""
        return self.steps.get(step) == sha

    def step(self, step: int, computed: np.ndarray) -> np.ndarray:
        self.steps  # noqa: B018 - the index read
        return self._fill(np.asarray(self.group["loss"][self._rows[step]], dtype=np.float64), computed)


def cell_donor(folder: str | Path, settings: dict, seeds: list[int], sigmas: list[float],
               keys: list[str] | None, base: bool, rows: dict[int, str]) -> CellDonor | None:
    """The group at or kept aside beside `folder/losses.zarr` of these settings but another seed / σ grid
    (`same_but_grid`; one of these very settings is not: evaluate takes such a group back whole, or sets it aside
    as another run's), of these samples (`keys`; None: those the settings name, before the split is read), that
    saves this plan the most forwards (`CellDonor.saves`: the cells shared, for the base when it is computed
    (`base`) and for each checkpoint to evaluate (`rows`: step -> sha256) it records with those bytes; ties: the
    most cells shared, then the first found); None: none saves one. Each candidate is weighed by its index (the
    commit record and coordinates; its steps and hashes only where its bound can beat the best so far), and only
    the one picked is read whole and checked, every
    chunk intact (`_verify`; a damaged one gives no cell: the next is taken). An earlier release's group, which
    wrote no all-NaN chunk: not its rows whose chunk is absent. Before, every candidate was read whole on every
    plan and the one sharing the most cells was taken, whatever rows this plan needed of it."""
    candidates = []
    # the group in place too: before an evaluate of the grown grid sets it aside (its line says what is computed)
    for kept in [p for p in (Path(folder) / GROUP,) if p.exists()] + sorted(Path(folder).glob("losses.*.zarr")):
        try:
            group = LossGroup(kept)
            attrs = group.group.attrs
            # a group of these very settings kept aside is another run's (evaluate's rules: taken back whole or not)
            if attrs.get("format") not in _READS or attrs.get("settings") == settings or \
                    not same_but_grid(attrs.get("settings"), settings) or \
                    (keys is not None and [str(k) for k in group.group["sample"][:]] != list(keys)):
                continue
            candidates.append(CellDonor(group, seeds, sigmas))
        except Exception:  # noqa: BLE001 - unreadable: gives no cell
            continue
    # the most saved first (ties: the most cells shared, then the first found); a candidate whose bound cannot beat
    # the best so far is not indexed: several groups of one run's 500 checkpoints read the steps of one
    candidates.sort(key=lambda d: (-d.bound(base, rows), -int(d.known.sum())))
    while candidates:
        best, most = None, (0, 0)
        for donor in candidates:
            if (donor.bound(base, rows), int(donor.known.sum())) <= most:
                continue
            try:
                held = (donor.saves(base, rows), int(donor.known.sum()))
            except Exception:  # noqa: BLE001 - an unreadable index gives no cell
                held = (0, 0)
            if held[0] and held > most:
                best, most = donor, held
        if best is None:
            return None
        try:
            _verify(best.group, best.path)
            return best
        except Exception:  # noqa: BLE001 - a damaged group gives no cell: the next best
            candidates.remove(best)
    return None


def _steps_of(path: Path, fingerprint: str) -> dict[int, str] | None:
    if not path.exists():
        return None
    try:
        g = _zarr().open_group(path, mode="r", use_consolidated=True)
        if g.attrs.get("format") not in _READS or g.attrs.get("fingerprint") != fingerprint:
            return None
        if g.attrs.get("format") == FORMAT and loss_chunks.absent(path, g):
            return None  # a chunk lost: not up to date; the open for writing sets the group aside naming it
        n = g["step"].shape[0]
        return dict(zip((int(s) for s in g["step"][:n]), (str(h) for h in g["lora_sha256"][:n]))) if n else {}
    except Exception:  # noqa: BLE001 - unreadable: not up to date, the next append replaces it
        return None


def open_dataset(path: str | Path, say=None):
    """The group as an xarray Dataset (what the report and `pipeline compare` read), in step order: evaluate
    appends the newest checkpoints first (stages/evaluate/loss_pass.py), the step axis is in that order.
    A chunk file missing (format 2) is refused naming it; `say`: called with `unchecked`'s line for a format-1
    group lacking a chunk of losses."""
    import xarray as xr

    from schemas.errors import UserError

    path = Path(path)
    zarr = _zarr()
    folder = _folder(path)  # the group read: the same folder until the check is done (`_same_folder`)
    try:
        ds = xr.open_zarr(path, consolidated=True)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # json's JSONDecodeError is a ValueError
        # the commit record (root zarr.json) cut, overwritten or not a consolidated group: json's or zarr's traceback
        raise UserError(f"{path}: its zarr.json is damaged or not a loss array's ({type(e).__name__}: {e}); "
                        f"{loss_chunks.what_to_do(path)}") from None
    try:
        ds = ds.load()  # small (see `_verify`); a damaged chunk is found here, not as numbers in a page
        # checked after the load: a chunk absent while it was read is absent still. This commit is the one xarray
        # read or a later one (appends only add chunks, each written before its commit)
        group = zarr.open_group(path, mode="r", use_consolidated=True)
        if group.attrs.get("format") == FORMAT:
            loss_chunks.check(path, group)  # an absent chunk reads as NaN: refused before any number is used
        elif say is not None and (note := unchecked(path, group)) is not None:
            say(note)
    except ValueError as e:
        if (damage := _damage(e)) is None:
            raise
        _same_folder(path, folder)  # set aside and replaced meanwhile: not damage
        raise UserError(f"{path}: {damage}; restore the group from where it was copied (a partial copy), or "
                        f"{loss_chunks.what_to_do(path)}") from None
    _same_folder(path, folder)
    return ds.sortby("step") if ds.sizes.get("step") else ds


def _folder(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _same_folder(path: Path, folder: tuple[int, int] | None) -> None:
    """Refuse a group that an evaluate or training set aside (renamed) and replaced while it was read: xarray
    read the old commit's shapes and the new group's chunks (absent: NaN losses, step 0) without an error."""
    from schemas.errors import UserError

    if _folder(path) != folder:
        raise UserError(f"{path} was replaced while it was read (an evaluate or training writing it set it aside "
                        "and began another): rerun to read the group there now")
