"""The folder source's reader: `target/<stem>.*` with its caption `target/<stem>.txt`, controls `control/<stem>.*`,
`control_1/<stem>.*`, ..., an optional mask `mask/<stem>.*` (the layouts: sources.py). Every file no sample uses
is yielded as a record of its own, so it reaches the quarantine."""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from schemas.errors import UserError
from stages.resize.folder_listing import Scan, scan, stem_suffix
from stages.resize.sources import (CONTROL_DIR, DEFAULT_MAX_CAPTION_BYTES, DEFAULT_MAX_FILE_BYTES, IMAGE_SUFFIXES,
                                   Done, ReadProblem, SourceSample, not_regular, printable, printable_names,
                                   read_heads, read_source_file, resumed_key)


# Folders a user meant as control/ or mask/ but named otherwise (masks/, controls/, Control/, control1/,
# control-2/): never read, so an edit dataset trained text-to-image, or without its masks, with no word about it.
_NEAR_LAYOUT_DIR = re.compile(r"^(control|mask)s?(?:[-_ ]?(\d+))?$", re.IGNORECASE)


# Folders a user meant to hold the captions (which are read from target/<stem>.txt): never read, so each of their
# samples was `missing-caption` with no word of the folder
_CAPTION_DIR = re.compile(r"^(captions?|texts?|txts?|prompts?|instructions?)$", re.IGNORECASE)


def _near_miss(d: Path) -> str | None:
    """The layout folder `d` was surely meant to be (`mask`, `control`, `control_2`), when it is not one itself."""
    m = _NEAR_LAYOUT_DIR.match(d.name)
    if not m or d.name == "mask" or CONTROL_DIR.match(d.name):
        return None
    kind, index = m.group(1).lower(), int(m.group(2) or 0)
    return kind if kind == "mask" or index == 0 else f"control_{index}"


def control_folders(root: Path) -> dict[int, Path]:
    """control/ is index 0, control_<i>/ is index i. A folder named near these or mask/ is refused (_near_miss)."""
    out: dict[int, Path] = {}
    for d in sorted(root.iterdir()):
        m = CONTROL_DIR.match(d.name)
        if (m or d.name == "mask") and not d.is_dir():
            raise _not_a_layout_folder(root, d)
        if d.is_dir() and (meant := _near_miss(d)):
            raise UserError(f"source {root}: folder {d.name}/ is not read (the layout reads target/, control/, "
                            f"control_1/, ..., mask/); rename it to {meant}/, or move it out of the source")
        if d.is_dir() and m:
            i = int(m.group(1) or 0)
            if i in out:  # e.g. control/ + control_0/, control_1/ + control_01/: one would vanish unread
                raise UserError(f"source {root}: folders {out[i].name}/ and {d.name}/ both hold control {i} "
                                "(control/ is control 0, control_<i>/ is control i); merge or rename one")
            out[i] = d
    return out


def _not_a_layout_folder(root: Path, d: Path) -> UserError:
    """control/, control_<i>/ or mask/ that is no folder (a link to a disk not mounted, a file): listed as empty,
    every pair trained without its controls or masks and no row saying why."""
    kind = not_regular(d) or "a file"
    if kind == "a broken symlink":
        kind += f" to {os.readlink(d)}"
    return UserError(f"source {root}: {d.name} is {kind}, not a folder: its files are not read; make it the "
                     f"folder of those files (mount or fix the link), or remove it")


def _layout_dirs(root: Path) -> list[Path]:
    return [root / "target", *(d for _, d in sorted(control_folders(root).items())), root / "mask"]


def _stem(name: str) -> tuple[str, str]:
    """(the stem a sample's files are matched by, the suffix). The stem in Unicode NFC: the same name may be stored
    composed (`café`, NFC: Linux, Windows) or decomposed (`cafe` + U+0301, NFD: written on macOS, copied by rsync or
    unzipped), and a target and its control or caption spelt the two ways looked alike but parted: the pair trained
    text-to-image, its control quarantined as an orphan. The files keep their real names."""
    stem, suffix = stem_suffix(name)
    return unicodedata.normalize("NFC", stem), suffix


