"""`--resume` on two ranks that do not see the same run folder (rank 1's listing lags one checkpoint behind, as
a shared filesystem's directory cache can right after a restart): every rank stops before loading anything, with
the same one line naming the folder, instead of rank 0 resuming at step 4 and rank 1 at step 2 (different
optimizer states and data positions, then collectives that no longer pair up: a hang or a gloo error). The same
for an encode's "up to date?", for the table versions train reads (its train and val splits; a node's own copy
of the store that differs) and for `run all`'s "is train done?" (tests/stages/rank_stale_view.py)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from models.lora import WEIGHT_NAME
from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs
from two_ranks import launch_two, results


def test_ranks_that_see_different_checkpoints_stop_with_one_line(tiny_edit_model, tmp_path) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    run(load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 4,
                           "train.checkpoint_every": 2}), store, tiny_edit_model, out)
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2, 4]

    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "train", str(store), tiny_edit_model, str(out), "6",
                                                      timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1, (last0, last1)
    assert f"the ranks do not see the same run folder {out}" in last0 and "step-4 on some, step-2 on others" in last0
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2, 4]  # nothing trained on


def test_resume_new_run_keeps_a_run_one_rank_cannot_read_on_every_rank(tiny_edit_model, tmp_path) -> None:
    """`--resume --new-run` over a run whose checkpoints rank 1 reads as damaged (its node's copy) and rank 0 as
    intact (alone, it would resume): no intact checkpoint is left for this launch, so the run is kept aside and
    every rank trains afresh, decided together. Before, rank 1's damaged line stopped every rank (a run --new-run asks to keep, refused);
    decided alone, rank 0 would have resumed while rank 1 started at step 0."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    run(load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 2,
                           "train.checkpoint_every": 2}), store, tiny_edit_model, out)
    step2 = (out / "checkpoints" / "step-2" / "optimizer.safetensors").read_bytes()

    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "damaged", str(store), tiny_edit_model,
                                                      str(out), timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    (kept,) = (tmp_path / "run.previous").iterdir()
    assert f"kept the previous run of {out} (its LoRA and checkpoints) in {kept}" in out0 + err0
    assert (kept / "checkpoints" / "step-2" / "optimizer.safetensors").read_bytes() == step2  # nothing deleted
    # trained afresh (rank 0 alone would have resumed step 2 to step 3, the run's checkpoint kept beside it)
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [3]


def test_an_encode_whose_ranks_see_the_table_differently_decides_together(tiny_edit_model, edit_store) -> None:
    """Rank 1 does not see the complete `text` v1 yet: before, rank 0 returned "up to date" at once while rank 1
    loaded the encoder and waited for it at the commit (a gloo error, NCCL: the collective timeout). Now every
    rank encodes (the look is agreed) and, the version seen by all after the model load, every rank reuses it."""
    from stages.encode import text as encode_text
    from store import Store

    encode_text.run(load_config(None), edit_store, tiny_edit_model, device="cpu")  # as the launched one
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "encode", str(edit_store),
                                                      tiny_edit_model, timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    assert "encode-text [2 ranks]: table 'text' v1 is up to date" in out0, out0
    assert Store(edit_store).tables()["text"] == 1 and not (edit_store / "text" / "v2").exists()


def test_an_encode_whose_ranks_read_different_images_versions_stops_with_one_line(tiny_edit_model, edit_store) -> None:
    """Rank 1 still reads `images` v1 when v2 is current (a resize-bucket commit between the ranks' leases, or a
    lagging view of store.json): the ranks would encode different inputs into one table; every rank stops."""
    import shutil

    from store import Store

    st = Store(edit_store)
    shutil.copytree(st.version_dir("images", 1), st.version_dir("images", 2))
    st.set_current("images", 2)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "encode", str(edit_store),
                                                      tiny_edit_model, "1", timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 and "the ranks do not read the same table 'images'" in last0 and "v2 on some, v1 on" in last0
    assert "text" not in Store(edit_store).tables()


def test_an_encode_whose_rank_cannot_adopt_the_version_found_stops_every_rank(tiny_edit_model, edit_store) -> None:
    """After the model load the ranks adopt the newest version any of them sees (stages/encode/output.py); rank 1
    cannot make it current (its view lags further). Before, rank 1 failed alone with its line while rank 0 said
    "up to date" (the launch half done, half failed); now every rank stops with rank 1's line."""
    from stages.encode import text as encode_text

    encode_text.run(load_config(None), edit_store, tiny_edit_model, device="cpu")
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "encode", str(edit_store),
                                                      tiny_edit_model, "unseen", timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, out0[-2000:], err0[-2000:], err1[-2000:])
    assert "up to date" not in out0, out0
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 and "table 'text' v1 is not complete; cannot make it current" in last0, (last0, last1)


