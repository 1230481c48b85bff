"""More hostile inputs through `pipeline run resize-bucket`, each found to stop the run with a traceback or to drop
or ignore data silently before: a file cut in its second frame, a symlink loop, misnamed control/mask folders, JSONL
lines Python's json cannot read, the macOS litter members of a tar made on a Mac; and, each read as bad lines or
files with no word of the cause: a UTF-16 manifest, a JSON array saved as .jsonl, CR line endings, URL and Windows
paths, upper-case caption extensions, and a dataset without any control."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from schemas.errors import UserError
from stages.resize.source_count import count_samples
from stages.resize.sources import detect_format
from store import Store


def _image(fmt: str = "PNG", frames: int = 1, seed: int = 0) -> bytes:
    """Noise (so that each frame's data is large and a cut lands inside it), `frames` frames."""
    rng = np.random.default_rng(seed)
    ims = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    ims[0].save(buf, format=fmt, **({"save_all": True, "append_images": ims[1:]} if frames > 1 else {}))
    return buf.getvalue()


def _resize(source: Path, store: Path):
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(source), "--store", str(store),
                                      "--set", "resize.target_area=4096", "--set", "resize.multiple=16"])
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def _quarantine(store: Path) -> dict[str, tuple[str, str]]:
    """source -> (reason, detail)."""
    return {r["source"]: (r["reason"], r["detail"]) for r in Store(store, create=False).quarantine().to_pylist()}


def _captions(store: Path) -> list[str]:
    return sorted(r["caption"] for r in Store(store, create=False).reader("images").manifest.to_pylist())


def _sample(root: Path, stem: str, data: bytes, ext: str = "png", caption: str = "make it blue") -> None:
    (root / "target").mkdir(parents=True, exist_ok=True)
    (root / "target" / f"{stem}.{ext}").write_bytes(data)
    (root / "target" / f"{stem}.txt").write_text(caption)


