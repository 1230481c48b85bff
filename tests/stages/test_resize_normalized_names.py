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
