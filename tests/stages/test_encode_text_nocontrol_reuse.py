"""`encode_text.no_control_embeds` only adds columns (`schemas.lineage.adds_columns`): a complete `text` version
encoded with it true serves a run with it false (up to date, made current, nothing encoded), and train reads the
same data from it; false -> true still makes a new version (the column is missing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store

F32 = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"}
ON = {**F32, "encode_text.no_control_embeds": True}
TRAIN = {"train.device": "cpu", "train.max_steps": 2, "train.batch_size": 2, "train.lora.rank": 4}


def _lora(run) -> dict[str, torch.Tensor]:
    return {f.name: load_file(f) for f in sorted(Path(run.lora_dir).glob("*.safetensors"))}


def test_turning_no_control_embeds_off_reuses_the_table_and_trains_the_same_lora(tiny_plus_model, plus_store, tmp_path):
    from stages.train.current import up_to_date as train_current
    from stages.train.recipe import run as train

    off_store = Path(shutil.copytree(plus_store, tmp_path / "off"))  # the same images, encoded with it false
    on = encode_text.run(load_config(None, ON), plus_store, tiny_plus_model)
    n = on.encoded
    assert n > 0
    off = load_config(None, {**F32, **TRAIN})  # train.control_dropout 0 (its default)
    for store in (plus_store, off_store):
        encode_vae.run(off, store, tiny_plus_model)
    trained = train(off, plus_store, tiny_plus_model, tmp_path / "run")
    # other settings replace it as current meanwhile; the rerun with it false makes it current again
    assert encode_text.run(load_config(None, {**F32, "encode_text.batching": "padded"}), plus_store,
                           tiny_plus_model).version == on.version + 1

    again = encode_text.run(off, plus_store, tiny_plus_model)
    assert again.up_to_date and again.encoded == 0 and again.reused == 0 and again.version == on.version
    st = Store(plus_store)
    assert st.tables()["text"] == on.version and st.versions("text") == [on.version, on.version + 1]
    assert "nocontrol_embeds" in st.reader("text").tensors(st.reader("text").keys()[0])  # the table as it was
    # train's run names the same tables: the LoRA trained before the switch is still this run's, nothing retrained
    assert train_current(off, plus_store, tiny_plus_model, tmp_path / "run")

    # a table encoded with it false: train with control_dropout 0 reads the same prompt and empty embeddings
    # (bit for bit: `exact` batching on the CPU) and gives the same LoRA, bit for bit
    assert encode_text.run(off, off_store, tiny_plus_model).encoded == n
    a, b = Store(plus_store).reader("text"), Store(off_store).reader("text")
    for key in a.keys():
        assert all(torch.equal(a.tensors(key)[t], b.tensors(key)[t]) for t in ("prompt_embeds", "empty_embeds"))
    other = train(off, off_store, tiny_plus_model, tmp_path / "run-off")
    lora, lora_off = _lora(trained), _lora(other)
    assert lora.keys() == lora_off.keys() and lora
    assert all(torch.equal(lora[f][k], lora_off[f][k]) for f in lora for k in lora[f])
    assert list(trained.losses) == list(other.losses)

    # false -> true must compute the missing column (each sample completed: test_encode_text_nocontrol_complete.py):
    # a new version, and train's run no longer matches it
    assert train_current(off, off_store, tiny_plus_model, tmp_path / "run-off")
    turned_on = encode_text.run(load_config(None, ON), off_store, tiny_plus_model)
    assert not turned_on.up_to_date and turned_on.completed == n and turned_on.version == 2
    assert not train_current(off, off_store, tiny_plus_model, tmp_path / "run-off")


def test_a_21_table_with_reference_dropout_embeds_serves_a_run_without(tiny_21_model, tmp_path):
    from test_qwen21_stages import write_store21

    store = write_store21(tmp_path / "s")
    on = encode_text.run(load_config(None, ON), store, tiny_21_model)
    off = encode_text.run(load_config(None, F32), store, tiny_21_model)
    assert on.encoded > 0 and off.up_to_date and off.encoded == 0 and off.version == on.version
    other = write_store21(tmp_path / "other")
    first = encode_text.run(load_config(None, F32), other, tiny_21_model)
    turned_on = encode_text.run(load_config(None, ON), other, tiny_21_model)
    assert not turned_on.up_to_date and turned_on.completed == first.encoded and turned_on.version == 2


def test_on_a_store_url_a_version_encoded_with_it_on_serves_from_the_cache_and_from_the_remote(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path) -> None:
    """The remote's current version is in every cache (found as locally); one another setting's version replaced
    as current is found by the remote listing (`on_remote`), made current there, nothing encoded."""
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app
    from store.checksum import unseal
    from store.remote_push import push

    url = s3_env.url("nocontrol")
    push(edit_store, url)

    def run(cache: str, *settings: str) -> dict:
        res = CliRunner().invoke(app, ["run", "encode-text", "--model", tiny_edit_model, "--device", "cpu", "--json",
                                       *settings, "--store", url, "--cache-dir", str(tmp_path / cache)])
        assert res.exit_code == 0, res.output
        return json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]

    def current() -> int:
        body = s3_env.client().get_object(Bucket=s3_env.bucket, Key="nocontrol/store.json")["Body"].read()
        return unseal(body)["tables"]["text"]["current"]

    on = run("node-a", "--set", "encode_text.no_control_embeds=true")
    assert (on["version"], on["up_to_date"], current()) == (1, False, 1)
    off = run("node-b")  # a fresh cache: it holds the remote's current version
    assert (off["version"], off["encoded"], off["up_to_date"], current()) == (1, 0, True, 1)
    assert run("node-a", "--set", "encode_text.batching=padded")["version"] == 2 and current() == 2
    fresh = run("node-c")  # v1 is neither current nor in this cache: the remote's listing finds it
    assert (fresh["version"], fresh["encoded"], fresh["up_to_date"], current()) == (1, 0, True, 1)
    assert not s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="nocontrol/text/v3/").get("Contents")
