"""resize-bucket: real files of every bad-input kind end in the quarantine; sanitising; keys, split, lineage,
up-to-date reruns, resume after SIGKILL, the three source formats, masks, and the CLI."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize.bucketing import BucketRule, bucket_size
from stages.resize.split_rule import split_for
from stages.resize.images_table import sample_key
from stages.resize.stage import run
from store import Store
from store.verify import verify_store
import warm_start  # the killed and rerun resizes: real processes, started warm

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2}


def cfg(**over):
    return load_config(None, {**SMALL, **{f"resize.{k}": v for k, v in over.items()}})


def png(im: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format=kw.pop("format", "PNG"), **kw)
    return b.getvalue()


def rgb(w: int, h: int, colour=(200, 40, 40)) -> Image.Image:
    im = Image.new("RGB", (w, h), colour)
    im.paste((0, 0, 255), (0, 0, w // 2, h // 3))  # not uniform, so orientation is visible
    return im


def noise(w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (a decompression bomb needs no more to be dangerous)."""
    data = bytearray(png(Image.new("L", (8, 8))))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # keep the IHDR checksum valid
    return bytes(data)


def put(root: Path, stem: str, target: bytes, caption: bytes | None = b"make it blue", controls=(), mask=None, ext="png"):
    (root / "target").mkdir(parents=True, exist_ok=True)
    (root / "target" / f"{stem}.{ext}").write_bytes(target)
    if caption is not None:
        (root / "target" / f"{stem}.txt").write_bytes(caption)
    for i, c in enumerate(controls):
        d = root / ("control" if i == 0 else f"control_{i}")
        d.mkdir(exist_ok=True)
        (d / f"{stem}.png").write_bytes(c)
    if mask is not None:
        (root / "mask").mkdir(exist_ok=True)
        (root / "mask" / f"{stem}.png").write_bytes(mask)


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> dict:
    """A folder source with good samples, samples needing conversion, and one sample per bad-input kind."""
    root = tmp_path_factory.mktemp("messy") / "src"
    good = png(rgb(96, 64))
    put(root, "good", good, controls=[png(rgb(64, 64, (10, 200, 10)))])
    put(root, "textonly", png(rgb(48, 80)), caption=b"\xef\xbb\xbf a red square \n")  # BOM + spaces stripped
    ex = Image.Exif()
    ex[0x0112] = 6  # stored landscape, shown rotated 90 degrees: portrait
    put(root, "exif", png(rgb(80, 48), format="JPEG", exif=ex.tobytes(), quality=95), ext="jpg")
    put(root, "cmyk", png(Image.new("CMYK", (64, 64), (0, 255, 255, 0)), format="JPEG", quality=95), ext="jpg")
    sixteen = Image.fromarray(np.full((64, 64), 32896, np.uint16))  # 0x8080 -> 128 when scaled, 255 when clipped
    put(root, "gray16", png(sixteen))
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 32, 64))  # left half fully transparent
    put(root, "alpha", png(rgba), controls=[png(Image.new("LA", (32, 32), (90, 255)))])
    put(root, "palette", png(rgb(64, 64).convert("P")))
    big_mask = Image.new("L", (192, 128), 0)
    big_mask.paste(255, (0, 0, 96, 128))  # left half edited, at 2x the target's size
    put(root, "masked", good, caption=b"masked edit", mask=png(big_mask))
    # ---- bad inputs
    put(root, "zero", b"")
    full = png(noise(96, 96))
    put(root, "truncated", full[: len(full) // 2])
    put(root, "noiend", png(rgb(96, 96))[:-12])  # every pixel present, the end chunk cut off
    put(root, "notimage", b"this is not an image at all")
    put(root, "bomb", png_claiming(60000, 60000))
    put(root, "huge", png(rgb(300, 300)))  # over max_image_pixels=256*256 set by the test config
    put(root, "float", png(Image.fromarray(np.ones((32, 32), np.float32)), format="TIFF"), ext="tif")
    put(root, "nocaption", png(rgb(64, 48)), caption=None)
    put(root, "emptycaption", png(rgb(64, 48)), caption=b"  \n")
    put(root, "latin1", png(rgb(64, 48)), caption="café".encode("latin-1"))
    put(root, "toomany", png(rgb(64, 48)), controls=[png(rgb(32, 32))] * 3)
    put(root, "zdup", good, controls=[png(rgb(64, 64, (10, 200, 10)))])  # same bytes + caption as "good"
    put(root, "badmask", png(rgb(64, 48)), mask=b"\x89PNG\r\n\x1a\n garbage")
    put(root, "badcontrol", png(rgb(64, 48)), controls=[png(noise(64, 64))[:2000]])
    (root / "control" / "orphan.png").write_bytes(png(rgb(32, 32)))
    store = root.parent / "store"
    summary = run(cfg(max_image_pixels=256 * 256), root, store)
    return {"root": root, "store": store, "summary": summary}


def _quarantine(store: Path) -> dict[str, dict]:
    q = Store(store).quarantine().to_pylist()
    return {Path(r["source"].split(":")[0]).name: r for r in q}


def test_every_bad_input_is_quarantined_with_its_reason(messy):
    q = _quarantine(messy["store"])
    expect = {
        "zero.png": "empty-image", "truncated.png": "corrupt-image", "noiend.png": "corrupt-image", "notimage.png": "unreadable-image",
        "huge.png": "image-too-large", "bomb.png": "image-too-large", "float.tif": "unsupported-mode", "nocaption.png": "missing-caption",
        "emptycaption.png": "empty-caption", "latin1.png": "caption-not-utf8", "toomany.png": "control-count",
        "zdup.png": "duplicate", "badmask.png": "bad-mask", "badcontrol.png": "corrupt-image",
        "orphan.png": "orphan-file",
    }
    assert {name: r["reason"] for name, r in q.items()} == expect
    root = messy["root"]
    assert q["zdup.png"]["detail"] == f"same content (target, controls, caption) as {root.resolve() / 'target' / 'good.png'}"
    rows = Store(messy["store"]).reader("images").manifest.to_pylist()
    assert q["zdup.png"]["key"] == next(m["key"] for m in rows if m["source"].endswith("good.png"))
    assert len(q["truncated.png"]["key"]) == 32 and q["nocaption.png"]["key"] is None  # the key when it is known
    assert "300x300 = 90000 pixels, over resize.max_image_pixels = 65536" in q["huge.png"]["detail"]
    assert q["badcontrol.png"]["detail"].startswith(f"control 0 ({root.resolve() / 'control' / 'badcontrol.png'})")
    assert all(r["stage"] == "resize-bucket" for r in q.values())
    s = messy["summary"]
    assert sum(s.quarantined.values()) == len(expect) and s.quarantined["corrupt-image"] == 3
    assert s.written == 8 and "quarantined 15" in str(s)
    # the summary names both files of a duplicate pair: the one kept and the copy dropped
    kept, dropped = root.resolve() / "target" / "good.png", root.resolve() / "target" / "zdup.png"
    assert f"duplicate: kept {kept}, dropped {dropped}" in str(s)


def test_sanitising_exif_cmyk_16bit_alpha_palette(messy):
    r = Store(messy["store"]).reader("images")
    by_stem = {Path(m["source"]).stem: m["key"] for m in r.manifest.to_pylist()}
    assert set(by_stem) == {"good", "textonly", "exif", "cmyk", "gray16", "alpha", "palette", "masked"}

    def target(stem):
        return Image.open(io.BytesIO(r.files(by_stem[stem])["target.png"]))

    exif = r.meta(by_stem["exif"])
    assert exif["source_size"] == [80, 48] and exif["bucket"][0] > exif["bucket"][1]  # now portrait
    assert "EXIF orientation 6 applied" in exif["conversions"]
    # the blue block was top-left of the stored pixels; rotated 270 (orientation 6) it is top-right
    t = np.asarray(target("exif"))
    assert t[2, -3, 2] > 200 and t[2, 2, 0] > 150
    assert np.allclose(np.asarray(target("cmyk"))[10, 10], (255, 0, 0), atol=6)
    assert np.asarray(target("gray16"))[10, 10].tolist() == [128, 128, 128]  # scaled, not clipped to 255
    a = np.asarray(target("alpha"))
    assert a[32, 2].tolist() == [255, 255, 255] and a[32, -2].tolist() == [255, 0, 0]  # transparent -> white
    assert Image.open(io.BytesIO(r.files(by_stem["alpha"])["control_0.png"])).mode == "RGB"
    assert r.meta(by_stem["textonly"])["caption"] == "a red square"
    assert target("palette").mode == "RGB"
    for k in r.keys():
        for name, data in r.files(k).items():
            assert Image.open(io.BytesIO(data)).mode == ("L" if name == "mask.png" else "RGB")


def test_buckets_views_img_shapes_and_mask(messy):
    c = cfg()
    r = Store(messy["store"]).reader("images")
    m = next(x for x in r.manifest.to_pylist() if x["source"].endswith("good.png"))
    files = r.files(m["key"])
    assert m["bucket"] == list(bucket_size(96, 64, BucketRule(c.resize.target_area, 16, 4.0, 16))) == [48, 80]
    assert Image.open(io.BytesIO(files["target.png"])).size == (80, 48)
    assert m["control_sizes"] == [[64, 64]] and m["control_vl_sizes"] == [[32, 32]]
    assert Image.open(io.BytesIO(files["control_0_vl.png"])).size == (32, 32)
    assert m["img_shapes"] == [[1, 3, 5], [1, 4, 4]] == [list(s) for s in r.img_shapes(m["key"])]
    assert m["num_controls"] == 1 and m["has_mask"] is False and "mask.png" not in files
    assert len(m["source_hashes"]) == 2
    mk = next(x for x in r.manifest.to_pylist() if x["source"].endswith("masked.png"))
    mask = np.asarray(Image.open(io.BytesIO(r.files(mk["key"])["mask.png"])))
    assert mk["has_mask"] is True and mask.shape == (48, 80)  # resized with its target
    assert (mask[:, :38] == 255).all() and (mask[:, 42:] == 0).all()
    assert "mask resized to its target" in mk["conversions"]


def test_key_is_content_hash_and_split_is_deterministic():
    k = sample_key(b"t", [b"c1", b"c2"], "edit")
    assert len(k) == 32 and all(ch in "0123456789abcdef" for ch in k)
    assert k == sample_key(b"t", [b"c1", b"c2"], "edit")
    assert k != sample_key(b"t", [b"c2", b"c1"], "edit") != sample_key(b"t", [b"c1c2"], "edit")
    assert k != sample_key(b"t", [b"c1", b"c2"], "edit!")
    keys = [sample_key(str(i).encode(), [], "x") for i in range(2000)]
    val = [split_for(x, None, 0.1, "key") for x in keys].count("val")
    assert 150 < val < 250 and [split_for(x, None, 0.1, "key") for x in keys] == [split_for(x, None, 0.1, "key")
                                                                                for x in keys]
    assert {split_for(x, x, 0.0, rule) for x in keys for rule in ("key", "pictures")} == {"train"}


def test_three_source_formats_give_the_same_table(tmp_path):
    manifests = {}
    for fmt in ("folder", "webdataset", "jsonl"):
        make_demo_data(tmp_path / fmt, n=8, fmt=fmt, max_controls=2, seed=3, with_masks=True)
        s = run(cfg(), tmp_path / fmt, tmp_path / f"store-{fmt}")
        assert s.written == 8 and not s.quarantined
        r = Store(tmp_path / f"store-{fmt}").reader("images")
        manifests[fmt] = {k: ({c: v for c, v in r.meta(k).items() if c != "source"}, r.files(k)) for k in r.keys()}
    assert manifests["folder"] == manifests["webdataset"] == manifests["jsonl"]
    assert all(m["has_mask"] for m, _ in manifests["folder"].values())
    # worker processes give the same table, and the same lineage (workers is not a feature setting)
    s = run(cfg(workers=2), tmp_path / "folder", tmp_path / "store-folder")
    assert s.up_to_date and s.version == 1
    run(cfg(workers=2), tmp_path / "folder", tmp_path / "store-workers")
    r = Store(tmp_path / "store-workers").reader("images")
    assert {k: ({c: v for c, v in r.meta(k).items() if c != "source"}, r.files(k)) for k in r.keys()} == manifests["folder"]


def test_unsafe_tar_members_and_bad_jsonl_lines_are_quarantined(tmp_path):
    src = tmp_path / "tars"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tf:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

        add("ok.png", png(rgb(64, 64)))
        add("ok.txt", b"fine")
        add("../evil.png", png(rgb(64, 64, (1, 2, 3))))
        add("../evil.txt", b"escape")
        add("/abs/x.png", png(rgb(64, 64, (4, 5, 6))))
        link = tarfile.TarInfo("lnk.png")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    with tarfile.open(src / "b.tar", "w") as tf:  # cut inside its second sample's image
        for i in range(2):
            for name, data in ((f"t{i}.png", png(noise(64, 64))), (f"t{i}.txt", b"noisy")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    whole = (src / "b.tar").read_bytes()
    (src / "b.tar").write_bytes(whole[: len(whole) // 2 + 4096])
    s = run(cfg(), src, tmp_path / "store")
    assert s.written == 2 and s.quarantined["unsafe-path"] == 2 and s.quarantined["bad-source"] == 2
    details = {r["source"]: r["detail"] for r in Store(tmp_path / "store").quarantine().to_pylist()}
    assert "unsafe member path '../evil.png'" in details[f"{src / 'a.tar'}:../evil"]
    assert "not a regular file" in details[f"{src / 'a.tar'}:lnk"]
    assert "tar is truncated or corrupt" in details[f"{src / 'b.tar'}:t1"]

    j = tmp_path / "j"
    j.mkdir()
    (j / "t.png").write_bytes(png(rgb(64, 64)))
    (j / "m.jsonl").write_text(
        json.dumps({"target": "t.png", "controls": [], "prompt": "via prompt"}) + "\n{not json\n"
        + json.dumps({"target": "missing.png", "caption": "x"}) + "\n" + json.dumps({"target": "t.png", "caption": 5}) + "\n"
    )
    s = run(cfg(), j / "m.jsonl", tmp_path / "store2")
    assert s.written == 1 and s.quarantined["bad-source"] == 3
    r = Store(tmp_path / "store2").reader("images")
    assert r.meta(r.keys()[0])["caption"] == "via prompt"


def _why_new(out: str) -> list[str]:
    return [line for line in out.splitlines() if "is not this run's" in line]


def test_rerun_is_up_to_date_changed_setting_or_source_is_a_new_version(tmp_path, capsys):
    make_demo_data(tmp_path / "src", n=6, fmt="folder", max_controls=2, seed=1)
    (tmp_path / "src" / "target" / "sample_0000.txt").write_bytes(b"")  # one reject, to check no repeats
    st = Store(tmp_path / "store")
    first = run(cfg(), tmp_path / "src", st)
    again = run(cfg(), tmp_path / "src", st)
    assert first.version == 1 and again.up_to_date and again.version == 1 and st.versions("images") == [1]
    assert "up to date" in str(again)
    assert _why_new(capsys.readouterr().out) == []
    changed = run(cfg(target_area=96 * 96), tmp_path / "src", st)
    assert changed.version == 2 and not changed.up_to_date and st.tables()["images"] == 2
    # one line says what differs from the newest complete version (before: a full re-render, no reason)
    (why,) = _why_new(capsys.readouterr().out)
    assert why.startswith("resize-bucket: table 'images' v1 is not this run's (resize settings ") and \
        why.endswith("; resize.target_area: 4096 -> 9216): writing a new version"), why
    assert len(st.quarantine()) == 1  # the same reject is not recorded twice
    back = run(cfg(), tmp_path / "src", st)  # the first settings again: v1 reused, made current
    assert back.up_to_date and back.version == 1 and st.tables()["images"] == 1
    assert _why_new(capsys.readouterr().out) == []
    (tmp_path / "src" / "target" / "sample_0000.txt").write_text("now with a caption")
    grown = run(cfg(), tmp_path / "src", st)
    (why,) = _why_new(capsys.readouterr().out)  # v2 is the newest complete version
    assert why.startswith("resize-bucket: table 'images' v2 is not this run's (resize settings "), why
    assert "; source listing (its files and their bytes) src" in why and "resize.target_area: 9216 -> 4096" in why
    # only the newly captioned sample is rendered; the other 5 are carried forward from v1 (hard-linked shards)
    assert grown.version == 3 and grown.written == 1 and grown.reused == 5
    assert len(st.reader("images", 3)) == 6 and verify_store(st.root, progress=False) == []


def test_json_of_an_up_to_date_table_counts_every_sample_reused(tmp_path):
    """`run resize-bucket --json` on an up-to-date table said `reused: 0` and `splits: {}`: it reused every sample
    (the encoders' summaries count theirs so)."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    make_demo_data(tmp_path / "src", n=6, fmt="folder", max_controls=2, seed=1)
    args = ["run", "resize-bucket", "--source", str(tmp_path / "src"), "--store", str(tmp_path / "store"), "--json",
            *(a for k, v in SMALL.items() for a in ("--set", f"{k}={v}"))]
    first, again = (json.loads(CliRunner().invoke(app, args).stdout.splitlines()[-1]) for _ in range(2))
    assert not first["up_to_date"] and first["encoded"] == 6 and first["reused"] == 0
    assert again["up_to_date"] and again["encoded"] == 0 and again["reused"] == 6, again
    assert again["splits"] == first["splits"] and sum(again["splits"].values()) == 6


def _resize_process(tmp_path: Path, then: str) -> list[str]:
    """The command line of a resize of tmp_path/src into tmp_path/store in its own process (small shards: a kill
    at a crash point leaves several), running `then` with its `summary`."""
    code = (
        "import json, sys; from pipeline.config import load_config; from stages.resize.stage import run;"
        f"cfg = load_config(None, {{**{SMALL!r}, 'resize.shard_size_mb': 0.01}});"
        f"summary = run(cfg, sys.argv[1], sys.argv[2]); {then}"
    )
    return [sys.executable, "-c", code, str(tmp_path / "src"), str(tmp_path / "store")]


def test_resume_after_sigkill_mid_run(tmp_path):
    make_demo_data(tmp_path / "src", n=16, fmt="webdataset", max_controls=2, seed=2)
    args = _resize_process(tmp_path, "print(summary)")
    killed = warm_start.run(args, env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"})
    assert killed.returncode == -9, killed.stderr
    vdir = tmp_path / "store" / "images" / "v1"
    assert len(list(vdir.glob("*.index.parquet"))) == 1 and not (vdir / "manifest.parquet").exists()
    done = warm_start.run(args)
    assert done.returncode == 0, done.stderr
    assert "kept from an interrupted run" in done.stdout
    r = Store(tmp_path / "store").reader("images")
    assert r.version == 1 and len(r) == 16 and len(set(r.keys())) == 16
    assert len(list(vdir.glob("*.tar"))) > 2
    fresh = run(load_config(None, SMALL), tmp_path / "src", tmp_path / "fresh")
    f = Store(tmp_path / "fresh").reader("images")
    assert fresh.written == 16 and sorted(f.keys()) == sorted(r.keys())
    assert all(f.files(k) == r.files(k) and f.meta(k) == r.meta(k) for k in f.keys())


def test_bytes_written_after_kills_are_this_runs_shards_only(tmp_path):
    """Killed once after a shard's commit, then once between a shard's tar and its index (a tar no index names,
    which the resumed writer leaves where it is: `store gc` removes it). bytes_written summed every tar in the
    version folder (the first session's shard and the unindexed tar included, though neither is this run's
    writing and the second is no part of the version) and missed this run's last shard, still open then. Now it
    is the bytes of the shards this run wrote: those the manifest names that were not there before it."""
    make_demo_data(tmp_path / "src", n=16, fmt="webdataset", max_controls=2, seed=2)
    args = _resize_process(tmp_path, "print(json.dumps(summary.to_json()))")
    vdir = tmp_path / "store" / "images" / "v1"
    for crash in ("after_shard_commit", "shard_before_index"):
        killed = warm_start.run(args, env={**os.environ, "STORE_CRASH_AT": crash})
        assert killed.returncode == -9, killed.stderr
    before = {p.name for p in vdir.glob("*.tar")}
    done = warm_start.run(args)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    named = set(Store(tmp_path / "store").reader("images").manifest.column("shard").to_pylist())
    assert before - named, (before, named)  # the unindexed tar is there, and no part of the version
    assert before & named  # and the first session's shard is
    assert summary["bytes_written"] == sum((vdir / name).stat().st_size for name in named - before) > 0, summary


def test_cli_flags_override_config(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    make_demo_data(tmp_path / "src", n=6, fmt="jsonl", max_controls=1, seed=4)
    (tmp_path / "c.yaml").write_text("resize:\n  target_area: 4096\n  multiple: 16\n  val_fraction: 0.0\n")
    args = ["run", "resize-bucket", "--source", str(tmp_path / "src"), "--store", str(tmp_path / "st"),
            "--config", str(tmp_path / "c.yaml")]
    res = CliRunner().invoke(app, args + ["--val-fraction", "0.999"])
    assert res.exit_code == 0, res.output
    assert "images v1: 6 samples written (train 0, val 6)" in res.output
    res = CliRunner().invoke(app, args + ["--val-fraction", "0.999"])
    assert res.exit_code == 0 and "up to date" in res.output
    bad = CliRunner().invoke(app, args + ["--multiple", "24"])
    assert bad.exit_code == 2 and "resize.multiple = 24 must be a multiple of 16" in bad.output  # a usage mistake
    missing = CliRunner().invoke(app, ["run", "resize-bucket", "--store", str(tmp_path / "st")])
    assert missing.exit_code == 2 and "--source is required" in missing.output


def test_a_source_with_nothing_usable_is_an_error_after_quarantining(tmp_path):
    from schemas.errors import UserError

    put(tmp_path / "src", "empty", b"")
    with pytest.raises(UserError, match="no usable sample .* 1 quarantined"):
        run(cfg(), tmp_path / "src", tmp_path / "store")
    st = Store(tmp_path / "store")
    assert [r["reason"] for r in st.quarantine().to_pylist()] == ["empty-image"] and "images" not in st.tables()
    (tmp_path / "litter" / "target").mkdir(parents=True)  # only OS litter: no sample, not "0 quarantined (see ...)"
    (tmp_path / "litter" / "target" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    with pytest.raises(UserError, match=r"^no sample found in source .*litter \(dotfiles such as \.DS_Store are "
                                        r"ignored\); add the samples"):
        run(cfg(), tmp_path / "litter", tmp_path / "store")
    # the runs that wrote nothing left no version behind: the first that writes one makes v1 (before: v3, with an
    # in-progress v1 and v2 holding only their schema.json until a `store gc`)
    assert not any(p.name.startswith("v") for p in (tmp_path / "store" / "images").iterdir())
    put(tmp_path / "src", "empty", png(rgb(64, 64)))
    assert run(cfg(), tmp_path / "src", tmp_path / "store").version == 1
    assert sorted(p.name for p in (tmp_path / "store" / "images").iterdir() if p.is_dir()) == ["v1"]


def test_unsupported_files_quarantine_their_sample_gif_is_read_dotfiles_ignored(tmp_path):
    src = tmp_path / "src"
    put(src, "gif", png(rgb(64, 64)), controls=[png(rgb(48, 48, (9, 9, 9)))])
    (src / "control" / "gif.png").rename(src / "control" / "gif.gif")  # any PIL-readable bytes; suffix is what counts
    (src / "mask").mkdir()
    (src / "mask" / "gif.gif").write_bytes(png(Image.new("L", (64, 64), 255), format="GIF"))
    put(src, "heic", png(rgb(64, 48)))
    (src / "control" / "heic.heic").write_bytes(b"not read")
    put(src, "oddmask", png(rgb(48, 64)))
    (src / "mask" / "oddmask.xyz").write_bytes(b"not read")
    (src / "control_1").mkdir()
    (src / "control_1" / "lonely.heic").write_bytes(b"no target")
    for litter in (src / "target" / ".DS_Store", src / "control" / "._gif.gif", src / "mask" / ".hidden.png"):
        litter.write_bytes(b"\x00\x05\x16\x07 OS litter")
    s = run(cfg(), src, tmp_path / "store")
    r = Store(tmp_path / "store").reader("images")
    assert s.written == 1 and r.meta(r.keys()[0])["num_controls"] == 1 and r.meta(r.keys()[0])["has_mask"]
    q = _quarantine(tmp_path / "store")
    assert {n: row["reason"] for n, row in q.items()} == {
        "heic.png": "unsupported-file", "oddmask.png": "unsupported-file", "lonely.heic": "unsupported-file"}
    assert "control/heic.heic" in q["heic.png"]["detail"] and "mask/oddmask.xyz" in q["oddmask.png"]["detail"]
    assert "no matching target image" in q["lonely.heic"]["detail"]

    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "a.tar", "w") as tf:
        for name, data in (("k1.png", png(rgb(64, 64))), ("k1.txt", b"x"), ("k1.control.heic", b"?"),
                           ("k2.png", png(rgb(64, 48))), ("k2.txt", b"y"), ("k2.control.gif", png(rgb(32, 32), format="GIF"))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    s = run(cfg(), tars, tmp_path / "store-tar")
    r = Store(tmp_path / "store-tar").reader("images")
    assert s.written == 1 and r.meta(r.keys()[0])["num_controls"] == 1 and dict(s.quarantined) == {"unsupported-file": 1}
    assert "k1.control.heic" in Store(tmp_path / "store-tar").quarantine().to_pylist()[0]["detail"]


def test_store_and_litter_inside_a_folder_source_do_not_change_its_version(tmp_path):
    src = tmp_path / "src"
    make_demo_data(src, n=3, fmt="folder", max_controls=1, seed=4)
    first = run(cfg(), src, src / "store")  # the store lives inside the source folder
    (src / ".DS_Store").write_bytes(b"litter")
    (src / "target" / "._sample_0000.png").write_bytes(b"AppleDouble")
    (src / "notes.md").write_text("not part of the layout")
    again = run(cfg(), src, src / "store")
    assert first.version == 1 and again.up_to_date and again.version == 1
    target = sorted((src / "target").glob("sample_*.png"))[0]
    target.write_bytes(png(rgb(64, 64, (1, 2, 3))))
    changed = run(cfg(), src, src / "store")
    assert changed.version == 2 and not changed.up_to_date


def test_a_damaged_earlier_manifest_is_not_trusted_for_reuse(tmp_path):
    """An earlier version whose manifest bytes no longer match checksums.json offers nothing to carry forward:
    every sample is rendered again (none lost, none read from the damaged rows), and inspect names the damage."""
    from store.inspect import describe, render

    make_demo_data(tmp_path / "src", n=6, fmt="folder", max_controls=2, seed=1)
    (tmp_path / "src" / "target" / "sample_0000.txt").write_bytes(b"")
    st = Store(tmp_path / "store")
    assert run(cfg(), tmp_path / "src", st).version == 1
    manifest = st.version_dir("images", 1) / "manifest.parquet"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    manifest.write_bytes(bytes(data))
    (tmp_path / "src" / "target" / "sample_0000.txt").write_text("now with a caption")
    grown = run(cfg(), tmp_path / "src", st)
    assert grown.version == 2 and grown.written == 6 and grown.reused == 0
    assert len(st.reader("images", 2)) == 6
    v1 = describe(st.root)["tables"]["images"]["versions"][0]
    assert "manifest.parquet is damaged" in v1["damaged"] and "damaged:" in render(describe(st.root))
