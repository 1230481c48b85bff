"""The train/val split by the pictures alone (stages/resize/split_rule.py). Before, the split was a hash of the key,
which holds the caption: a pair listed under several captions (caption augmentation) landed in both splits, so the
held-out loss scored pictures the LoRA trained on and evaluate's best checkpoint favoured memorising them. Now a
new store splits by target + controls; a store split by key keeps its split on rerun (its samples never move
unasked) and says how to switch; `resize.split_by: pictures` switches it, the pictures carried, not rendered."""

from __future__ import annotations

import hashlib
import io
import json
from collections import defaultdict

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from schemas.config import ResizeConfig
from stages.resize.split_rule import pictures_id, split_for
from store import Store
from store.manifest_files import read_schema
from store.reuse import FEATURE_LINEAGE_ATTR

CAPTIONS = 4
PAIRS = 16


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _source(src, pairs: int = PAIRS) -> None:
    src.mkdir()
    rows = []
    for pair in range(pairs):
        (src / f"t{pair}.png").write_bytes(_png(2 * pair))
        (src / f"c{pair}.png").write_bytes(_png(2 * pair + 1))
        rows += [{"target": f"t{pair}.png", "controls": [f"c{pair}.png"], "caption": f"edit {pair}, wording {n}"}
                 for n in range(CAPTIONS)]
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


SETTINGS = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
            "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.3}


def _resize(src, store, text: bool = False, **more) -> tuple[dict | None, str]:
    """(the --json record, None with `text`; the output: with `text` the summary a user reads, one line)."""
    sets = [a for k, v in {**SETTINGS, **more}.items() for a in ("--set", f"{k}={v}")]
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(src / "m.jsonl"), "--store", str(store),
                                      *sets, *([] if text else ["--json"])])
    assert result.exit_code == 0, result.output
    return (None if text else json.loads(result.stdout.strip().splitlines()[-1])), " ".join(result.output.split())


def _splits(store) -> tuple[dict[str, str], dict[tuple, set[str]]]:
    """(key -> split, pictures (source_hashes) -> the splits their samples are in) of the current version."""
    rows = Store(store, create=False).reader("images").manifest.to_pylist()
    by_pictures = defaultdict(set)
    for r in rows:
        by_pictures[tuple(r["source_hashes"])].add(r["split"])
    return {r["key"]: r["split"] for r in rows}, by_pictures


def _attrs(store, version: int) -> dict:
    return read_schema(Store(store, create=False).version_dir("images", version)).attrs


def test_a_new_store_puts_every_caption_of_a_pair_in_one_split(tmp_path):
    _source(tmp_path / "src")
    rec, _ = _resize(tmp_path / "src", tmp_path / "st")
    keys, by_pictures = _splits(tmp_path / "st")
    assert len(keys) == PAIRS * CAPTIONS and len(by_pictures) == PAIRS
    assert all(len(s) == 1 for s in by_pictures.values())  # no val sample shares pictures with a train sample
    val_pairs = sum(s == {"val"} for s in by_pictures.values())
    assert 0 < val_pairs < PAIRS and rec["splits"]["val"] == CAPTIONS * val_pairs
    assert rec["split_by"] == "pictures" and rec["val_sharing_train_images"] == 0
    assert "val samples have the target" not in _resize(tmp_path / "src", tmp_path / "st", text=True)[1]
    assert _attrs(tmp_path / "st", rec["version"])["split_by"] == "pictures"
    again, _ = _resize(tmp_path / "src", tmp_path / "st")  # the recorded rule: up to date
    assert again["up_to_date"] and again["version"] == rec["version"] and again["split_by"] == "pictures"


def test_the_pictures_split_keeps_val_fraction_over_many_pairs():
    rng = np.random.default_rng(0)
    pairs = [[hashlib.sha256(rng.bytes(16)).hexdigest() for _ in range(2)] for _ in range(20000)]
    for fraction in (0.05, 0.1, 0.3):
        val = sum(split_for("0" * 32, pictures_id(p), fraction, "pictures") == "val" for p in pairs)
        assert abs(val / len(pairs) - fraction) < 0.01, (fraction, val)
    # the key no longer decides: a key that alone would go to 'val' (00..) follows its pictures
    ids = [pictures_id(p) for p in pairs[:200]]
    assert {split_for(k, ids[0], 0.3, "pictures") for k in ("0" * 32, "f" * 32)} == {split_for("1" * 32, ids[0], 0.3,
                                                                                             "pictures")}
    assert split_for("0" * 32, None, 0.3, "key") == "val" and split_for("f" * 32, None, 0.3, "key") == "train"


def test_key_hashes_as_unset_so_a_store_split_before_the_record_stays_up_to_date():
    """A store made before the rule was recorded (split by key): its lineage did not hash `split_by`; resolved to
    key it must hash the same, else every such store re-rendered (and re-split) on upgrade."""
    assert ResizeConfig(split_by="key").fingerprint() == ResizeConfig().fingerprint()
    assert ResizeConfig(split_by="pictures").fingerprint() != ResizeConfig().fingerprint()
    from stages.resize.split_rule import recorded_rule

    assert recorded_rule({}) == "key" and recorded_rule({"split_by": "pictures"}) == "pictures"


