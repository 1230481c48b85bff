"""One layout folder of a folder source (target/, control*/, mask/), listed with `os.scandir`: names and the file
type the directory entry already holds, so a plain file costs no stat and no realpath. Listing 200k entries with
`Path.iterdir` + `is_file()` + two `realpath` per file took minutes (measured in docs/resize-bucket.md).

Within `remembered()` (one resize-bucket run) each folder is scanned once and the scan is shared by the listing
hash, the sample count and the reader, which listed it three times before. Outside it nothing is kept.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tqdm import tqdm

from models.file_hashes import real_path


@dataclass
class Scan:
    """The non-dot entries of one folder, sorted by name (dotfiles are OS litter: .DS_Store, AppleDouble ._x)."""

    folder: Path
    names: list[str] = field(default_factory=list)
    not_files: set[str] = field(default_factory=set)  # folders, devices, broken links: no regular file behind
    links: set[str] = field(default_factory=set)  # symlinks: where they point is checked per link
    inside: bool = True  # the folder itself (symlinks resolved) lies within the source root

    def is_file(self, name: str) -> bool:
        return name not in self.not_files

    def inside_root(self, name: str, root: Path) -> bool:
        """`Path.is_relative_to` of the real path: a plain entry is where its folder is; a link is resolved."""
        if name in self.links:
            return _inside(self.folder / name, root)
        return self.inside


def stem_suffix(name: str) -> tuple[str, str]:
    """`PurePath.stem` and `.suffix` of a file name, without building a Path (a million of them)."""
    i = name.rfind(".")
    return (name[:i], name[i:]) if 0 < i < len(name) - 1 else (name, "")


_remembered: dict[str, Scan] | None = None
_real_folders: dict[str, str] | None = None  # folder -> its realpath, within remembered()


@contextmanager
def remembered() -> Iterator[None]:
    """Scans and folders' real paths found in this block are reused in it (one resize-bucket run: listing hash,
    count, reader)."""
    global _remembered, _real_folders
    outer = _remembered, _real_folders
    if _remembered is None:
        _remembered, _real_folders = {}, {}
    try:
        yield
    finally:
        _remembered, _real_folders = outer


def scan(folder: Path, root: Path) -> Scan:
    """The entries of `folder` (empty when it is no folder); `root` is the source, for the `inside` checks."""
    key = f"{folder}\0{root}"
    if _remembered is not None and key in _remembered:
        return _remembered[key]
    out = Scan(folder, inside=_inside(folder, root))
    if folder.is_dir():
        with os.scandir(folder) as entries, tqdm(desc=f"listing {folder.name}/", unit="file", leave=False,
                                                  mininterval=1.0) as bar:
            for e in entries:
                bar.update()
                if e.name.startswith("."):
                    continue
                out.names.append(e.name)
                if e.is_symlink():
                    out.links.add(e.name)
                if not _is_file(e):
                    out.not_files.add(e.name)
        out.names.sort()
    if _remembered is not None:
        _remembered[key] = out
    return out


def named_on_disk(path: Path) -> Path:
    """`path` as its folder spells it: a name written composed (NFC: a JSONL manifest made on Linux) while the file
    on disk is named decomposed (NFD: written on macOS, copied by rsync or unzipped), or the other way round, looked
    alike but was "no such file". A missing name (each missing folder on its path too) is matched in Unicode NFC
    against its folder's names, and taken when exactly one matches; otherwise `path` as given. A name that has one
    spelling (ASCII, CJK: NFC and NFD alike) costs nothing here."""
    text = str(path)
    if unicodedata.is_normalized("NFC", text) and unicodedata.is_normalized("NFD", text) or os.path.lexists(path):
        return path
    parent = path.parent
    if parent == path:
        return path
    parent = named_on_disk(parent)
    try:
        mtime = os.stat(parent).st_mtime_ns
    except OSError:
        return path
    matches = _names_by_nfc(str(parent), mtime).get(unicodedata.normalize("NFC", path.name), [])
    return parent / matches[0] if len(matches) == 1 else path


@lru_cache(maxsize=8)
def _names_by_nfc(folder: str, mtime_ns: int) -> dict[str, list[str]]:
    """A folder's names by their NFC form, listed once per folder and change (`mtime_ns`): a manifest of 100k
    lines naming files of one folder this way would otherwise list it once per line."""
    out: dict[str, list[str]] = {}
    try:
        for name in os.listdir(folder):
            out.setdefault(unicodedata.normalize("NFC", name), []).append(name)
    except OSError:
        pass
    return out


def _is_file(e: os.DirEntry) -> bool:
    """Follows a symlink, as Path.is_file (a stat only for links); a link loop is no file (DirEntry.is_file raises
    ELOOP where Path.is_file says False: a `ln -s a.png a.png` stopped the run with a traceback)."""
    try:
        return e.is_file()
    except OSError:
        return False


def _inside(path: Path, root: Path) -> bool:
    """Does `path`, symlinks and `..` resolved, lie within `root` (itself resolved)?"""
    real, base = _realpath(path), _real_folder(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _realpath(path: Path) -> str:
    """`os.path.realpath`, from the folder's remembered real path when `path` is no link (`real_path`: one lstat
    instead of one per path component, ten minutes over a million-line JSONL's three million files)."""
    return real_path(os.fspath(path) if isinstance(path, Path) else str(Path(path)), _real_folders)


def _real_folder(folder: Path) -> str:
    key = os.fspath(folder) if isinstance(folder, Path) else str(Path(folder))
    if _real_folders is None:
        return os.path.realpath(key)
    if key not in _real_folders:
        _real_folders[key] = os.path.realpath(folder)
    return _real_folders[key]
