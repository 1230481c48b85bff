"""A JSONL manifest as text, before any of its rows is read (jsonl_source.py reads them): its encoding, what ends its
lines, whether it is JSON Lines at all, and what to say about a path written for another machine. Each was a
manifest read as a million bad lines (a quarantine row each, then 'no usable sample') or a bare 'No such file or
directory', never naming the cause."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from schemas.errors import UserError
from stages.resize.caption_text import WIDE_BOMS

_HEAD = 1 << 16  # the bytes of a manifest looked at before it is read (encoding, line endings, layout)
# a compressed manifest under a .jsonl name (pandas' to_json(compression="gzip"), a download saved still encoded):
# read as text, every line of its bytes was a bad-source row ("not valid UTF-8"), never naming the cause
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz"}  # magic -> tool


def checked_manifest(path: Path) -> str:
    """'jsonl', or one line, before a store is made, when the manifest is no JSON Lines file a user can fix at once:
    UTF-16/32 (PowerShell 5's `>` and Out-File default), or one JSON value over the whole file (`json.dump` of the
    rows, pretty-printed or not). Read line by line, each of its lines was quarantined as invalid (a million rows for
    a million samples), then 'no usable sample', never naming the cause."""
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    if head.startswith(WIDE_BOMS):
        raise UserError(f"manifest {path} is UTF-16/UTF-32 (its byte order mark); save it as UTF-8 (PowerShell: "
                        "Out-File -Encoding utf8; Python: open(..., 'w', encoding='utf-8'))")
    for magic, tool in _COMPRESSED.items():
        if head.startswith(magic):
            raise UserError(f"manifest {path} is {tool}-compressed, not text; decompress it (e.g. `{tool} -dc {path} > "
                            f"{path.with_name(path.stem + '.plain.jsonl')}`) and pass that file")
    whole = _whole_file_json(head, complete=len(head) < _HEAD)
    if whole:
        convert = "jq -c '.[]' in.json > out.jsonl" if whole == "a JSON array" else "jq -c . in.json > out.jsonl"
        raise UserError(f"manifest {path} is {whole}, not JSON Lines (one object per line); convert it, e.g. "
                        f"{convert} (Python: one json.dumps(row) per line)")
    return "jsonl"


def _whole_file_json(head: bytes, complete: bool) -> str | None:
    """'a JSON array' / 'a JSON object spread over several lines' when the manifest's first line is the start of
    one JSON value going on past its line end, or an array of rows (rows are objects: a JSON Lines row is never an
    array of them). `complete`: `head` is the whole file."""
    lines = head.removeprefix(b"\xef\xbb\xbf").split(_line_end(head))  # the last one: not ended in `head`
    i = next((i for i, line in enumerate(lines) if line.strip()), 0)
    first = lines[i].strip()
    if first[:1] not in (b"[", b"{"):
        return None
    what = "a JSON array" if first[:1] == b"[" else "a JSON object spread over several lines"
    if i == len(lines) - 1 and not complete:  # a first line longer than the head: an array of rows on one line?
        return what if first.startswith(b"[") and first[1:].lstrip().startswith(b"{") else None
    try:
        text = first.decode("utf-8")
        value = json.loads(text)
    except json.JSONDecodeError as e:  # cut short at the line's end: the value goes on on the next line
        return what if e.pos >= len(text) else None
    except (ValueError, RecursionError):  # not UTF-8, or a line json cannot take: that line's own quarantine row
        return None
    return what if isinstance(value, list) and any(isinstance(v, dict) for v in value) else None


def _line_end(head: bytes) -> bytes:
    """What ends a manifest's lines, from its first bytes: LF (CRLF included), or CR in a file without LF."""
    return b"\r" if b"\r" in head and b"\n" not in head else b"\n"


def manifest_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) per line of a JSONL manifest, at LF (CRLF included); a manifest with CR and no LF in its
    first 64 KiB (classic Mac OS line endings, some spreadsheet exports) at CR: read at LF it was one bad line.
    JSON strings hold no raw CR (it is written \\r), so no caption is cut (nor a UTF-8 character: none but CR holds
    the byte 0x0D)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    if _line_end(head) == b"\r":
        # latin-1 maps each byte to one character and back: the lines' bytes, split at CR only
        with open(path, encoding="latin-1", newline="\r") as t:
            yield from enumerate((line.encode("latin-1") for line in t), start=1)
        return
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_WINDOWS_PATH = re.compile(r"^[A-Za-z]:[\\/]|\\")


def foreign_path_hint(rel: str) -> str | None:
    """What to do about a manifest path written for another machine: a URL (the manifest reader reads local files;
    Path() made `https://h/a.png` `<manifest folder>/https:/h/a.png`), or a Windows path (`C:\\x`, `a\\b.png`)."""
    if _URL.match(rel):
        return ("is a URL; manifest paths are local files: download the files and list their paths (relative to the "
                "manifest's folder, or absolute)")
    if _WINDOWS_PATH.search(rel):
        return ("is a Windows path; write it as a path on this machine, with forward slashes, relative to the "
                "manifest's folder (or absolute)")
    return None