def test_a_store_split_by_key_keeps_its_split_and_switches_only_when_told(tmp_path):
    _source(tmp_path / "src")
    store = tmp_path / "st"
    old, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "key"})  # as every store made before
    keys_before, by_pictures = _splits(store)
    assert old["split_by"] == "key" and any(len(s) == 2 for s in by_pictures.values())  # the defect, kept
    assert old["val_sharing_train_images"] > 0

    rerun, _ = _resize(tmp_path / "src", store)  # split_by unset: the store's rule, nothing moves
    assert rerun["up_to_date"] and rerun["version"] == old["version"] and rerun["split_by"] == "key"
    assert _splits(store)[0] == keys_before
    _, out = _resize(tmp_path / "src", store, text=True)
    assert f"val: {old['val_sharing_train_images']} of {old['splits']['val']} val samples have the target" in out
    assert "rerun with `--set resize.split_by=pictures` to split by the pictures alone" in out

    _, out = _resize(tmp_path / "src", store, text=True, **{"resize.split_by": "pictures"})
    switched, _ = _resize(tmp_path / "src", store)  # its record, up to date now
    assert switched["version"] == old["version"] + 1
    # pictures carried, not rendered
    assert f"images v{switched['version']}: 0 samples written, {PAIRS * CAPTIONS} reused" in out, out
    assert "was split by key, this run splits by pictures" in out
    keys_after, by_pictures = _splits(store)
    assert keys_after.keys() == keys_before.keys() and keys_after != keys_before
    assert all(len(s) == 1 for s in by_pictures.values()) and switched["val_sharing_train_images"] == 0
    assert _attrs(store, switched["version"])["split_by"] == "pictures"
    # the per-sample lineage the encoders carry by is that of the pictures: unchanged by the split
    assert _attrs(store, switched["version"])[FEATURE_LINEAGE_ATTR] == _attrs(store, old["version"])[FEATURE_LINEAGE_ATTR]

    again, _ = _resize(tmp_path / "src", store)  # the new rule is the store's now
    assert again["up_to_date"] and again["version"] == switched["version"] and _splits(store)[0] == keys_after
    back, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "key"})  # the old version, current again
    assert back["up_to_date"] and back["version"] == old["version"] and _splits(store)[0] == keys_before


def test_the_switch_carries_the_encoded_features_relabelled(tiny_edit_model, tmp_path):
    """The split is no part of the encoders' lineage: after the switch they encode nothing, only relabel."""
    from pipeline.config import load_config
    from stages.encode import text as encode_text
    from stages.encode import vae as encode_vae
    from tests.stages.test_fix_revisions_encode import F32

    _source(tmp_path / "src", pairs=6)
    store = tmp_path / "st"
    key_cfg = load_config(None, {**SETTINGS, **F32, "resize.split_by": "key"})
    _resize(tmp_path / "src", store, **{"resize.split_by": "key"})
    for stage in (encode_text, encode_vae):
        assert stage.run(key_cfg, store, tiny_edit_model, batch_size=4).encoded == 6 * CAPTIONS
    _resize(tmp_path / "src", store, **{"resize.split_by": "pictures"})
    cfg = load_config(None, {**SETTINGS, **F32})  # split_by unset: the store's rule (pictures now)
    for stage in (encode_text, encode_vae):
        done = stage.run(cfg, store, tiny_edit_model, batch_size=4)
        assert not done.up_to_date and (done.encoded, done.reused) == (0, 6 * CAPTIONS)
    images, _ = _splits(store)
    for table in ("text", "vae"):
        with Store(store).reader(table) as r:
            assert {k: r.meta(k)["split"] for k in r.keys()} == images



