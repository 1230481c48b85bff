"""Turning `encode_text.no_control_embeds` on over a `text` table encoded without it completes that table's
samples: their stored prompt and empty embeddings are carried and only the nocontrol ones computed (before, every
sample went through the VL encoder again, images and all), the table equal to a fresh encode's bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode.output import PART_LINEAGES_ATTR
from store import Store

F32 = {"encode_text.dtype": "float32"}
ON = {**F32, "encode_text.no_control_embeds": True}
META = ("split", "img_shapes", "length", "empty_length", "num_controls")


def _same_tables(a_store: Path, b_store: Path, tensors=("prompt_embeds", "empty_embeds", "nocontrol_embeds")) -> None:
    a, b = Store(a_store).reader("text"), Store(b_store).reader("text")
    assert sorted(a.keys()) == sorted(b.keys()) and a.keys()
    for key in a.keys():
        ta, tb = a.tensors(key), b.tensors(key)
        assert ta.keys() == tb.keys() == set(tensors)
        assert all(ta[t].dtype == tb[t].dtype and torch.equal(ta[t], tb[t]) for t in ta), key
        assert a.cells(key, META) == b.cells(key, META), key


def test_turning_it_on_computes_only_the_nocontrol_embeds_and_equals_a_fresh_encode(
        tiny_plus_model, plus_store, tmp_path):
    fresh = Path(shutil.copytree(plus_store, tmp_path / "fresh"))
    off = encode_text.run(load_config(None, F32), plus_store, tiny_plus_model)
    n = off.encoded
    assert n > 0

    on = encode_text.run(load_config(None, ON), plus_store, tiny_plus_model)
    assert (on.version, on.encoded, on.reused, on.quarantined) == (off.version + 1, 0, 0, 0)
    assert on.completed == n
    assert on.to_json()["completed"] == n and f"completed {n}" in str(on)
    # one forward item per sample (its nocontrol prompt); a full encode puts three through per sample
    assert on.forward_items == n
    st = Store(plus_store)
    off_lineage = st.reader("text", off.version).schema.attrs["feature_lineage"]
    part = st.reader("text", on.version).schema.attrs[PART_LINEAGES_ATTR]
    assert part["feature_lineages"] == [off_lineage] and "prompt_embeds" in part["columns"]

    whole = encode_text.run(load_config(None, ON), fresh, tiny_plus_model)
    assert (whole.encoded, whole.completed) == (n, 0) and whole.forward_items == 3 * n
    _same_tables(plus_store, fresh)

    # on again: up to date; on -> off: the table with them serves, nothing computed
    assert encode_text.run(load_config(None, ON), plus_store, tiny_plus_model).up_to_date
    back = encode_text.run(load_config(None, F32), plus_store, tiny_plus_model)
    assert back.up_to_date and (back.encoded, back.completed, back.version) == (0, 0, on.version)


def test_other_settings_or_model_files_with_it_on_encode_every_sample_whole(tiny_plus_model, plus_store, tmp_path):
    """Only a table of the very same settings and component files but it is completed: another template (a changed
    start index), or a changed tokenizer file, encodes every sample again, nothing of the old table is taken."""
    off = encode_text.run(load_config(None, F32), plus_store, tiny_plus_model)
    other = encode_text.run(load_config(None, {**ON, "encode_text.prompt_template_start_idx": 63}), plus_store,
                            tiny_plus_model)
    assert (other.encoded, other.completed, other.reused) == (off.encoded, 0, 0)
    model = Path(shutil.copytree(tiny_plus_model, tmp_path / "model"))
    config = next((model / "tokenizer").glob("tokenizer_config.json"))
    config.write_text(config.read_text() + "\n")  # the same tokenizer, other bytes: another fingerprint
    changed = encode_text.run(load_config(None, ON), plus_store, str(model))
    assert (changed.encoded, changed.completed, changed.reused) == (off.encoded, 0, 0)


def test_a_damaged_stored_sample_is_encoded_whole_not_completed(tiny_plus_model, plus_store, tmp_path):
    """A stored sample whose bytes fail their checksum when read for completion is not copied: encoded whole, the
    table still a fresh encode's."""
    from damage import flip_bit, key_at, sample_byte

    fresh = Path(shutil.copytree(plus_store, tmp_path / "fresh"))
    n = encode_text.run(load_config(None, F32), plus_store, tiny_plus_model).encoded
    bad = key_at(plus_store, "text", 1)
    flip_bit(*sample_byte(plus_store, "text", bad, "prompt_embeds"), 3)
    on = encode_text.run(load_config(None, ON), plus_store, tiny_plus_model)
    assert (on.encoded, on.completed, on.reused) == (1, n - 1, 0)
    encode_text.run(load_config(None, ON), fresh, tiny_plus_model)
    _same_tables(plus_store, fresh)


