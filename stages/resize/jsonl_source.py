"""The JSONL source's reader: one object per line, `target` (path), `controls` (or `control`), `caption` (or
`prompt`), optional `mask` (the layouts: sources.py); relative paths read within the manifest's folder. The file
as text (encoding, line endings, a JSON array saved as .jsonl) is checked in jsonl_text.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from stages.resize.folder_listing import _inside, named_on_disk
from stages.resize.jsonl_text import foreign_path_hint, manifest_lines
from stages.resize.sources import (DEFAULT_MAX_FILE_BYTES, IMAGE_SUFFIXES, Done, ReadProblem, SourceSample,
                                   printable, printable_names, read_heads, read_source_file, resumed_key)


def jsonl_files(source: Path) -> list[Path]:
    """The files a JSONL source's reader reads (for the listing hash): the manifest and the files it names."""
    manifest = jsonl_path(source)
    base = manifest.parent
    files, refused = {manifest}, set()
    for _, obj, _ in _jsonl_objects(manifest):
        if isinstance(obj, dict):
            for rel in _jsonl_paths(obj):
                f = _resolve(base, rel)
                # a picture many lines name (a shared control): judged once. A refusal is remembered with how it
                # was named: a relative path leaving the folder (a symlink out) is refused, the same file named
                # absolutely is read, and must be hashed
                judged = (f, os.path.isabs(rel))
                if f in files or judged in refused:
                    continue
                # what the reader would refuse is not hashed either (it is quarantined, never read)
                if f.is_file() and (judged[1] or _inside(f, base)):
                    files.add(f)
                else:
                    refused.add(judged)
    return sorted(files, key=lambda f: f.parts)  # Path order, compared in C (Path.__lt__ is Python: minutes)


def jsonl_path(p: Path) -> Path:
    return p if p.is_file() else sorted(p.glob("*.jsonl"))[0]


class _FieldTwice(ValueError):
    pass