def test_encoder_ranks_write_the_version_rank_0_opens_whatever_their_own_listing(tiny_edit_model, edit_store) -> None:
    """`text` v1 complete, then both ranks encode with another hashed setting (a new version): rank 1's listing of
    the table's folder lags (shows no version). Before, each rank picked the number from its own listing: rank 1
    took v1 and was refused ("another writer's version ... remove that folder": the complete v1), the launch
    stopped. Now rank 0 opens the version and every rank writes that one: v2 holds every sample."""
    from stages.encode import text as encode_text
    from store import Store

    encode_text.run(load_config(None), edit_store, tiny_edit_model, device="cpu")
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "encode", str(edit_store),
                                                      tiny_edit_model, "listing", timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    st = Store(edit_store)
    assert st.tables()["text"] == 2 and not (edit_store / "text" / "v3").exists()
    with st.reader("images") as images, st.reader("text", 2) as text:
        assert sorted(text.keys()) == sorted(images.keys())


def test_an_encoder_rank_that_does_not_see_the_version_rank_0_opened_writes_it(tiny_edit_model, edit_store) -> None:
    """As above, but rank 1's view lags further: it does not see the folder of the version rank 0 opened (v2) at
    all, nor its schema.json until its writer has waited once. Before, its writer's mkdir raised FileExistsError:
    a traceback on rank 1, the launch stopped. Now it writes v2, which holds every sample."""
    from stages.encode import text as encode_text
    from store import Store

    encode_text.run(load_config(None), edit_store, tiny_edit_model, device="cpu")
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "encode", str(edit_store),
                                                      tiny_edit_model, "hidden", timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    assert results(out1) == {"waits": "1"}  # its view did lag: it waited for the schema to show
    st = Store(edit_store)
    assert st.tables()["text"] == 2 and not (edit_store / "text" / "v3").exists()
    with st.reader("images") as images, st.reader("text", 2) as text:
        assert sorted(text.keys()) == sorted(images.keys())


def _text_v2_current(store) -> None:
    """`text` v2 made current: a copy of v1 (the same samples under another number, as a rebuild would be)."""
    import shutil

    from store import Store

    st = Store(store)
    shutil.copytree(st.version_dir("text", 1), st.version_dir("text", 2))
    st.set_current("text", 2)


def _stopped_alike(outs, code: int = 1) -> str:
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == code, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1, (last0, last1)
    return last0


def test_training_whose_ranks_read_different_versions_stops_with_one_line(tiny_edit_model, tmp_path) -> None:
    """Rank 1 reads `text` v1 while v2 is current (a commit between the ranks' opens, or its node's view of
    store.json lags). Before, each rank trained on its own version: the ranks' samples (and, where the versions
    differ in size, their step counts) did not match, silently or in a hang. Now every rank stops before
    training, with one line."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8, 4))
    _text_v2_current(store)
    line = _stopped_alike(launch_two("rank_stale_view.py", "tables", str(store), tiny_edit_model, str(out), "train",
                                     "1", timeout=300))
    assert f"train: the ranks do not read the same table 'text' of {store} (v2 on some, v1 on others" in line, line
    assert not train_state.complete_checkpoints(out / "checkpoints")


def test_validation_whose_ranks_read_different_versions_stops_with_one_line(tiny_edit_model, tmp_path) -> None:
    """The same for the val split the validator opens on every rank after the train split (a commit between
    the two opens): before, the ranks computed their shares of the grid from different samples."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8, 4))
    _text_v2_current(store)
    line = _stopped_alike(launch_two("rank_stale_view.py", "tables", str(store), tiny_edit_model, str(out), "val",
                                     "1", timeout=300))
    assert "train (validation): the ranks do not read the same table 'text'" in line, line
    assert "(v2 on some, v1 on others" in line, line


def test_training_whose_nodes_hold_different_copies_of_the_store_stops(tiny_edit_model, tmp_path) -> None:
    """--store names a separate copy on each node, and the copies differ (other samples, both `text` v1): the
    version numbers agree, their identities (number and manifest hash) do not. Before, each rank trained on its
    own copy's samples. (Here the two copies have two paths, so the two lines differ in the path alone.)"""
    store, copy, out = tmp_path / "store", tmp_path / "copy", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8, 4))
    make_train_store(copy, tiny_edit_model, mixed_specs(8, 4), seed=1)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "tables", str(store), tiny_edit_model,
                                                      str(out), "train", str(copy), timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    for err in (err0, err1):
        assert "train: the ranks read different contents as table 'text' v1 of" in err.strip().splitlines()[-1], err
    assert not train_state.complete_checkpoints(out / "checkpoints")


