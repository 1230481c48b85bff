"""Every chunk of a loss group is a file on disk: a chunk file lost (a damaged disk, a partial copy or rsync of a
run folder) read back as the fill value (NaN losses, step 0, an empty sha), which passed for a genuinely
non-finite step. zarr writes no chunk that holds only the fill value by default, so an absent file proved
nothing; groups of format 2 (`store.loss_array`) are written with `write_empty_chunks`, and then every chunk
inside the committed shapes (the consolidated metadata) must be there. Chunks past those shapes (a killed
append's, a dropped step's) are not looked at. One stat per chunk: four per step, a handful besides."""

from __future__ import annotations

import itertools
from pathlib import Path

WRITE = {"write_empty_chunks": True}  # zarr's array config for every write of a format-2 group
NUMBERS = ("loss", "base_loss")  # the arrays whose absent chunks read as NaN losses


class ChunkMissing(ValueError):
    """A chunk file inside a group's committed shape is not on disk (a ValueError, as zarr's checksum error)."""

    def __init__(self, group: Path, chunk: str, missing: int):
        self.group, self.chunk, self.missing = group, chunk, missing
        more = f", {missing - 1} more absent" if missing > 1 else ""
        super().__init__(f"chunk file {group / chunk} is missing{more}")


def absent(path: Path, group, names: tuple[str, ...] | None = None) -> list[str]:
    """The chunk files (relative to the group at `path`) inside the committed shape of each array of `group`
    (opened from the consolidated metadata), or of `names` only, that are not on disk, in array order."""
    out = []
    for name in sorted(group.array_keys()):
        if names is not None and name not in names:
            continue
        arr = group[name]
        for coords in itertools.product(*(range(n) for n in arr.cdata_shape)):
            key = arr.metadata.encode_chunk_key(coords)
            if not (path / name / key).is_file():
                out.append(f"{name}/{key}")
    return out


def check(path: Path, group) -> None:
    """Raise `ChunkMissing` naming the first absent chunk file of a group that writes every chunk."""
    if missing := absent(path, group):
        raise ChunkMissing(path, missing[0], len(missing))


def what_to_do(path: Path) -> str:
    """The remedy a line about a damaged group ends with: a report's evaluate computes its losses again, but
    RUN/losses.zarr is a training's validation curve, which no evaluate writes (the advice recomputed nothing)."""
    return (f"move {path} aside and rerun `pipeline run evaluate` for that report (its checkpoints are evaluated "
            "again); a training run's validation curve is not computed again: moved aside, a resumed training begins "
            "a new one")


def unchecked_note(path: Path, group) -> str | None:
    """For a group written before every chunk was (format 1): None when every chunk of its numbers is on disk,
    else one line saying that a lost file cannot be told from a step whose losses were all non-finite there."""
    missing = absent(path, group, NUMBERS)
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (f"{path}: no chunk file {path / missing[0]}{more}; this array was written by an earlier release, which wrote "
            "no chunk that was all NaN, so those losses read as NaN and a lost file cannot be told from a "
            f"non-finite checkpoint there: if files of it were lost, {what_to_do(path)}")