def test_a_file_cut_in_its_second_frame_is_a_corrupt_image_not_a_traceback(tmp_path):
    """Pillow counts frames by walking each frame's header: a GIF or TIFF cut there raised IndexError/TypeError
    outside the decoder's checks, which ended the whole run (workers: 0) with a traceback."""
    src = tmp_path / "src"
    _sample(src, "good", _image(), caption="good")
    gif, tif = _image("GIF", 4), _image("TIFF", 4)
    _sample(src, "cutgif", gif[: len(gif) // 2], "gif")
    _sample(src, "cuttif", tif[: len(tif) // 3], "tif")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = _quarantine(tmp_path / "store")
    assert {Path(s).name: r for s, (r, _) in q.items()} == {"cutgif.gif": "corrupt-image", "cuttif.tif": "corrupt-image"}
    assert all("truncated or corrupt image data" in d for _, d in q.values())
    assert _captions(tmp_path / "store") == ["good"]


def test_a_symlink_loop_and_other_non_files_are_quarantined_as_what_they_are(tmp_path):
    """`ln -s a.png a.png` in target/ stopped the run with 'Too many levels of symbolic links' (os.DirEntry.is_file
    raises where Path.is_file says False); and every non-file `x.png` was detailed as a wrong image type."""
    src = tmp_path / "src"
    _sample(src, "good", _image(), caption="good")
    t = src / "target"
    os.symlink("loop.png", t / "loop.png")
    os.symlink("nowhere.png", t / "broken.png")
    (t / "folder.png").mkdir()
    os.mkfifo(t / "fifo.png")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = {Path(s).name: v for s, v in _quarantine(tmp_path / "store").items()}
    for name, kind in {"loop.png": "a symlink loop", "broken.png": "a broken symlink", "folder.png": "a folder",
                       "fifo.png": "a FIFO"}.items():
        reason, detail = q[name]
        assert reason == "unsupported-file" and f"target/{name} ({kind}): not a regular file" in detail, (name, detail)
    assert _captions(tmp_path / "store") == ["good"]


@pytest.mark.parametrize("folder, meant", [("masks", "mask"), ("Mask", "mask"), ("controls", "control"),
                                           ("control1", "control_1"), ("Control-2", "control_2")])
def test_a_misnamed_control_or_mask_folder_is_refused_before_a_store_is_made(tmp_path, folder, meant):
    """masks/ or controls/ next to target/ were never read: an edit dataset was trained text-to-image, or without
    its masks, and nothing said so (no quarantine row, no summary line for masks)."""
    src = tmp_path / "src"
    _sample(src, "a", _image())
    (src / folder).mkdir()
    (src / folder / "a.png").write_bytes(_image(seed=1))
    result = _resize(src, tmp_path / "store")
    assert result.exit_code != 0
    assert f"folder {folder}/ is not read" in result.output and f"rename it to {meant}/" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("name, make, kind", [
    ("control", lambda p: os.symlink("/mnt/unmounted/control", p), "a broken symlink to /mnt/unmounted/control"),
    ("control_1", lambda p: os.symlink(p.name, p), "a symlink loop"),
    ("mask", lambda p: p.write_bytes(b"not a folder"), "a file"),
])
def test_a_layout_folder_that_is_no_folder_is_refused_before_a_store_is_made(tmp_path, name, make, kind):
    """control/ linked to a disk not mounted (or mask/ a file, control_1/ a link loop) was listed as empty: every
    pair trained text-to-image, or without its masks, with no row saying why. Refused as a misnamed folder is."""
    src = tmp_path / "src"
    _sample(src, "a", _image())
    make(src / name)
    result = _resize(src, tmp_path / "store")
    assert result.exit_code != 0 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"source {src}: {name} is {kind}, not a folder: " in result.output, result.output
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("name, make, kind", [
    ("b.tar", os.mkfifo, "a FIFO"),  # hashing it (and reading it) waited forever for a writer
    ("b.tar", lambda p: os.symlink("/dev/zero", p), "a device"),  # hashing it never ended
    ("b.jsonl", os.mkfifo, "a FIFO"),
    ("b.parquet", lambda p: os.symlink("/mnt/unmounted/b.parquet", p), "a broken symlink to /mnt/unmounted/b.parquet"),
])
def test_a_source_file_that_is_no_regular_file_is_refused_in_one_line(tmp_path, name, make, kind):
    """A shard, manifest or parquet file of a source folder that is a FIFO or a device (the run hung), or a parquet
    file linked to a disk not mounted (skipped unsaid: its rows lost), is refused naming what it is. A folder named
    `x.parquet` (Spark's layout: the part files inside are read) and a broken `.tar` link (its own bad-source row)
    are not."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.tar").write_bytes(b"") if name.endswith(".tar") else None
    make(src / name)
    with pytest.raises(UserError) as e:
        detect_format(src)
    assert str(e.value) == f"source {src}: {name} is {kind}, not a regular file: not read; replace it with the " \
                           "file or remove it", str(e.value)
    with pytest.raises(UserError) as named:  # passed as the source itself: "does not exist" before
        detect_format(src / name)
    assert str(named.value) == str(e.value)
    (src / name).unlink()
    (src / "spark.parquet").mkdir()
    os.symlink("nowhere.tar", src / "c.tar")
    assert detect_format(src) == "webdataset"


def test_jsonl_lines_json_cannot_take_cost_their_line_only(tmp_path):
    """A 5000-digit number (Python's int limit), arrays nested 100k deep (RecursionError) and a path holding
    '\\u0000' (ValueError from the OS call) each ended the run with a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_image())
    lines = [json.dumps({"target": "a.png", "caption": "fine"}),
             '{"target": "a.png", "caption": "long number", "id": ' + "7" * 5000 + "}",
             "[" * 100_000 + "]" * 100_000,
             json.dumps({"target": "a\u0000.png", "caption": "nul"})]
    (src / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = {s.split(":")[1]: v for s, v in _quarantine(tmp_path / "store").items()}
    assert q == {"2": ("bad-source", "line is not valid JSON: holds a number with too many digits to read"),
                 "3": ("bad-source", "line is not valid JSON: nested too deeply to read"),
                 "4": ("bad-source", f"target path {str(src / 'a') + chr(0) + '.png'!r} holds a NUL character: no "
                                     "file has such a name; fix the path")}
    assert _captions(tmp_path / "store") == ["fine"]


def test_a_jsonl_field_given_twice_costs_its_line_not_its_first_value(tmp_path):
    """`{"target": "a.png", ..., "target": "b.png"}` (a line joined from two, a hand edit): json keeps the last,
    so b trained and a was dropped with no row. The line is quarantined naming the field; a field repeated with
    the same value, or a field no reader reads, drops nothing and is read as before."""
    src = tmp_path / "src"
    src.mkdir()
    for name, seed in (("a.png", 0), ("b.png", 1), ("c.png", 2)):
        (src / name).write_bytes(_image(seed=seed))
    lines = ['{"target": "a.png", "caption": "first", "target": "b.png"}',
             '{"target": "c.png", "caption": "same twice", "caption": "same twice", "id": 1, "id": 2}']
    (src / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = {s.split(":")[1]: v for s, v in _quarantine(tmp_path / "store").items()}
    assert q == {"1": ("bad-source", "field 'target' is given twice on this line ('a.png', then 'b.png'): JSON "
                                     "readers keep the last and drop the first; keep one")}
    assert _captions(tmp_path / "store") == ["same twice"]


def test_a_tar_made_on_a_mac_reads_as_the_same_tar_without_its_litter(tmp_path):
    """macOS tar writes an AppleDouble `._x` member before every file with extended attributes (a downloaded
    one), and `.DS_Store`: they split each sample's run of members in two, so the whole shard was quarantined
    (target without caption, caption without target). They are ignored as a folder source's dotfiles are."""
    members = []
    for i in range(3):
        members += [(f"d/s{i}.png", _image(seed=i)), (f"d/s{i}.txt", f"caption {i}".encode()),
                    (f"d/s{i}.control.png", _image(seed=10 + i))]

    def shard(folder: Path, litter: bool) -> None:
        folder.mkdir()
        with tarfile.open(folder / "a.tar", "w") as tf:
            for name, data in ([("d/.DS_Store", b"\0\0\0\1Bud1")] if litter else []) + members:
                d, _, base = name.rpartition("/")
                for n, b in ([(f"{d}/._{base}", b"\0\5\26\7" + b"\0" * 60)] if litter else []) + [(name, data)]:
                    info = tarfile.TarInfo(n)
                    info.size = len(b)
                    tf.addfile(info, io.BytesIO(b))

    shard(tmp_path / "clean", litter=False)
    shard(tmp_path / "mac", litter=True)
    assert count_samples(tmp_path / "mac", "webdataset") == 3  # the bar's total
    for name in ("clean", "mac"):
        result = _resize(tmp_path / name, tmp_path / f"store-{name}")
        assert result.exit_code == 0, result.output
        assert _quarantine(tmp_path / f"store-{name}") == {}
        assert _captions(tmp_path / f"store-{name}") == ["caption 0", "caption 1", "caption 2"]
    keys = [sorted(r["key"] for r in Store(tmp_path / f"store-{n}", create=False).reader("images").manifest.to_pylist())
            for n in ("clean", "mac")]
    assert keys[0] == keys[1]


def test_a_utf16_manifest_is_one_line_naming_its_encoding(tmp_path):
    """PowerShell 5 writes `>` and Out-File as UTF-16: each line was quarantined as 'not valid UTF-8' (a row per
    line, a million for a million samples), then 'no usable sample', never naming the encoding."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_image())
    (src / "data.jsonl").write_bytes((json.dumps({"target": "a.png", "caption": "fine"}) + "\r\n").encode("utf-16"))
    result = _resize(src, tmp_path / "store")
    assert result.exit_code != 0
    assert f"manifest {src / 'data.jsonl'} is UTF-16/UTF-32 (its byte order mark); save it as UTF-8" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "store").exists()


@pytest.mark.parametrize("packed", ["gzip", "bz2", "lzma"])
def test_a_compressed_manifest_under_a_jsonl_name_is_one_line_saying_to_decompress_it(tmp_path, packed):
    """pandas' `to_json(..., compression="gzip")` or a download saved still encoded, named .jsonl: every line of its
    bytes was quarantined as 'not valid UTF-8' (~400k rows for a 100 MB file), then 'no usable sample'."""
    import importlib

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_image())
    rows = "".join(json.dumps({"target": "a.png", "caption": f"edit {i}"}) + "\n" for i in range(200)).encode()
    (src / "data.jsonl").write_bytes(importlib.import_module(packed).compress(rows))
    result = _resize(src, tmp_path / "store")
    tool = {"gzip": "gzip", "bz2": "bzip2", "lzma": "xz"}[packed]
    assert result.exit_code != 0
    assert f"manifest {src / 'data.jsonl'} is {tool}-compressed, not text; decompress it (e.g. `{tool} -dc" \
        in " ".join(result.output.split())
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("layout", ["pretty array", "one-line array", "pretty object"])
def test_a_json_array_saved_as_jsonl_is_one_line_saying_how_to_convert(tmp_path, layout):
    """`json.dump(rows, f, indent=2)` (or one object spread over lines) saved as .jsonl: each of its lines was
    quarantined as not valid JSON (a row per line), then 'no usable sample', never saying the file is no JSON Lines."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_image())
    rows = [{"target": "a.png", "caption": "one"}, {"target": "a.png", "caption": "two"}]
    text = {"pretty array": json.dumps(rows, indent=2), "one-line array": json.dumps(rows),
            "pretty object": json.dumps(rows[0], indent=4)}[layout]
    (src / "data.jsonl").write_text(text + "\n")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code != 0
    what = "a JSON object spread over several lines" if layout == "pretty object" else "a JSON array"
    assert f"manifest {src / 'data.jsonl'} is {what}, not JSON Lines (one object per line)" in result.output, result.output
    assert "jq -c" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "store").exists()


@pytest.mark.parametrize("text, refused", [
    (json.dumps({"target": "a.png", "caption": "x" * 100_000}) + "\n{}\n", False),  # a first row over the 64 KiB looked at
    ("[1, 2]\n" + json.dumps({"target": "a.png"}) + "\n", False),  # a bad first row: its own quarantine row
    (json.dumps({"target": "a.png", "caption": "\u00e9" * 9}, ensure_ascii=False) + "\n", False),
    (json.dumps([{"target": "a.png", "caption": "x" * 100}] * 2000), True),  # one line over 64 KiB
    ("\ufeff\n\n  " + json.dumps([{"target": "a.png"}], indent=2).replace("\n", "\r\n"), True),
], ids=["long first row", "bad first row", "non-ascii row", "long one-line array", "bom, blank lines, crlf"])
def test_only_a_manifest_that_is_one_json_value_is_refused(tmp_path, text, refused):
    path = tmp_path / "data.jsonl"
    path.write_text(text, encoding="utf-8", newline="")
    if refused:
        with pytest.raises(UserError, match="is a JSON array, not JSON Lines"):
            detect_format(path)
    else:
        assert detect_format(path) == "jsonl"


def test_a_manifest_with_classic_mac_line_endings_reads_line_by_line(tmp_path):
    """CR-only line endings (classic Mac OS, some spreadsheet exports) read as one line holding every row: one
    'not valid JSON' row and 'no usable sample'. JSON strings hold no raw CR, so CR ends a line as LF does."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_image())
    (src / "b.png").write_bytes(_image(seed=1))
    rows = [{"target": "a.png", "caption": "first\rline"}, {"target": "b.png", "caption": "second"}, {"target": "c.png"}]
    (src / "data.jsonl").write_bytes(("\r".join(json.dumps(r) for r in rows) + "\r").encode())
    assert count_samples(src / "data.jsonl", "jsonl") == 3
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    # the escaped CR kept in its caption, as its line break (a caption's line endings are made \n: caption_text.py)
    assert _captions(tmp_path / "store") == ["first\nline", "second"]
    q = _quarantine(tmp_path / "store")
    assert list(q) == [f"{src / 'data.jsonl'}:3"] and "c.png cannot be read" in q[f"{src / 'data.jsonl'}:3"][1], q


def test_url_and_windows_paths_in_a_manifest_say_what_to_do(tmp_path):
    """A manifest written for another machine (URLs, `C:\\data\\a.png`, `imgs\\a.png`) got 'No such file or
    directory' on a mangled path (`/src/https:/host/a.png`), with no word that the reader reads local files only."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.png").write_bytes(_image())
    paths = ["a.png", "https://example.com/a.png", "s3://bucket/a.png", "C:\\data\\a.png", "imgs\\a.png"]
    lines = [json.dumps({"target": p, "caption": "x"}) for p in paths]
    lines.append(json.dumps({"target": "a.png", "controls": ["http://example.com/c.png"], "caption": "y"}))
    (src / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = {s.split(":")[-1]: d for s, (_, d) in _quarantine(tmp_path / "store").items()}
    url = "is a URL; manifest paths are local files: download the files and list their paths"
    win = "is a Windows path; write it as a path on this machine, with forward slashes"
    assert url in q["2"] and "https://example.com/a.png" in q["2"], q
    assert url in q["3"] and url in q["6"] and "controls[0]" in q["6"], q
    assert win in q["4"] and win in q["5"], q
    assert sorted(q) == ["2", "3", "4", "5", "6"] and _captions(tmp_path / "store") == ["x"]


def test_caption_extensions_match_as_image_extensions_do_regardless_of_case(tmp_path):
    """`x.PNG` is an image but `x.TXT` was an 'unsupported file' that quarantined its sample (and an orphan `z.TXT`
    was no orphan): a caption's extension is matched without case too."""
    src = tmp_path / "src"
    (src / "target").mkdir(parents=True)
    t = src / "target"
    (t / "x.PNG").write_bytes(_image())
    (t / "x.TXT").write_text("upper")
    (t / "y.png").write_bytes(_image(seed=1))
    (t / "y.Txt").write_text("mixed")
    (t / "w.png").write_bytes(_image(seed=2))
    (t / "w.txt").write_text("lower")
    (t / "w.TXT").write_text("twice")
    (t / "z.TXT").write_text("no picture")
    assert count_samples(src, "folder") == 4  # the bar's total: 3 targets and the orphan z.TXT's record
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    assert _captions(tmp_path / "store") == ["mixed", "upper"]
    q = {Path(s).name: v for s, v in _quarantine(tmp_path / "store").items()}
    assert q["w.png"][0] == "bad-source" and "several caption files: w.TXT, w.txt" in q["w.png"][1], q
    assert q["z.TXT"][0] == "orphan-file" and len(q) == 2, q


def test_a_dataset_without_any_control_gets_the_text_to_image_note(tmp_path):
    """The note that 0-control samples train text-to-image was printed only when counts were mixed: an edit
    dataset whose control/ folder was left behind said just 'controls per sample: 0: 2'."""
    src = tmp_path / "src"
    _sample(src, "a", _image())
    _sample(src, "b", _image(seed=1))
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    assert ("controls per sample: 0: 2; samples without a control train text-to-image (resize.min_controls: 1 "
            "quarantines them)") in result.output, result.output


def test_a_folder_sources_bar_total_counts_the_files_no_target_claims(tmp_path):
    """The bar's total counted the targets alone, while the reader yields one more record per file no target
    claims (a caption without its picture, a control or mask of no target, a sub-folder, an unsupported file):
    the bar ran past its total into a count without one (`8/8`, then `9sample [...]`, its ETA gone)."""
    from stages.resize.folder_source import iter_folder

    src = tmp_path / "src"
    for stem in ("a", "b", "c"):
        _sample(src, stem, _image(seed=len(stem)))
    (src / "target" / "gone.txt").write_text("a caption whose picture was not downloaded")
    (src / "target" / "cats").mkdir()
    (src / "target" / "d.heic").write_bytes(b"not read")
    (src / "control").mkdir()
    (src / "control" / "a.png").write_bytes(_image())
    (src / "control" / "lost.png").write_bytes(_image())
    (src / "mask").mkdir()
    (src / "mask" / "lost2.png").write_bytes(_image())
    records = list(iter_folder(src))
    assert len(records) == 3 + 5 and count_samples(src, "folder") == len(records)


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb needs no more)."""
    import zlib

    data = bytearray(_image())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # the IHDR checksum kept valid
    return bytes(data)


def test_hostile_control_caption_and_header_files_each_end_in_one_line_or_are_read_right(tmp_path):
    """A folder source's hostile files: a control that is a symlink loop or 0 bytes, a PNG named .jpg, a header
    claiming 10 Gpx (over Pillow's own hard limit), a UTF-16 caption with its BOM, a control that is its target's own
    file. Before: the bomb's line was Pillow's, naming its limit (178956970, no setting) and not
    resize.max_image_pixels; the UTF-16 caption's said 'not valid UTF-8 (byte 0)', not what it is."""
    src = tmp_path / "src"
    _sample(src, "good", _image(), caption="good")
    (src / "control").mkdir()
    (src / "control" / "good.png").write_bytes(_image(seed=1))
    _sample(src, "loop", _image(seed=2))
    os.symlink("loop.png", src / "control" / "loop.png")
    _sample(src, "zero", _image(seed=3))
    (src / "control" / "zero.png").write_bytes(b"")
    _sample(src, "liar", _image(seed=4), ext="jpg", caption="named jpg")  # PNG bytes: read by content
    _sample(src, "honest", _image(seed=4), caption="named png")
    _sample(src, "bomb", _png_claiming(100_000, 100_000))
    _sample(src, "utf16", _image(seed=5))
    (src / "target" / "utf16.txt").write_bytes("make it blue".encode("utf-16"))  # BOM first: FF FE
    _sample(src, "same", _image(seed=6), caption="the same picture")
    os.symlink("../target/same.png", src / "control" / "same.png")  # inside the source: read
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    q = {Path(s).name: v for s, v in _quarantine(tmp_path / "store").items()}
    assert {n: reason for n, (reason, _) in q.items()} == {
        "loop.png": "unsupported-file", "zero.png": "empty-image", "bomb.png": "image-too-large",
        "utf16.png": "caption-not-utf8"}
    assert all("\n" not in detail for _, detail in q.values())
    assert "control/loop.png (a symlink loop): not a regular file" in q["loop.png"][1]
    assert q["zero.png"][1] == f"control 0 ({src / 'control' / 'zero.png'}): empty file (0 bytes)"
    assert q["bomb.png"][1] == (f"target ({src / 'target' / 'bomb.png'}): image is 10000000000 pixels, over "
                                "resize.max_image_pixels = 67108864 (decompression bomb guard)")
    assert q["utf16.png"][1] == "caption is UTF-16/UTF-32 (its byte order mark), not UTF-8; re-save it as UTF-8"
    r = Store(tmp_path / "store", create=False).reader("images")
    rows = {m["caption"]: m for m in r.manifest.to_pylist()}
    assert set(rows) == {"good", "named jpg", "named png", "the same picture"}
    assert r.files(rows["named jpg"]["key"])["target.png"] == r.files(rows["named png"]["key"])["target.png"]
    assert rows["named jpg"]["conversions"] == [] and rows["the same picture"]["num_controls"] == 1


def test_a_missing_caption_names_the_caption_the_layout_does_not_read(tmp_path):
    """A caption saved as `x.png.txt` (stem `x.png`), as `a.txt` beside `A.png` (one file on macOS and Windows, two
    on Linux) or in a `captions/` folder was `missing-caption` with no word of where the caption is; the orphan's
    row, apart, did not say which sample it was meant for."""
    src = tmp_path / "src"
    _sample(src, "a", _image(seed=1), caption="fine")
    _sample(src, "b", _image(seed=2))
    (src / "target" / "b.txt").rename(src / "target" / "b.png.txt")
    _sample(src, "c", _image(seed=3))
    (src / "captions").mkdir()
    (src / "target" / "c.txt").rename(src / "captions" / "c.txt")
    _sample(src, "D", _image(seed=4))
    (src / "target" / "D.txt").rename(src / "target" / "d.txt")
    result = _resize(src, tmp_path / "store")
    assert result.exit_code == 0, result.output
    rows = _quarantine(tmp_path / "store")
    assert rows[str(src / "target" / "b.png")] == (
        "missing-caption", "no caption target/b.txt for this sample: target/b.png.txt is named for the stem 'b.png'; "
        "rename it b.txt")
    assert rows[str(src / "target" / "c.png")] == (
        "missing-caption", "no caption target/c.txt for this sample (folder captions/ is not read: a caption is the "
        ".txt beside its target, target/<stem>.txt; move the captions there)")
    assert rows[str(src / "target" / "D.png")] == (
        "missing-caption", "no caption target/D.txt for this sample: target/d.txt differs from it in case only; "
        "rename it D.txt")
    assert _captions(tmp_path / "store") == ["fine"]


def test_a_tar_sample_without_its_txt_names_the_metadata_member_passed_over(tmp_path):
    """A webdataset shard with the caption in `<key>.json` (a common layout): the member is passed over as
    metadata and the sample was `missing-caption` with no word of it."""
    (tmp_path / "src").mkdir()
    with tarfile.open(tmp_path / "src" / "a.tar", "w") as tf:
        for name, data in (("x.png", _image(seed=1)), ("x.json", b'{"caption": "make it red"}'),
                           ("y.png", _image(seed=2)), ("z.png", _image(seed=3)), ("z.txt", b"fine")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    result = _resize(tmp_path / "src", tmp_path / "store")
    assert result.exit_code == 0, result.output
    tar = tmp_path / "src" / "a.tar"
    assert _quarantine(tmp_path / "store") == {
        f"{tar}:x": ("missing-caption", "no caption member x.txt (member(s) x.json are not read: put the caption "
                                        "text in x.txt)"),
        f"{tar}:y": ("missing-caption", "no caption member y.txt")}
    assert _captions(tmp_path / "store") == ["fine"]
