"""A caption's text as the stage keys and stores it (the instruction encode-text tokenizes): one function for every
source format (a folder's or tar's `.txt`, a JSONL line's field, a parquet cell all arrive as bytes), and for the
rerun's check of a known sample's caption (known_sources.py), so both agree on the key.

Control characters: a NUL, BEL or ESC reached the tokenizer as text and, printed (`store inspect`, a report, a
log), an ESC sequence recoloured or rewrote the terminal. They come from captioning scripts that logged coloured
output, a UTF-16 file without a byte order mark (every other byte NUL) or a crawl's junk. Line endings are made
`\n` (a Windows file's `\r\n`, a classic Mac file's `\r`, and VT, FF, NEL, FS, GS, RS; the unit separator a
space: words stay apart); an ANSI escape sequence (`ESC [ ... m`, an OSC title
`ESC ] ... BEL`) goes whole, not leaving `[31m` in the text; every other control character (Unicode category Cc:
C0, DEL, C1) but tab and newline goes. The sample is kept, its conversions say so (`CONTROLS_REMOVED`).
"""

from __future__ import annotations

import re
import unicodedata

CONTROLS_REMOVED = "control characters removed from the caption (NUL, ESC, ...: tab and newline kept)"
# a prompt's note line (`clean_prompt`), after the prompt's name
CONTROLS_REMOVED_NOTE = "control characters removed (NUL, ESC, ...: tab and newline kept), as from a caption"
# 7-bit sequences only: a U+009B in UTF-8 text is mojibake (a Latin-1 read of `ś`, C5 9B), not a terminal's 8-bit
# CSI, and taken for one it swallowed the letter after it; it goes alone, as every C1 character
_ESCAPE_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
_KEPT = "\t\n"


def clean_caption(raw: bytes) -> str:
    """The caption as the stage keys it: UTF-8 (UnicodeDecodeError otherwise), a BOM, control characters (above)
    and outer whitespace off."""
    return _without_controls(_text(raw)).strip()


# the byte order marks of UTF-16/32 text (UTF-32 LE's starts with UTF-16 LE's): one test for a caption and a manifest
WIDE_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\0\0\xfe\xff")


def not_utf8(raw: bytes, e: UnicodeDecodeError) -> str:
    """The quarantine line of a caption `clean_caption` cannot decode: a UTF-16/32 file (Windows Notepad's
    'Unicode', PowerShell 5's `>`) named by its byte order mark, as a JSONL manifest's is (jsonl_text.py); before,
    'not valid UTF-8 (byte 0)' left the cause unsaid."""
    if raw.startswith(WIDE_BOMS):
        return "caption is UTF-16/UTF-32 (its byte order mark), not UTF-8; re-save it as UTF-8"
    return f"caption is not valid UTF-8 (byte {e.start}); re-save it as UTF-8"


CAPTION_TOO_LONG = "caption-too-long"  # the quarantine reason
TOO_LONG_MARK = "over resize.max_caption_bytes"  # in `caption_too_long`'s line: a tar's problems tell it apart


def caption_too_long(where: str, size: int, limit: int) -> str:
    """The quarantine line of a caption over resize.max_caption_bytes (`where`: its file or tar member, "" for a
    field or cell: the row's source names it). Such a caption is no instruction (a log or a book named like one),
    and stored it bloated the images table and every version after it; encode-text refused it only later."""
    return (f"caption{' ' + where if where else ''} is {size} bytes, {TOO_LONG_MARK} ({limit}): a "
            "file named like a caption (a log, a whole text)? shorten it, or raise resize.max_caption_bytes if it "
            "is meant")


def clean_prompt(text: str) -> str:
    """A user's prompt (`pipeline predict --prompt`, a config's `evaluate.extra_prompts`, a negative prompt) by the
    caption's rule: its line endings and control characters as `clean_caption` makes them; its outer whitespace
    kept (a negative prompt of " " is the pipelines' default, not an empty one)."""
    return _without_controls(text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n"))


def had_controls(raw: bytes | None) -> bool:
    """Whether `clean_caption` removed control characters from this caption (for the sample's conversions)."""
    if raw is None:
        return False
    try:
        text = _text(raw)
    except UnicodeDecodeError:
        return False
    return _without_controls(text) != text


def _text(raw: bytes) -> str:
    return raw.decode("utf-8").lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _without_controls(text: str) -> str:
    if text.isprintable() or not any(unicodedata.category(c) == "Cc" and c not in _KEPT for c in text):
        return text
    text = _ESCAPE_SEQUENCE.sub("", text)
    return "".join(c if c in _KEPT or unicodedata.category(c) != "Cc" else _SEPARATING.get(c, "") for c in text)


# whitespace controls separate words: removed, "car\fparked" read as "carparked". The line breaks of
# str.splitlines (VT, FF, FS, GS, RS, NEL) become "\n", the unit separator a space
_SEPARATING = {**dict.fromkeys("\x0b\x0c\x1c\x1d\x1e\x85", "\n"), "\x1f": " "}
