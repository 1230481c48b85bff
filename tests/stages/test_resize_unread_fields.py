"""A JSONL line that names an image under a field the reader does not read (`mask_path`, `control_images`), or
gives both `controls` and `control`: before, that image was passed over unsaid (the edit pair trained
text-to-image, or without its mask, and nothing in the output said so); now the line is quarantined naming the
field and what to rename it to."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_a_jsonl_field_naming_images_that_is_not_read_quarantines_its_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name, colour in (("t.png", (200, 0, 0)), ("c.png", (0, 200, 0)), ("m.png", (255, 255, 255))):
        (src / name).write_bytes(_png(colour))
    rows = [{"target": "t.png", "controls": ["c.png"], "mask_path": "m.png", "caption": "a mask under another name"},
            {"target": "t.png", "control_images": ["c.png"], "caption": "controls under another name"},
            {"target": "t.png", "controls": [], "control": "c.png", "caption": "controls given twice"},
            {"target": "t.png", "controls": ["c.png"], "mask": "m.png", "caption": "read whole", "id": "x.png.1",
             "width": 32, "tags": [], "url": "https://example.com/t.png"}]
    store = _resized(tmp_path, rows)
    kept = store.reader("images").manifest.to_pylist()
    assert [(r["caption"], r["num_controls"], r["has_mask"]) for r in kept] == [("read whole", 1, True)]
    quarantined = {r["source"].rsplit(":", 1)[1]: (r["reason"], r["detail"]) for r in store.quarantine().to_pylist()}
    assert quarantined == {
        "1": ("bad-source", "field 'mask_path' names image file(s) (m.png) but is not read (a line's fields: target, "
                            "controls, control, caption, prompt, mask); rename it to 'mask', or drop it from the line"),
        "2": ("bad-source", "field 'control_images' names image file(s) (c.png) but is not read (a line's fields: "
                            "target, controls, control, caption, prompt, mask); rename it to 'controls', or drop it "
                            "from the line"),
        "3": ("bad-source", "both 'controls' and 'control' are given; keep one (controls: a list of paths)")}


def test_a_field_whose_images_are_read_anyway_or_are_no_file_keeps_its_line(tmp_path):
    """Real manifests carry image names the line does not drop: the target's own path again (`image_path` of a
    caption tool, `file_name` of a converted image folder) or a provenance name that is no file there
    (`original_filename`). Quarantined, a whole dataset's lines were lost to a field that dropped nothing."""
    src = tmp_path / "src"
    src.mkdir()
    for name, colour in (("t.png", (200, 0, 0)), ("c.png", (0, 200, 0))):
        (src / name).write_bytes(_png(colour))
    rows = [{"target": "t.png", "controls": ["c.png"], "caption": "a caption tool's line", "image_path": "t.png",
             "file_name": "../src/t.png", "original_filename": "IMG_0001.JPG"}]
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(src / "m.jsonl"),
                                      "--store", str(tmp_path / "store"), "--set", "resize.target_area=4096",
                                      "--set", "resize.multiple=16"])
    assert result.exit_code == 0, result.output
    kept = Store(tmp_path / "store", create=False).reader("images").manifest.to_pylist()
    assert [(r["caption"], r["num_controls"]) for r in kept] == [("a caption tool's line", 1)]


def test_a_caption_and_a_prompt_that_differ_or_text_under_another_name_are_said(tmp_path):
    """`caption` beside a different `prompt` trained on the caption and dropped the prompt unsaid (a manifest whose
    `caption` describes the target and whose `prompt` is the edit instruction trained on descriptions); a line
    whose text is under `instruction` was `missing-caption` without naming the field that holds it."""
    src = tmp_path / "src"
    src.mkdir()
    for name, colour in (("t.png", (200, 0, 0)), ("c.png", (0, 200, 0))):
        (src / name).write_bytes(_png(colour))
    rows = [{"target": "t.png", "controls": ["c.png"], "caption": "a red square", "prompt": "make it red"},
            {"target": "t.png", "controls": ["c.png"], "caption": "the same text", "prompt": "the same text "},
            {"target": "t.png", "controls": ["c.png"], "instruction": "make it green", "id": "42"},
            {"target": "t.png", "controls": ["c.png"], "caption": None, "prompt": "make it blue"}]
    store = _resized(tmp_path, rows)
    kept = store.reader("images").manifest.to_pylist()
    assert sorted(r["caption"] for r in kept) == ["make it blue", "the same text"]
    quarantined = {r["source"].split(":")[1].split(" ")[0]: (r["reason"], r["detail"])
                   for r in store.quarantine().to_pylist()}
    assert quarantined == {
        "1": ("bad-source", "both 'caption' ('a red square') and 'prompt' ('make it red') are given and differ: one "
                            "would be trained on, the other dropped; keep the edit instruction under one of them"),
        "3": ("missing-caption", "no 'caption' or 'prompt' field on this line; its text field(s) 'instruction', "
                                 "'id' are not read: rename the one holding the edit instruction to 'caption'")}


def _resized(tmp_path: Path, rows: list[dict]) -> Store:
    """The store resize-bucket makes of `rows` as a JSONL source beside the pictures in tmp_path/src."""
    src = tmp_path / "src"
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(src / "m.jsonl"),
                                      "--store", str(tmp_path / "store"), "--set", "resize.target_area=4096",
                                      "--set", "resize.multiple=16"])
    assert result.exit_code == 0, result.output
    return Store(tmp_path / "store", create=False)