def _fields_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose read field is given twice with two values: Python's json keeps the last, and the first
    (a target, a control, a caption) was dropped unsaid."""
    obj: dict[str, Any] = {}
    for name, value in pairs:
        if name in obj and name in _JSONL_FIELDS and obj[name] != value:
            raise _FieldTwice(f"field {name!r} is given twice on this line ({obj[name]!r}, then {value!r}): JSON "
                              "readers keep the last and drop the first; keep one")
        obj[name] = value
    return obj


def _jsonl_objects(path: Path) -> Iterator[tuple[int, object, str | None]]:
    """(line number, parsed object or None, error) per non-blank line."""
    for no, raw in manifest_lines(path):
        if not raw.strip():
            continue
        try:
            # a UTF-8 BOM before the first line (Windows editors, PowerShell 5's utf8) is not part of the JSON
            yield no, json.loads(raw.decode("utf-8-sig" if no == 1 else "utf-8"), object_pairs_hook=_fields_once), None
        except UnicodeDecodeError:
            yield no, None, "line is not valid UTF-8"
        except _FieldTwice as e:
            yield no, None, str(e)
        except json.JSONDecodeError as e:
            yield no, None, f"line is not valid JSON: {e.msg}"
        except RecursionError:  # arrays nested 100k deep: one bad line, not the run's traceback
            yield no, None, "line is not valid JSON: nested too deeply to read"
        except ValueError:  # a number of over 4300 digits (Python's int limit)
            yield no, None, "line is not valid JSON: holds a number with too many digits to read"


def _jsonl_controls(obj: dict) -> list:
    """`controls` (a list, or one path), else `control`. null is no controls: pandas' and HF datasets' `to_json`
    write a missing value as null (a text-to-image row of an edit dataset), not as an absent field."""
    ctrls = obj.get("controls")
    if ctrls is None:
        ctrls = obj.get("control")
    if ctrls is None:
        return []
    return ctrls if isinstance(ctrls, list) else [ctrls]


# The fields a JSONL line is read by. A field holding image paths under another name (`mask_path`, `control_images`,
# `source_image`) was passed over unsaid: the edit pair trained text-to-image, or without its mask.
_JSONL_FIELDS = ("target", "controls", "control", "caption", "prompt", "mask")


def _jsonl_field_problem(obj: dict, base: Path) -> str | None:
    """Why a line's fields would drop one of its images unread, or None. A field is passed whose paths are all read
    anyway (`image_path` or `file_name` beside `target`, as caption tools and converted datasets keep them) or name
    no file there (`original_filename`: a camera's name, provenance): no image of the line is dropped."""
    if obj.get("controls") is not None and obj.get("control") is not None:  # one of the two would be dropped
        return "both 'controls' and 'control' are given; keep one (controls: a list of paths)"
    caption, prompt = obj.get("caption"), obj.get("prompt")
    if caption is not None and prompt is not None and _text(caption) != _text(prompt):  # one was dropped unsaid
        return (f"both 'caption' ({_clipped(caption)}) and 'prompt' ({_clipped(prompt)}) are given and differ: one "
                f"would be trained on, the other dropped; keep the edit instruction under one of them")
    read = {os.path.normpath(_resolve(base, p)) for p in _jsonl_paths(obj)}
    for name, value in obj.items():
        paths = value if isinstance(value, list) else [value]
        # a URL (`"url": "https://.../a.jpg"`, a crawl's provenance) is never read as an image anyway
        if name in _JSONL_FIELDS or not paths or not all(
                isinstance(v, str) and v.lower().endswith(IMAGE_SUFFIXES) and "://" not in v for v in paths):
            continue
        if all(os.path.normpath(_resolve(base, v)) in read or not _resolve(base, v).is_file() for v in paths):
            continue
        meant = "mask" if "mask" in name.lower() else "controls"
        return (f"field {name!r} names image file(s) ({paths[0]}) but is not read (a line's fields: "
                f"{', '.join(_JSONL_FIELDS)}); rename it to {meant!r}, or drop it from the line")
    return None


def _text(value: object) -> object:
    return value.strip() if isinstance(value, str) else value


def _clipped(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _no_caption(obj: dict) -> str | None:
    """A line without caption or prompt, naming its text fields that are not read (`instruction`, `edit_prompt`:
    every line of such a manifest was quarantined with no word of the field that holds the text); None without
    any (then the missing caption is judged as every source's, stages/resize/judge.py)."""
    texts = [name for name, v in obj.items() if name not in _JSONL_FIELDS and isinstance(v, str) and v.strip()
             and not v.lower().endswith(IMAGE_SUFFIXES) and "://" not in v]
    if not texts:
        return None
    return (f"no 'caption' or 'prompt' field on this line; its text field(s) {', '.join(map(repr, texts[:4]))} are "
            f"not read: rename the one holding the edit instruction to 'caption'")


def _jsonl_paths(obj: dict) -> list[str]:
    paths = [obj.get("target"), *_jsonl_controls(obj), obj.get("mask")]
    return [p for p in paths if isinstance(p, str)]


def _resolve(base: Path, rel: str) -> Path:
    """A line's path: relative to the JSONL file's folder, as its folder spells it (`named_on_disk`: a name written
    in NFC on disk in NFD, or the other way round, was quarantined as "no such file")."""
    return named_on_disk(base / rel)  # (an absolute `rel` replaces `base`, as pathlib joins)


def iter_jsonl(root: Path, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               done: Done | None = None, known: Any = None) -> Iterator[SourceSample]:
    manifest = jsonl_path(root)
    base = manifest.parent
    for no, obj, err in _jsonl_objects(manifest):
        s = SourceSample(name=f"line{no}", source=f"{manifest}:{no}")
        if err is None and not isinstance(obj, dict):
            err = "line is not a JSON object"
        if err is None:
            err = _jsonl_field_problem(obj, base)
        if err is not None:
            s.problem = err
            yield s
            continue
        assert isinstance(obj, dict)
        if isinstance(obj.get("target"), str) and (
                key := resumed_key(done or {}, f"{manifest}:{no} ({obj['target']})")) is not None:
            s.source, s.done_key = f"{manifest}:{no} ({obj['target']})", key  # the source name it was written under
            yield s
            continue
        if known and _known_jsonl_sample(s, obj, f"{manifest}:{no}", base, known, max_file_bytes):
            yield s
            continue
        yield _read_jsonl_sample(s, obj, f"{manifest}:{no}", base, max_file_bytes)


def _jsonl_caption(obj: dict) -> object:
    return obj.get("caption") if obj.get("caption") is not None else obj.get("prompt")  # null: as absent


def _read_jsonl_sample(s: SourceSample, obj: dict, line: str, base: Path, max_file_bytes: int) -> SourceSample:
    def _read_ref(base: Path, rel: object, what: str) -> bytes:
        return _read_jsonl_ref(base, rel, what, max_file_bytes)

    try:
        s.target = _read_ref(base, obj.get("target"), "target")
        ctrls = _jsonl_controls(obj)
        s.files.append(str(_resolve(base, obj["target"])))
        for i, c in enumerate(ctrls):
            s.controls.append(_read_ref(base, c, f"controls[{i}]"))
            s.files.append(str(_resolve(base, c)))
        if obj.get("mask") is not None:
            s.mask = _read_ref(base, obj["mask"], "mask")
            s.files.append(str(_resolve(base, obj["mask"])))
    except ReadProblem as e:
        s.problem, s.problem_kind, s.unread = str(e), e.kind, e.unread and str(e.unread)
        return s
    s.source = f"{line} ({obj['target']})"
    text = _jsonl_caption(obj)
    if text is not None and not isinstance(text, str):
        s.problem = f"caption/prompt is not a string (got {type(text).__name__})"
    elif text is None and (unread := _no_caption(obj)) is not None:
        s.problem, s.problem_kind = unread, "missing-caption"
    # a JSON "\\udce9" (a lone surrogate) decodes to a str that is no text: its bytes fail the UTF-8 check
    s.caption = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else None
    return s


def _known_jsonl_sample(s: SourceSample, obj: dict, line: str, base: Path, known: Any, max_file_bytes: int) -> bool:
    """Fill `s` as a sample an earlier version holds, its files unchanged (known_sources.py), reading none of its
    files (the caption is in the line); False: read it whole."""
    rels = [obj.get("target"), *_jsonl_controls(obj)]
    mask = obj.get("mask")
    text = _jsonl_caption(obj)
    if not all(isinstance(r, str) and r for r in rels) or not (mask is None or isinstance(mask, str) and mask) \
            or not isinstance(text, str):
        return False
    source = f"{line} ({rels[0]})"
    if not known.recorded(printable(source)):
        return False

    def located(rel: str) -> tuple[Path, Path | None]:  # a relative path stays within the JSONL file's folder
        return _resolve(base, rel), None if Path(rel).is_absolute() else base

    caption = text.encode("utf-8", "surrogatepass")
    hit = known.get(printable(source), [located(r) for r in rels], None if mask is None else located(mask), caption)
    if hit is None:
        return False
    s.source, s.known, s.caption = source, hit, caption
    s.files = [str(_resolve(base, r)) for r in (*rels, *([mask] if mask is not None else []))]
    s.reread = partial(_reread_jsonl, s.name, s.source, obj, line, base, max_file_bytes)
    s.heads = partial(read_heads, [_resolve(base, r) for r in rels], None if mask is None else _resolve(base, mask))
    return True


def _reread_jsonl(name: str, source: str, obj: dict, line: str, base: Path, max_file_bytes: int) -> SourceSample:
    return printable_names(_read_jsonl_sample(SourceSample(name=name, source=line), obj, line, base, max_file_bytes))


def _read_jsonl_ref(base: Path, rel: object, what: str, max_file_bytes: int) -> bytes:
    if not isinstance(rel, str) or not rel:
        raise ReadProblem(f"field {what!r} is missing or not a path string")
    # a relative path stays within the JSONL file's folder; an absolute one is read where it points
    try:
        return read_source_file(_resolve(base, rel), None if Path(rel).is_absolute() else base, max_file_bytes, what)
    except ReadProblem as e:
        hint = foreign_path_hint(rel)
        if hint and not os.path.lexists(_resolve(base, rel)):
            raise ReadProblem(f"{e}; {rel!r} {hint}", e.kind, e.unread) from None
        raise
