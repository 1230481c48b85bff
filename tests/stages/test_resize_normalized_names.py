"""A folder source whose files spell one name in two Unicode forms: `café` composed (NFC: Linux, Windows) for the
target and decomposed (NFD: written on macOS, copied by rsync or unzipped) for its control, caption and mask. The
names look identical; before, they did not match: the pair trained text-to-image (or was quarantined for its
missing caption) and its control and mask were quarantined as orphans."""

from __future__ import annotations

import io
import unicodedata

from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_a_target_and_its_files_named_in_nfc_and_nfd_are_one_sample(tmp_path):
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    src = tmp_path / "src"
    for d in ("target", "control", "mask"):
        (src / d).mkdir(parents=True)
    (src / "target" / f"{nfc}.png").write_bytes(_png((200, 0, 0)))
    (src / "target" / f"{nfd}.txt").write_text("make it green")
    (src / "control" / f"{nfd}.png").write_bytes(_png((0, 200, 0)))
    (src / "mask" / f"{nfd}.png").write_bytes(_png((255, 255, 255)))
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(src), "--store", str(tmp_path / "st"),
                                      "--set", "resize.target_area=4096", "--set", "resize.multiple=16"])
    assert result.exit_code == 0, result.output
    store = Store(tmp_path / "st", create=False)
    rows = store.reader("images").manifest.to_pylist()
    assert [(r["caption"], r["num_controls"], r["has_mask"], r["source"]) for r in rows] == [
        ("make it green", 1, True, str(src / "target" / f"{nfc}.png"))]
    assert store.quarantine().to_pylist() == []


def test_a_jsonl_line_naming_files_in_nfc_reads_them_named_in_nfd(tmp_path):
    """A manifest written on Linux names `café/café.png` composed (NFC) while the files were written on macOS
    (folder and file named decomposed, NFD). Before: the line was quarantined as "no such file". Read under the
    files' real names; the sample keeps the line's spelling as its source."""
    import json

    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    src = tmp_path / "src"
    (src / nfd).mkdir(parents=True)
    (src / nfd / f"{nfd}.png").write_bytes(_png((200, 0, 0)))
    (src / f"{nfd}_ctrl.png").write_bytes(_png((0, 200, 0)))
    (src / "m.jsonl").write_text(json.dumps({"target": f"{nfc}/{nfc}.png", "controls": [f"{nfc}_ctrl.png"],
                                             "caption": "make it green"}, ensure_ascii=False) + "\n",
                                 encoding="utf-8")
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(src / "m.jsonl"), "--store",
                                      str(tmp_path / "st"), "--set", "resize.target_area=4096",
                                      "--set", "resize.multiple=16"])
    assert result.exit_code == 0, result.output
    store = Store(tmp_path / "st", create=False)
    assert store.quarantine().to_pylist() == []
    reader = store.reader("images")
    [row] = reader.manifest.to_pylist()
    assert (row["caption"], row["num_controls"]) == ("make it green", 1)
    files = reader.files(row["key"])
    assert Image.open(io.BytesIO(files["target.png"])).convert("RGB").getpixel((0, 0)) == (200, 0, 0)
    assert Image.open(io.BytesIO(files["control_0.png"])).convert("RGB").getpixel((0, 0)) == (0, 200, 0)


def test_a_jsonl_name_two_files_match_under_nfc_stays_unread(tmp_path):
    """Two files whose names differ only in their Unicode form: the line names neither exactly, and which one it
    meant is no guess to make; quarantined as missing, as before."""
    import json

    nfc, nfd = unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")
    mixed = "e\u0301" + nfc  # a third spelling of "éé" (NFC: two composed é); on disk: all-NFC and all-NFD
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{nfc}{nfc}.png").write_bytes(_png((200, 0, 0)))
    (src / f"{nfd}{nfd}.png").write_bytes(_png((0, 200, 0)))
    (src / "m.jsonl").write_text(json.dumps({"target": f"{mixed}.png", "caption": "x"}, ensure_ascii=False) + "\n",
                                 encoding="utf-8")
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(src / "m.jsonl"), "--store",
                                      str(tmp_path / "st"), "--set", "resize.target_area=4096",
                                      "--set", "resize.multiple=16"])
    store = Store(tmp_path / "st", create=False)
    [q] = store.quarantine().to_pylist()
    assert q["detail"] == f"target file {src / (mixed + '.png')} cannot be read: No such file or directory", result.output