def test_store_repair_re_renders_a_version_under_its_recorded_rule(tmp_path):
    """`store repair` with a config that sets no resize.split_by: the damaged version's rule (the store's), its
    splits unchanged."""
    import yaml

    from damage import HEADER, flip_bit, key_at, sample_byte
    from store.verify import verify_store

    _source(tmp_path / "src", pairs=4)
    store = tmp_path / "st"
    _resize(tmp_path / "src", store, **{"resize.split_by": "key"})
    before = _splits(store)[0]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"resize": {k.split(".")[1]: v for k, v in SETTINGS.items()}}))
    flip_bit(*sample_byte(store, "images", key_at(store, "images", 1), HEADER, 3), 5)
    res = CliRunner().invoke(app, ["store", "repair", str(store), "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert verify_store(store, progress=False) == [] and _splits(store)[0] == before
    assert _attrs(store, Store(store).tables()["images"])["split_by"] == "key"


def _as_written_without_source_hashes(vdir) -> None:
    """The version as a release before `source_hashes` wrote it: the column dropped, checksums.json recording
    that manifest."""
    import pyarrow.parquet as pq

    from store import format as fmt
    from store.checksum import file_crc, seal, unseal

    pq.write_table(pq.read_table(vdir / fmt.MANIFEST).drop_columns(["source_hashes"]), vdir / fmt.MANIFEST)
    sums = unseal((vdir / fmt.CHECKSUMS).read_bytes())
    crc, nbytes = file_crc(vdir / fmt.MANIFEST)
    sums["files"][fmt.MANIFEST] = {"nbytes": nbytes, "crc32c": crc}
    (vdir / fmt.CHECKSUMS).write_bytes(seal(sums))


def test_a_version_without_source_hashes_refuses_the_pictures_split_in_one_line(tmp_path):
    """A version written before `source_hashes` was recorded (no such column in its manifest): the switch to
    pictures has no pictures' identity for the samples it carries. One line naming the version and what to do
    (it was an internal ValueError); the key split still carries them."""
    _source(tmp_path / "src", pairs=6)
    store = tmp_path / "st"
    old, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "key"})
    _as_written_without_source_hashes(Store(store, create=False).version_dir("images", old["version"]))
    sets = [a for k, v in {**SETTINGS, "resize.split_by": "pictures"}.items() for a in ("--set", f"{k}={v}")]
    res = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(tmp_path / "src" / "m.jsonl"),
                                   "--store", str(store), *sets])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    out = " ".join(res.output.split())
    assert f"table 'images' v{old['version']}" in out and "did not record source_hashes (24 of its samples)" in out
    assert "--set resize.split_by=key" in out and "resize-bucket (jsonl)" not in out  # before rendering anything
    kept, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "key"})
    assert kept["up_to_date"] and kept["version"] == old["version"]
    # a switch with other pixels' settings renders every sample anew: their hashes recorded, nothing refused
    other = {"resize.split_by": "pictures", "resize.target_area": 48 * 48}
    fresh, _ = _resize(tmp_path / "src", store, **other)
    assert fresh["version"] == old["version"] + 1 and fresh["split_by"] == "pictures" and not fresh["reused"]


def test_a_switch_past_a_version_whose_schema_fails_its_checksum_is_not_refused_for_its_hashes(tmp_path):
    """The switch's refusal read the current version's schema.json unchecked: a flipped bit that still parses (a
    letter of its recorded source path) was taken for an older release's intact version and the switch refused,
    telling the user to keep the key split or render into a new store. Checked, the version is recorded as
    damaged, nothing is carried from it, and the switch renders every sample anew."""
    from damage import flip_bit
    from store import format as fmt

    _source(tmp_path / "src", pairs=6)
    store = tmp_path / "st"
    old, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "key"})
    vdir = Store(store, create=False).version_dir("images", old["version"])
    _as_written_without_source_hashes(vdir)
    data = (vdir / fmt.SCHEMA_JSON).read_bytes()
    flip_bit(vdir / fmt.SCHEMA_JSON, data.index(b'm.jsonl"') + len("m.json"), 0)  # "m.jsonl" -> "m.jsonm"
    assert read_schema(vdir).attrs["source"].endswith("m.jsonm")  # still parses
    new, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "pictures"})
    assert new["version"] == old["version"] + 1 and new["split_by"] == "pictures" and not new["reused"]
    assert fmt.damaged_marker(store, "images", old["version"]).is_file()


def test_an_unreadable_current_schema_refuses_rather_than_take_an_older_versions_rule(tmp_path):
    """The current version (split by pictures) has a damaged schema.json, which `store verify` marked damaged; an
    older one was split by key. A rerun with resize.split_by unset took the older's rule (moving samples between
    train and val); now it is refused in one line naming the file and the setting that says the rule. Set, the
    run re-renders under it, nothing moved."""
    from store import format as fmt

    _source(tmp_path / "src", pairs=6)
    store = tmp_path / "st"
    old, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "key"})
    new, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "pictures"})
    before = _splits(store)[0]
    schema_json = Store(store, create=False).version_dir("images", new["version"]) / fmt.SCHEMA_JSON
    schema_json.write_text("{ damaged")
    assert CliRunner().invoke(app, ["store", "verify", str(store)]).exit_code != 0  # marks v2 damaged
    sets = [a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}")]
    res = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(tmp_path / "src" / "m.jsonl"),
                                   "--store", str(store), *sets, "--json"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.output, res.exception)
    out = " ".join(res.output.split())
    assert str(schema_json) in out and "--set resize.split_by=pictures or =key" in out, out
    assert f"v{old['version']}, the newest that reads, was split by key" in out
    assert Store(store, create=False).tables()["images"] == new["version"]  # nothing written
    told, _ = _resize(tmp_path / "src", store, **{"resize.split_by": "pictures"})
    assert told["version"] == new["version"] + 1 and told["split_by"] == "pictures" and _splits(store)[0] == before
