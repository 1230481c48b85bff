"""encode-vae on 2 nodes x 1 process (torchrun, gloo, one local store): node 1 killed after its first committed
shard, node 0 then stopped, the launch rerun: the table holds every sample exactly once and verifies. Slow (two
launches of two fresh interpreters): one test."""

from __future__ import annotations

import re

import yaml

from store import Store
from test_train_multinode import kill_node, start_nodes


def test_an_encoder_with_a_node_killed_and_rerun_commits_every_sample_once(tiny_edit_model, edit_store, tmp_path):
    from store.verify import verify_store

    cfg_file = tmp_path / "encode.yaml"  # tiny shards: every rank commits several, so the kill lands mid-table
    cfg_file.write_text(yaml.safe_dump({"encode_vae": {"shard_size_mb": 0.002, "batch_size": 2, "dtype": "float32",
                                                       "device": "cpu"}}))
    args = ["run", "encode-vae", "--store", str(edit_store), "--model", tiny_edit_model, "--config", str(cfg_file)]

    node0, node1 = start_nodes(args, ({}, {"STORE_CRASH_AT": "after_shard_commit"}))
    _, err1 = node1.communicate(timeout=300)
    assert node1.returncode != 0, err1[-2000:]  # node 1's worker was SIGKILLed right after its first shard
    assert "Signal 9" in err1 or "SIGKILL" in err1, err1[-2000:]
    kill_node(node0)  # node 0 waits for node 1 at the commit barrier: the job is lost
    node0.communicate(timeout=60)
    assert "vae" not in Store(edit_store).tables()  # no table version committed ...
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (edit_store / "vae").rglob("shard-r01-*.tar")}
    assert kept  # ... but node 1's first shard was

    nodes = start_nodes(args)
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    # rank 0 prints the summary, summed over the ranks (stages/encode/summary.py `over_ranks`)
    done = re.search(r"\[2 ranks\].*skipped \(already done\) (\d+)", outs[0][0])
    assert done and int(done.group(1)) >= 1, outs[0]
    now = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (edit_store / "vae").rglob("shard-r01-*.tar")}
    assert kept.items() <= now.items(), (kept, now)  # node 1 kept its committed shard (not rewritten), did the rest
    images, vae = Store(edit_store).reader("images"), Store(edit_store).reader("vae")
    assert sorted(vae.keys()) == sorted(images.keys()) and len(vae.manifest) == len(images)  # each exactly once
    assert verify_store(edit_store, progress=False) == []
