"""`pipeline store repair`: damaged samples of the text and vae tables are recomputed by their stages (only
those: the rest is carried forward), the store verifies again and trains to the LoRA of the clean store (to
float32 rounding: a recomputed sample is encoded in another batch); what cannot be repaired is named; a damaged
store.json is rebuilt."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from typer.testing import CliRunner

from damage import HEADER, flip_bit, key_at, sample_byte
from models.lora import read_lora
from pipeline.cli import app
from pipeline.config import load_config
from stages.encode import text as encode_text, vae as encode_vae
from stages.train.recipe import run as train
from store import Store
from store import format as fmt
from store.verify import verify_store
from test_damage_rerun import demo_store
import warm_start

runner = CliRunner()
SMALL_SHARDS = {"encode_text.shard_size_mb": 0.005, "encode_vae.shard_size_mb": 0.005}  # not part of the lineage
TRAIN = {"train.device": "cpu", "train.batch_size": 2, "train.max_steps": 3, "train.lora.rank": 4,
         "train.learning_rate": 2e-3}


def _flip(root: Path, table: str, index: int, where: str = "tensor") -> str:
    """One bit of the `index`-th sample: 5 bytes into its first tensor, or 3 bytes into its tar header."""
    key = key_at(root, table, index)
    member, offset = (HEADER, 3) if where == "header" else (None, 5)
    flip_bit(*sample_byte(root, table, key, member, offset), 5)
    return key


def test_repair_recomputes_only_damaged_samples_and_trains_to_the_clean_lora(tiny_edit_model, edit_store, tmp_path):
    cfg = load_config(None, SMALL_SHARDS)
    encode_text.run(cfg, edit_store, tiny_edit_model)
    encode_vae.run(cfg, edit_store, tiny_edit_model)
    clean = Path(shutil.copytree(edit_store, tmp_path / "clean"))
    assert len(list((edit_store / "vae" / "v1").glob("*.tar"))) > 2
    bad_text = _flip(edit_store, "text", 1)
    bad_vae = _flip(edit_store, "vae", 4, where="header")
    assert verify_store(edit_store, progress=False)

    res = runner.invoke(app, ["store", "repair", str(edit_store), "--dry-run"])
    assert res.exit_code == 0 and "dry run: nothing changed" in res.output
    assert f"text v1: 1 damaged sample(s) to recompute ({bad_text})" in res.output
    assert f"vae v1: 1 damaged sample(s) to recompute ({bad_vae})" in res.output
    assert Store(edit_store).versions("vae") == [1]

    res = runner.invoke(app, ["store", "repair", str(edit_store), "--model", tiny_edit_model])
    assert res.exit_code == 0, res.output
    assert "encoded 1," in res.output  # each stage computed exactly the one damaged sample
    assert "ok:" in res.output and verify_store(edit_store, progress=False) == []
    st = Store(edit_store)
    assert st.tables()["text"] == 2 and st.tables()["vae"] == 2
    linked = [p for p in (edit_store / "vae" / "v2").glob("*.tar") if p.stat().st_nlink == 2]
    assert linked  # intact shards carried forward as hard links, not copies
    for table, recomputed in (("text", bad_text), ("vae", bad_vae)):
        a, b = Store(clean).reader(table), st.reader(table)
        assert a.keys() == b.keys()
        for k in a.keys():
            ta, tb = a.tensors(k), b.tensors(k)
            assert ta.keys() == tb.keys()
            for n in ta:
                if k == recomputed:  # encoded alone now, in a batch before: CPU kernels sum in another order for
                    # another batch size (float32). Bounded against the tensor's scale, not per element: a latent
                    # element near 0 was seen 6.1e-5 off (0.65% of itself) in a loaded run of the suite
                    scale = ta[n].abs().max().clamp(min=1.0)
                    assert (tb[n] - ta[n]).abs().max() <= 1e-4 * scale, (table, k, n)
                else:  # carried forward: the very bytes
                    assert torch.equal(ta[n], tb[n]), (table, k, n)
    assert "nothing to repair" in runner.invoke(app, ["store", "repair", str(edit_store)]).output

    cfg_t = load_config(None, TRAIN)
    train(cfg_t, clean, tiny_edit_model, tmp_path / "run-clean")
    train(cfg_t, edit_store, tiny_edit_model, tmp_path / "run-repaired")
    la, lb = read_lora(tmp_path / "run-clean" / "lora")[0], read_lora(tmp_path / "run-repaired" / "lora")[0]
    assert la.keys() == lb.keys()
    for k in la:  # the same LoRA, up to the recomputed samples' float32 rounding (against each tensor's scale: an
        # element near 0 is no measure of it)
        assert (lb[k] - la[k]).abs().max() <= 1e-4 * la[k].abs().max(), k


def test_repair_names_what_it_cannot_repair_and_rebuilds_store_json(edit_store, tmp_path):
    bad = _flip(edit_store, "images", 2, where="header")  # the fixture's images have no real source to re-render from
    path = edit_store / fmt.STORE_JSON
    flip_bit(path, path.read_bytes().index(b'"current"') + 2, 0)
    res = runner.invoke(app, ["store", "repair", str(edit_store)])
    assert res.exit_code == 1
    assert "store.json rebuilt" in res.output and f"images v1: 1 damaged sample(s) to recompute ({bad})" in res.output
    assert "not repaired: images v1:" in res.output and "pass --source" in res.output
    assert Store(edit_store).tables() == {"images": 1}  # store.json readable again


def test_repair_re_renders_damaged_images_from_the_source(tmp_path):
    store, config = demo_store(tmp_path)
    clean = Path(shutil.copytree(store, tmp_path / "clean"))
    bad = _flip(store, "images", 3, where="header")
    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config)])  # source: from the schema
    assert res.exit_code == 0, res.output
    assert f"images v1: 1 damaged sample(s) to recompute ({bad})" in res.output and "ok:" in res.output
    a, b = Store(clean).reader("images"), Store(store).reader("images")
    assert b.version == 2 and a.keys() == b.keys()
    assert all(a.files(k) == b.files(k) for k in a.keys())  # re-rendered bytes equal the clean ones
    assert verify_store(store, progress=False) == []


def test_repair_keeps_a_damaged_version_a_running_reader_holds(tiny_edit_model, edit_store, tmp_path):
    """A training (here: a process holding the same read lease and reader) reads vae v1 while `store repair`
    replaces it: v1 stays in place until the reader is gone (moving it aside made the reader's next shard open
    a FileNotFoundError traceback), the reader reads every intact sample to the end, and `store gc` removes v1
    once it has left. A reader that loses a shard anyway (deleted by hand) gets one line."""
    import sys
    import time

    cfg = load_config(None, SMALL_SHARDS)
    encode_text.run(cfg, edit_store, tiny_edit_model)
    encode_vae.run(cfg, edit_store, tiny_edit_model)
    bad = _flip(edit_store, "vae", 2)
    ready, go = tmp_path / "ready", tmp_path / "go"
    # started warm (tests/warm_start.py: its reads import torch, ~9 s of CPU cold); told to read by a file
    reader = warm_start.WarmProcess([sys.executable, "-c", f"""