def test_a_21_table_is_completed_too(tiny_21_model, tmp_path):
    """Qwen-Image-2.1: the stored embeddings and slot masks carried, the instruction alone encoded for the samples
    with references (one without has its prompt as it), bit for bit a fresh encode's table."""
    from test_qwen21_stages import write_store21

    store, fresh = write_store21(tmp_path / "s"), write_store21(tmp_path / "fresh")
    n = encode_text.run(load_config(None, F32), store, tiny_21_model).encoded
    on = encode_text.run(load_config(None, ON), store, tiny_21_model)
    assert (on.encoded, on.reused, on.completed) == (0, 0, n) and n > 0
    assert on.forward_items < n * 3  # a full encode: prompt, empty and alone per sample
    assert encode_text.run(load_config(None, ON), fresh, tiny_21_model).encoded == n
    _same_tables(store, fresh, ("prompt_embeds", "empty_embeds", "nocontrol_embeds", "slot_mask", "empty_slot_mask"))


def test_two_launched_ranks_complete_their_shares(tiny_edit_model, edit_store, tmp_path):
    """Each rank completes its share of the stored samples (an Edit model: its template's one vision slot
    removed); the summed line counts them, and the table is a fresh single-process encode's."""
    from two_ranks import launch_two

    fresh = Path(shutil.copytree(edit_store, tmp_path / "fresh"))
    n = encode_text.run(load_config(None), edit_store, tiny_edit_model, device="cpu").encoded
    (rc0, out0, err0), (rc1, _, err1) = launch_two(
        "rank_cli.py", "run", "encode-text", "--store", str(edit_store), "--model", tiny_edit_model, "--device", "cpu",
        "--set", "encode_text.no_control_embeds=true", timeout=300)
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    assert f"encode-text [2 ranks]: table 'text' v2: encoded 0, reused 0, completed {n} " in out0, out0
    encode_text.run(load_config(None, {"encode_text.no_control_embeds": True}), fresh, tiny_edit_model, device="cpu")
    _same_tables(edit_store, fresh)


def test_on_a_store_url_a_version_completed_under_another_device_setting_is_adopted(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path) -> None:
    """A version's schema names the lineage its completed rows' part was stored under as the settings hash it now
    (device is not hashed): a complete version with it on, no longer current on the remote, is found and made
    current by a run of the very same settings from a fresh cache with another `device` spelling. Before, the
    schema listed the lineages of every earlier spelling, which follow the configured device, so that run's
    schema differed: the version was passed over and every sample encoded again into a new one."""
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app
    from store.remote_push import push

    url = s3_env.url("complete")
    push(edit_store, url)

    def run(cache: str, *args: str) -> dict:
        res = CliRunner().invoke(app, ["run", "encode-text", "--model", tiny_edit_model, "--json", *args,
                                       "--store", url, "--cache-dir", str(tmp_path / cache)])
        assert res.exit_code == 0, res.output
        return json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]

    off = run("node-a", "--device", "cpu")
    on = run("node-a", "--device", "cpu", "--set", "encode_text.no_control_embeds=true")
    assert (on["version"], on["completed"], on["encoded"]) == (2, off["encoded"], 0)
    assert run("node-a", "--device", "cpu", "--set", "encode_text.batching=padded")["version"] == 3
    again = run("node-b", "--set", "encode_text.device=auto", "--set", "encode_text.no_control_embeds=true")
    assert (again["version"], again["up_to_date"], again["encoded"], again.get("completed", 0)) == (2, True, 0, 0)
