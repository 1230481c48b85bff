"""Several nodes training into one `--out` must see one folder (rank 0 writes each checkpoint, every rank adds
its RNG file and reads the checkpoint on --resume), as encoders writing a local store (each rank writes its
shards, rank 0 commits them). Two gloo processes, each given its own folder as a node's own disk under the same
path would be: before, both trained and rank 1 died with a traceback at the first checkpoint (its RNG file's
folder did not exist there), or on --resume the ranks went on from different steps; now both stop at the start
with one line naming the rank and its host (models/shared_folder.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from store import Store

from train_store import make_train_store, mixed_specs
from two_ranks import launch_two, results


def test_folders_not_shared_by_every_node_are_refused_at_the_start(tiny_edit_model, edit_store,
                                                                  tmp_path: Path) -> None:
    store = tmp_path / "train-store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    images = [Path(shutil.copytree(edit_store, tmp_path / f"node{n}" / "store")) for n in (0, 1)]
    outs = launch_two("shared_out_ranks.py", str(store), tiny_edit_model, str(tmp_path / "node0" / "run"),
                      str(tmp_path / "node1" / "run"), *map(str, images))
    (rc0, out0, err0), (rc1, out1, err1) = outs
    r0, r1 = results(out0), results(out1)
    assert "Traceback" not in err0 + err1, (err0[-3000:], err1[-3000:])
    assert r0 == r1 and set(r0) == {"train", "encode"}, (r0, r1)
    for case in r0.values():
        assert case.startswith("1 error: ") and "is not the same folder on every node: rank 1" in case, case
    assert "--out" in r0["train"] and "the store" in r0["encode"]
    assert not (tmp_path / "node0" / "run" / "checkpoints").exists()  # refused before any work
    for folder in (tmp_path / "node0" / "run", images[0]):
        assert not list(folder.glob(".shared-probe-*"))  # the probe is removed
    assert "vae" not in Store(images[0], create=False).tables()
