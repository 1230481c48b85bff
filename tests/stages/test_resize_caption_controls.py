"""Control characters in captions (a NUL, BEL, an ESC colour sequence, a UTF-16 file without its byte order mark)
reached encode-text's tokenizer as text, and a printed caption's ESC sequence rewrote the terminal. They are
removed by the one caption rule every source format goes through (stages/resize/caption_text.py), the sample kept
and its conversions saying so; line endings become `\n`."""

from __future__ import annotations

import json
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

from test_resize_bucket import cfg, png, put, rgb
from stages.resize.caption_text import CONTROLS_REMOVED
from stages.resize.stage import run
from store import Store

DIRTY = {
    "nul": b"make\x00 it blue\x07",
    "ansi": b"\x1b[1;31mmake it red\x1b[0m",
    "utf16": "make it green".encode("utf-16-le"),  # no byte order mark: every other byte NUL, valid UTF-8
    "crlf": b"make it\r\nyellow\rnow",
    "only": b"\x00\x1b\x07 \x00",
}
CLEAN = {"nul": "make it blue", "ansi": "make it red", "utf16": "make it green", "crlf": "make it\nyellow\nnow"}


def _name(source: str) -> str:
    """The sample's name in DIRTY from its source: `target/nul.png`, `data.jsonl:1 (nul.png)`, `x.tar:nul`."""
    return next(n for n in DIRTY if f"/{n}.png" in source or f"({n}.png)" in source or source.endswith(f":{n}"))


def _rows(store: Path) -> dict[str, dict]:
    return {_name(r["source"]): r for r in Store(store).reader("images").manifest.to_pylist()}


def _folder(root: Path) -> None:
    for i, (name, caption) in enumerate(DIRTY.items()):
        put(root, name, png(rgb(64, 48, (10 * i, 100, 200))), caption=caption)


def _jsonl(root: Path) -> None:
    root.mkdir(parents=True)
    lines = []
    for i, (name, caption) in enumerate(DIRTY.items()):
        (root / f"{name}.png").write_bytes(png(rgb(64, 48, (10 * i, 100, 200))))
        # JSON's escapes hold any control character; a UTF-16 caption is NULs in the text
        lines.append(json.dumps({"target": f"{name}.png", "caption": caption.decode("utf-8")}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")


def _tar(root: Path) -> None:
    root.mkdir(parents=True)
    with tarfile.open(root / "shard-000.tar", "w") as tar:
        for i, (name, caption) in enumerate(DIRTY.items()):
            for suffix, data in ((".png", png(rgb(64, 48, (10 * i, 100, 200)))), (".txt", caption)):
                info = tarfile.TarInfo(f"{name}{suffix}")
                info.size = len(data)
                tar.addfile(info, BytesIO(data))


@pytest.mark.parametrize("write", [_folder, _jsonl, _tar], ids=["folder", "jsonl", "webdataset"])
def test_control_characters_are_removed_from_captions_in_every_format(tmp_path, write):
    root, store = tmp_path / "src", tmp_path / "store"
    write(root)
    s = run(cfg(), root, store)
    rows = _rows(store)
    assert {n: r["caption"] for n, r in rows.items()} == CLEAN
    assert {n for n, r in rows.items() if CONTROLS_REMOVED in r["conversions"]} == {"nul", "ansi", "utf16"}
    assert s.conversions[CONTROLS_REMOVED] == 3 and f"3x {CONTROLS_REMOVED}" in str(s)
    q = Store(store).quarantine().to_pylist()  # nothing but control characters: an empty caption
    assert [(_name(r["source"]), r["reason"]) for r in q] == [("only", "empty-caption")]


def test_a_caption_with_control_characters_is_the_same_sample_as_without_and_a_rerun_carries_it(tmp_path):
    """The key is of the cleaned caption: the same pair captioned `make it blue` and `make it blue\\x00` is one
    sample (a duplicate), and a rerun with a sample added carries the cleaned one unread (the known-sources check
    cleans as the stage does)."""
    root, store = tmp_path / "src", tmp_path / "store"
    target = png(rgb(64, 48))
    put(root, "a", target, caption=b"make it blue")
    put(root, "b", target, caption=b"make it blue\x00\x1b[0m")
    put(root, "c", png(rgb(48, 64, (0, 0, 200))), caption=b"\x1b[32mmake it green\x1b[0m\r\n")
    s = run(cfg(), root, store)
    assert s.written == 2 and s.quarantined == {"duplicate": 1}
    put(root, "d", png(rgb(64, 64, (0, 200, 0))), caption=b"make it red")
    s = run(cfg(), root, store)
    assert (s.written, s.reused) == (1, 2), str(s)
    captions = sorted(r["caption"] for r in Store(store).reader("images").manifest.to_pylist())
    assert captions == ["make it blue", "make it green", "make it red"]


@pytest.mark.parametrize("raw, kept", [
    ("Å\x9bcie", "Åcie"),  # Polish "ś" (C5 9B) read as Latin-1 then saved as UTF-8: a C1 char before a letter
    ("Ã\x9bber 1080p", "Ãber 1080p"),
    ("\u0645\u200d\u0645 \u200f\U0001F468\u200d\U0001F469 \u4e2d\u200b\u6587", None),  # ZWJ, RLM, ZWSP: not Cc
])
def test_only_the_control_characters_go_never_the_text_after_them(raw, kept):
    """A lone C1 character (U+009B here) is removed as every other control, not taken for a terminal's 8-bit CSI
    that swallows the letter after it (`Å\\x9bcie` lost its `c`); joiners and direction marks are text."""
    from stages.resize.caption_text import clean_caption

    assert clean_caption(raw.encode()) == (raw if kept is None else kept)


@pytest.mark.parametrize("raw, kept", [
    ("a red car\x0cparked", "a red car\nparked"),  # form feed: a page break between two lines
    ("wait\x85then go", "wait\nthen go"),  # NEL (next line; a cp1252 '…' read as Latin-1)
    ("blue\x0bsky", "blue\nsky"),
    ("cat\x1fdog", "cat dog"),  # unit separator: whitespace to str.split
])
def test_a_control_character_that_separates_words_leaves_them_apart(raw, kept):
    """The whitespace control characters (vertical tab, form feed, NEL, the separators) are line breaks or spaces,
    not nothing: removed, they glued two words into one the tokenizer reads ('carparked')."""
    from stages.resize.caption_text import clean_caption, had_controls

    assert clean_caption(raw.encode()) == kept and had_controls(raw.encode())