import time
from pathlib import Path
from store import Store
from store.lease import hold
lease = hold({str(edit_store)!r}, {{"vae": None}}, "a test training")
r = Store({str(edit_store)!r}).reader("vae", lease.version("vae"), on_damaged="skip")
Path({str(ready)!r}).touch()
deadline = time.monotonic() + 300  # a bound, not a duration: the test touches the file once repair has run
while not Path({str(go)!r}).exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print("read", sum(1 for k in r.keys() if k != {bad!r} and r.tensors(k)), flush=True)
"""])
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and reader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready.exists(), reader.output()
        res = runner.invoke(app, ["store", "repair", str(edit_store), "--model", tiny_edit_model])
        assert res.exit_code == 0, res.output
        assert "The damaged v1 is still read by a test training (pid" in res.output, res.output
        assert Store(edit_store).tables()["vae"] == 2 and (edit_store / "vae" / "v1").is_dir()
        go.touch()
        out, err = reader.communicate(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0 and out.strip() == f"read {len(Store(edit_store).reader('vae').keys()) - 1}", err
    res = runner.invoke(app, ["store", "gc", str(edit_store)])
    assert res.exit_code == 0 and not (edit_store / "vae" / "v1").exists(), res.output

    from store.integrity import DamagedData

    r = Store(edit_store).reader("vae")
    shard = r.view.samples.shard_of(0)
    (r.dir / shard).unlink()
    try:
        r.tensors_at(0)
        raise AssertionError("read a deleted shard")
    except DamagedData as e:
        assert f"shard {shard} disappeared while it was being read" in str(e) and "\n" not in str(e)
    r.close()


def test_repair_killed_after_carrying_a_shard_resumes(tmp_path):
    """`store repair` SIGKILLed right after linking its first intact shard into the new version: the rerun
    carries the rest (not that one twice), re-renders the damaged sample, and the store verifies."""
    import os
    import sys

    store, config = demo_store(tmp_path)
    clean = Path(shutil.copytree(store, tmp_path / "clean"))
    _flip(store, "images", 3, where="header")
    args = [sys.executable, "-c", "from pipeline.cli import app; app()", "store", "repair", str(store),
            "--config", str(config)]
    killed = warm_start.run(args, env={**os.environ, "STORE_CRASH_AT": "after_linked_shard"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(list((store / "images" / "v2").glob("shard-*.index.parquet"))) == 1  # one shard carried, then killed
    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config)])
    assert res.exit_code == 0, res.output
    a, b = Store(clean).reader("images"), Store(store).reader("images")
    assert b.version == 2 and a.keys() == b.keys()
    assert all(a.files(k) == b.files(k) for k in a.keys())
    assert verify_store(store, progress=False) == []


def test_repair_of_images_names_the_encoders_to_rerun(tiny_edit_model, tmp_path):
    """The text and vae tables were encoded from images v1, which the repair replaced by v2 (set aside): they still
    name v1, and evaluate's pictures are refused until both encoders run again. The repair's last line says so
    (before: only "ok: ... repaired and verified")."""
    store, config = demo_store(tmp_path, n=4)
    cfg = load_config(config)
    encode_text.run(cfg, store, tiny_edit_model)
    encode_vae.run(cfg, store, tiny_edit_model)
    _flip(store, "images", 2, where="header")
    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config), "--model", tiny_edit_model])
    assert res.exit_code == 0, res.output
    assert Store(store).tables() == {"images": 2, "text": 1, "vae": 1}
    assert res.output.rstrip().splitlines()[-1] == (
        "table 'text' v1 and table 'vae' v1 were encoded from images v1, which this repair replaced by v2: run "
        "`pipeline run encode-text` and `pipeline run encode-vae` to encode from images v2 (samples whose pictures "
        "did not change are carried forward, not encoded again); until then evaluate cannot read their pictures")


def test_repair_of_a_truncated_shard_copies_its_intact_samples_and_recomputes_the_rest(tmp_path):
    """A shard cut short (a full disk at copy time, a damaged file system): the samples before the cut are intact
    and copied, those past it recomputed. Before, every sample of the shard was refused to the copy, and repair
    ended "not repaired: ... truncated; run `pipeline store repair`" - the command just run."""
    store, config = demo_store(tmp_path)
    clean = Path(shutil.copytree(store, tmp_path / "clean"))
    shard = sorted((store / "images" / "v1").glob("shard-*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "intact sample(s) of damaged shards copied" in res.output and "ok:" in res.output
    a, b = Store(clean).reader("images"), Store(store).reader("images")
    assert b.version == 2 and a.keys() == b.keys()
    assert all(a.files(k) == b.files(k) for k in a.keys())  # copied and re-rendered bytes equal the clean ones
    assert verify_store(store, progress=False) == []