def test_a_finished_run_one_rank_does_not_see_is_decided_together(tiny_edit_model, tmp_path) -> None:
    """`pipeline run all` under a launcher asks train whether OUT already holds this run's final LoRA; rank 1's
    view of OUT lags (no lora/ yet). Before, rank 0 returned "up to date" at once while rank 1 went on to train
    and waited for it in the first collective (a gloo error; NCCL: the collective timeout). Now every rank goes
    on (the run resumes at its last step and rewrites the same LoRA) and ends normally."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    run(load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4,
                           "train.max_steps": 2, "train.checkpoint_every": 2}), store, tiny_edit_model, out)
    lora = load_file(out / "lora" / WEIGHT_NAME)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "done", str(store), tiny_edit_model,
                                                      str(out), timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    assert results(out0)["up_to_date"] == "False", out0
    again = load_file(out / "lora" / WEIGHT_NAME)  # the same weights (its metadata names the 2-rank start)
    assert again.keys() == lora.keys() and all(torch.equal(again[k], lora[k]) for k in lora)


def test_ranks_given_different_settings_stop_before_training_or_encoding(tiny_edit_model, tmp_path, edit_store):
    """Each rank reads --config and --set itself (a node's own copy of the config file that differs): rank 1
    trains at another learning rate, or encodes with another hashed setting. Before, the training ranks drifted
    apart silently (rank 0's weights alone saved), and the encode ranks each wrote its own version, then stopped
    at the commit with "ranks [1] have not finished". Now every rank stops at the start with one line naming the
    rank and the key, before anything is read (pipeline/node_settings.py), exit 2."""
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8, 4))
    line = _stopped_alike(launch_two("rank_stale_view.py", "tables", str(store), tiny_edit_model, str(out), "train",
                                     "settings", timeout=300), code=2)
    assert line.startswith("error: the ranks do not run with the same settings: rank 1's train.learning_rate is "
                           "0.0002, rank 0's 0.0001 "), line
    assert not train_state.complete_checkpoints(out / "checkpoints")
    # a node running another release of the training code (its TRAINING_REVISION differs)
    line = _stopped_alike(launch_two("rank_stale_view.py", "tables", str(store), tiny_edit_model, str(out), "train",
                                     "revision", timeout=300))
    assert "the ranks do not run the same training code (training revisions differ" in line, line
    assert not train_state.complete_checkpoints(out / "checkpoints")

    line = _stopped_alike(launch_two("rank_stale_view.py", "encode", str(edit_store), tiny_edit_model, "settings",
                                     timeout=300), code=2)
    assert "rank 1's encode_text.batching is \"padded\", rank 0's \"exact\"" in line, line


def test_a_val_sample_damaged_on_one_rank_is_left_out_on_every_rank(tiny_edit_model, tmp_path) -> None:
    """train.on_damaged=skip and rank 1 finds the first val sample damaged (its node's copy of the shard): every
    rank reads all the validator's samples and sums its share of the grid, so they must hold the same list.
    Before, rank 1 read the next row instead and the summed grid mixed two samples' losses under rank 0's keys;
    now the sample is left out on every rank (named on the others too)."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8, 4))
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "val-damaged", str(store),
                                                      tiny_edit_model, str(tmp_path / "run"), timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    keys0, keys1 = results(out0)["keys"].split(","), results(out1)["keys"].split(",")
    assert keys0 == keys1 and len(keys0) == 2, (keys0, keys1)
    damaged = results(out0)["damaged"]
    assert damaged == results(out1)["damaged"] and damaged and damaged not in keys0


def test_a_model_folder_one_rank_cannot_walk_stops_the_validator_on_every_rank(tiny_edit_model, tmp_path) -> None:
    """The validator walks the model folder (its files: the tables' check and the curve's record) on every rank:
    inside the agreement that opens the val split, as the fingerprint was before it became the files, so a rank
    whose walk fails stops every rank with its line. Walked before that block, rank 1 raised alone while rank 0
    waited for it in the agreement."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8, 4))
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "val-model", str(store),
                                                      tiny_edit_model, str(tmp_path / "run"), timeout=180)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    line0, line1 = results(out0)["error"], results(out1)["error"]
    assert "cannot be read on this node (injected)" in line0 and "cannot be read on this node (injected)" in line1, \
        (line0, line1, err0[-2000:])