def _images_by_stem(sc: Scan, unsupported: dict[str, list[Path]], also: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Image file names by stem (`_stem`); every other entry (not an image, nor a suffix in `also`) goes to
    `unsupported`. Suffixes match in any case (`x.PNG`, `x.TXT`: cameras and Windows tools write them). Names, not
    Paths: a million Path objects were ~1 GB."""
    out: dict[str, list[str]] = {}
    for name in sc.names:
        stem, suffix = _stem(name)
        is_file = sc.is_file(name)
        if is_file and suffix.lower() in IMAGE_SUFFIXES:
            out.setdefault(stem, []).append(name)
        elif not (is_file and suffix.lower() in also):
            unsupported.setdefault(stem, []).append(sc.folder / name)
    return out


def _unsupported_message(root: Path, files: list[Path]) -> str:
    """The entries a sample cannot use: each no-file said as what it is (a `x.png` that is a broken link is not a
    wrong image type), the others with the types that are read."""
    odd = {f: kind for f in files if (kind := not_regular(f))}
    names = ", ".join(os.path.relpath(f, root) + (f" ({odd[f]})" if f in odd else "") for f in files)
    if set(odd.values()) == {"a folder"}:  # target/cats/*.png: a layout of nested folders, not a file gone wrong
        return (f"{names}: not a regular file, not read: a folder source is flat (target/<stem>.png, "
                f"control/<stem>.png, ...), its sub-folders are not read; move their files up into "
                f"{os.path.relpath(files[0].parent, root)}/ or remove them")
    if len(odd) == len(files):
        return f"{names}: not a regular file, not read; replace it with the file or remove it"
    return f"unsupported file(s) {names}: images must be one of {', '.join(IMAGE_SUFFIXES)} (captions target/<stem>.txt)"


@dataclass
class _FolderLayout:
    """A folder source as listed (nothing read): each folder's files by stem, and what no sample can use."""

    targets: dict[str, list[str]]
    captions: dict[str, list[str]]  # stem -> its caption file names (`x.txt`, `x.TXT`: either, not both)
    control_dirs: dict[int, Path]
    controls: dict[int, dict[str, list[str]]]
    masks: dict[str, list[str]]
    unsupported: dict[str, list[Path]]  # stem -> files the layout cannot use; they must not vanish
    caption_dirs: list[str]  # folders named for captions (`captions/`), not read: named by a missing caption's row

    @cached_property
    def captions_by_folded_stem(self) -> dict[str, list[str]]:
        """Caption file names by their stem's casefold: a missing caption's row names `a.txt` beside `A.png` (the
        same file on macOS and Windows, two on Linux). Built on the first missing caption only."""
        out: dict[str, list[str]] = {}
        for stem, names in self.captions.items():
            out.setdefault(stem.casefold(), []).extend(names)
        return out


def folder_layout(root: Path) -> _FolderLayout:
    unsupported: dict[str, list[Path]] = {}
    listed = scan(root / "target", root)
    targets = _images_by_stem(listed, unsupported, also=(".txt",))
    captions: dict[str, list[str]] = {}
    for name in listed.names:
        if listed.is_file(name) and (split := _stem(name))[1].lower() == ".txt":
            captions.setdefault(split[0], []).append(name)
    control_dirs = control_folders(root)
    controls = {i: _images_by_stem(scan(d, root), unsupported) for i, d in control_dirs.items()}
    masks = _images_by_stem(scan(root / "mask", root), unsupported)
    caption_dirs = sorted(d.name for d in root.iterdir() if _CAPTION_DIR.match(d.name) and d.is_dir())
    return _FolderLayout(targets, captions, control_dirs, controls, masks, unsupported, caption_dirs)


def _no_caption(layout: _FolderLayout, stem: str, target: str) -> str:
    """A missing caption's detail: the file it is read from, and a caption the layout does not read where one is
    (`target/x.png.txt`, stem `x.png`; a `captions/` folder)."""
    detail = f"no caption target/{stem}.txt for this sample"
    if layout.captions.get(target):
        return f"{detail}: target/{layout.captions[target][0]} is named for the stem {target!r}; rename it {stem}.txt"
    if near := layout.captions_by_folded_stem.get(stem.casefold()):
        return f"{detail}: target/{near[0]} differs from it in case only; rename it {stem}.txt"
    if layout.caption_dirs:
        return (f"{detail} (folder {', '.join(d + '/' for d in layout.caption_dirs)} is not read: a caption is the "
                f".txt beside its target, target/<stem>.txt; move the captions there)")
    return detail


def folder_leftovers(root: Path, layout: _FolderLayout) -> list[SourceSample]:
    """A record for each file that belongs to no target (it would otherwise vanish silently), after the targets'
    own: what `iter_folder` yields beyond one record per target, so the bar's total counts them too (it ran past
    its total into a count without one, losing its ETA)."""
    orphans: list[Path] = [root / "target" / n for stem, ns in layout.captions.items() if stem not in layout.targets
                           for n in ns]
    for i in sorted(layout.controls):
        orphans += [layout.control_dirs[i] / f for stem, fs in layout.controls[i].items() if stem not in layout.targets
                    for f in fs]
    orphans += [root / "mask" / f for stem, fs in layout.masks.items() if stem not in layout.targets for f in fs]
    out = [SourceSample(name=f.stem, source=str(f), problem="file has no matching target image in target/",
                        problem_kind="orphan-file") for f in orphans]
    for stem, fs in sorted(layout.unsupported.items()):
        if stem not in layout.targets:
            for f in fs:
                orphan = "" if f.is_dir() else " (and no matching target image in target/)"  # a folder's is said
                out.append(SourceSample(name=stem, source=str(f), problem=_unsupported_message(root, [f]) + orphan,
                                        problem_kind="unsupported-file"))
    return out


def iter_folder(root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, done: Done | None = None,
                known: Any = None, max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES) -> Iterator[SourceSample]:
    layout = folder_layout(root)
    targets, controls, control_dirs, masks = layout.targets, layout.controls, layout.control_dirs, layout.masks
    for stem in sorted(targets):
        s = SourceSample(name=stem, source=str(root / "target" / stem))
        found = [root / "target" / name for name in targets[stem]]
        if stem in layout.unsupported:
            s.source = str(found[0])
            s.problem, s.problem_kind = _unsupported_message(root, layout.unsupported[stem]), "unsupported-file"
            yield s
            continue
        if len(found) > 1:
            s.problem = f"several target files for one sample: {', '.join(f.name for f in found)}"
            yield s
            continue
        s.source = str(found[0])
        if len(masks.get(stem, ())) > 1:  # as several target or control files: which one is meant is unknown
            s.problem = f"several mask files in mask/: {', '.join(sorted(masks[stem]))}"
            yield s
            continue
        present = [i for i in sorted(controls) if stem in controls[i]]
        if present != list(range(len(present))):
            s.problem = f"control folders for this sample are not contiguous from control/: found indices {present}"
            yield s
            continue
        s.done_key = resumed_key(done or {}, s.source)
        if s.done_key is not None:
            yield s
            continue
        files = _FolderFiles(root, found[0], [[control_dirs[i] / name for name in controls[i][stem]] for i in present],
                             [root / "target" / name for name in layout.captions.get(stem, ())],
                             root / "mask" / masks[stem][0] if stem in masks else None, max_caption_bytes)
        if known and _known_folder_sample(s, files, known, max_file_bytes):
            yield s
            continue
        s = _read_folder_sample(s, files, max_file_bytes)
        if s.problem is None and s.caption is None:
            s.problem, s.problem_kind = _no_caption(layout, stem, found[0].name), "missing-caption"
        yield s
    yield from folder_leftovers(root, layout)


@dataclass(frozen=True)
class _FolderFiles:
    """The files of one folder sample, as listed (nothing read): controls in order, each its candidates."""

    root: Path
    target: Path
    controls: list[list[Path]]
    captions: list[Path]  # its caption files as listed (`x.txt`, `x.TXT`): none, one, or several (refused)
    mask: Path | None
    max_caption_bytes: int  # resize.max_caption_bytes: a larger caption file is refused from its size, unread


def _read_folder_sample(s: SourceSample, f: _FolderFiles, max_file_bytes: int) -> SourceSample:
    def read(path: Path, what: str) -> bytes:
        return read_source_file(path, f.root, max_file_bytes, what)

    try:
        s.target = read(f.target, "target")
        s.files.append(str(f.target))
        for cands in f.controls:
            if len(cands) > 1:
                raise ReadProblem(f"several control files in {cands[0].parent.name}/: {', '.join(c.name for c in cands)}")
            s.controls.append(read(cands[0], f"control {len(s.controls)}"))  # contiguous from 0: the folder's index
            s.files.append(str(cands[0]))
        if len(f.captions) > 1:
            raise ReadProblem(f"several caption files: {', '.join(c.name for c in f.captions)}; keep one")
        s.caption = read_source_file(f.captions[0], f.root, max_file_bytes, "caption",
                                     f.max_caption_bytes) if f.captions else None
        if f.mask is not None:
            s.mask = read(f.mask, "mask")
            s.files.append(str(f.mask))
    except ReadProblem as e:
        s.problem, s.problem_kind, s.unread = str(e), e.kind, e.unread and str(e.unread)
    return s


def _known_folder_sample(s: SourceSample, f: _FolderFiles, known: Any, max_file_bytes: int) -> bool:
    """Fill `s` as a sample an earlier version holds, its files unchanged (known_sources.py), reading only its
    caption; False (nothing read but perhaps the caption): read it whole."""
    if any(len(c) != 1 for c in f.controls) or not known.recorded(printable(s.source)) or len(f.captions) != 1:
        return False
    try:
        caption = read_source_file(f.captions[0], f.root, max_file_bytes, "caption", f.max_caption_bytes)
    except ReadProblem:
        return False
    images = [f.target, *(c[0] for c in f.controls)]
    hit = known.get(printable(s.source), [(p, f.root) for p in images], None if f.mask is None else (f.mask, f.root),
                    caption)
    if hit is None:
        return False
    s.known, s.caption = hit, caption
    s.files = [str(p) for p in (*images, *([f.mask] if f.mask is not None else []))]
    s.reread = partial(_reread_folder, s.name, s.source, f, max_file_bytes)
    s.heads = partial(read_heads, images, f.mask)
    return True


def _reread_folder(name: str, source: str, f: _FolderFiles, max_file_bytes: int) -> SourceSample:
    return printable_names(_read_folder_sample(SourceSample(name=name, source=source), f, max_file_bytes))

def folder_files(root: Path) -> list[Path]:
    """The files a folder source's reader reads (for the listing hash): a store or OS litter inside the source
    changes nothing. In Path order: by folder name, then file name (each scan is sorted)."""
    files = []
    for d in sorted(_layout_dirs(root), key=lambda d: d.name):
        sc = scan(d, root)
        files += [d / n for n in sc.names if sc.is_file(n) and sc.inside_root(n, root)]
    return files
