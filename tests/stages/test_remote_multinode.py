"""Two nodes x one process (torchrun, a rendezvous on 127.0.0.1, gloo) on a store URL (the S3 test server), each
node with its own --cache-dir, as nodes without a shared filesystem: training gives the same LoRA as one process,
and an encoder whose node 1 is killed mid-run and rerun commits every sample exactly once, with the tensors of a
one-process local encode. Slow (fresh interpreters): one training launch, two encoder launches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml
from typer.testing import CliRunner

from models.lora import read_lora
from pipeline.cli import app
from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from store import Store
from store.remote_cache import local_store
from store.remote_pull import pull
from store.remote_push import push
from test_train_ddp import TRAIN
from test_train_multinode import kill_node, start_nodes
from train_store import assert_close_lora, make_train_store, mixed_specs


def _caches(tmp_path: Path) -> tuple[list[str], list[str]]:
    return ["--cache-dir", str(tmp_path / "cache-node0")], ["--cache-dir", str(tmp_path / "cache-node1")]


def _finished(nodes) -> list[tuple[str, str]]:
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def test_two_nodes_with_their_own_caches_train_the_same_lora_from_a_store_url(s3_env, tiny_edit_model, tmp_path):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(11))  # steps of 4, 4 and a tail of 3 (split 2 + 1)
    url = s3_env.url("features")
    push(store, url)
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": TRAIN}))
    run(load_config(cfg_file, {"train.batch_size": 4, "train.device": "cpu"}), store, tiny_edit_model, tmp_path / "one")

    nodes = start_nodes(["run", "train", "--store", url, "--model", tiny_edit_model, "--out", str(tmp_path / "two"),
                         "--config", str(cfg_file), "--batch-size", "2"], node_args=_caches(tmp_path))
    outs = _finished(nodes)
    # One 2-rank run: the summary and the CPU note come from global rank 0 (node 0) only.
    assert [sum(line.startswith("trained ") for line in out.splitlines()) for out, _ in outs] == [1, 0]
    assert sum((out + err).count("processes train on the CPU (gloo)") for out, err in outs) == 1
    ckpt = tmp_path / "two" / "checkpoints" / "step-3"
    assert {p.name for p in ckpt.glob("rng-rank*")} == {"rng-rank00.safetensors", "rng-rank01.safetensors"}
    assert train_state.ResumeRecord.read(ckpt / "resume.json").world_size == 2
    for node in (0, 1):  # each node read the remote through its own cache
        (cached,) = [p for p in (tmp_path / f"cache-node{node}").iterdir() if p.is_dir()]
        assert (cached / "text" / "v1" / "manifest.parquet").is_file() and (cached / "vae" / "v1").is_dir()
    assert_close_lora(read_lora(tmp_path / "one" / "lora")[0], read_lora(tmp_path / "two" / "lora")[0],
                      lr=TRAIN["learning_rate"], steps=3)


def _remote_tables(s3_env, prefix: str) -> tuple[dict, list[str]]:
    """The remote store.json's tables and the manifests there (what makes a version visible)."""
    from store.checksum import unseal

    client = s3_env.client()
    names = [o["Key"] for o in client.list_objects_v2(Bucket=s3_env.bucket, Prefix=prefix + "/").get("Contents", [])]
    record = unseal(client.get_object(Bucket=s3_env.bucket, Key=f"{prefix}/store.json")["Body"].read())
    return record["tables"], [n for n in names if n.endswith("/manifest.parquet")]


def test_an_encoder_on_two_nodes_caches_killed_and_rerun_commits_every_sample_once(
        s3_env, tiny_edit_model, edit_store, tmp_path):
    from store.verify import verify_store

    url = s3_env.url("enc")
    push(edit_store, url)
    cfg_file = tmp_path / "encode.yaml"  # tiny shards: every rank commits several, so the kill lands mid-table
    cfg_file.write_text(yaml.safe_dump({"encode_vae": {"shard_size_mb": 0.002, "batch_size": 1, "dtype": "float32",
                                                       "device": "cpu"}}))
    args = ["run", "encode-vae", "--store", url, "--model", tiny_edit_model, "--config", str(cfg_file)]
    # node 1's cache holds a stale in-progress vae/v1 of another run (another schema): its own pick would be v2,
    # node 0's v1; the ranks agree on one version
    root = local_store(url, ["images"], tmp_path / "cache-node1")  # node 1's cached copy (where it writes)
    (root / "vae" / "v1").mkdir(parents=True)
    (root / "vae" / "v1" / "schema.json").write_text(json.dumps({"name": "vae", "an": "older run"}))

    node0, node1 = start_nodes(args, ({}, {"STORE_CRASH_AT": "after_shard_commit"}), _caches(tmp_path))
    _, err1 = node1.communicate(timeout=300)
    assert node1.returncode != 0, err1[-2000:]  # node 1's worker was SIGKILLed right after its first shard
    assert "Signal 9" in err1 or "SIGKILL" in err1, err1[-2000:]
    kill_node(node0)  # node 0 waits for node 1 at the barrier: the job is lost
    node0.communicate(timeout=60)
    tables, manifests = _remote_tables(s3_env, "enc")
    assert "vae" not in tables and not [m for m in manifests if m.startswith("enc/vae/")]  # nothing visible
    assert list((root / "vae" / "v2").glob("shard-r01-*.tar"))  # node 1 committed a shard in its cache

    outs = _finished(start_nodes(args, node_args=_caches(tmp_path)))
    # rank 0 prints the summary, summed over the ranks (stages/encode/summary.py `over_ranks`): committed shards
    # kept, only the rest encoded
    done = re.search(r"\[2 ranks\].*skipped \(already done\) (\d+)", outs[0][0])
    assert done and int(done.group(1)) >= 1, outs[0]
    assert "committed table 'vae' v2 at " + url in outs[0][0]
    tables, manifests = _remote_tables(s3_env, "enc")
    assert tables["vae"]["current"] == 2 and "enc/vae/v2/manifest.parquet" in manifests
    for node in (0, 1):  # no cache keeps the version half (each held only its node's shards)
        assert not [p for p in (tmp_path / f"cache-node{node}").rglob("v2") if p.parent.name == "vae"]

    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert verify_store(pulled, progress=False) == []
    local = CliRunner().invoke(app, ["run", "encode-vae", "--store", str(edit_store), "--model", tiny_edit_model,
                                     "--config", str(cfg_file)])
    assert local.exit_code == 0, local.output
    images, one, two = Store(edit_store).reader("images"), Store(edit_store).reader("vae"), Store(pulled).reader("vae")
    assert sorted(two.keys()) == sorted(images.keys()) and len(two.manifest) == len(images)  # each exactly once
    for key in one.keys():
        a, b = one.tensors(key), two.tensors(key)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key


def _remote_rejects(s3_env, prefix: str) -> set[str]:
    from store import quarantine

    body = s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{prefix}/quarantine.parquet")["Body"].read()
    rows, why = quarantine.parsed(body)
    assert rows is not None, why
    return set(rows.column("key").to_pylist())


def test_a_commit_on_two_caches_that_lost_its_store_json_swap_is_adopted_and_every_nodes_rows_merged(
        s3_env, tiny_edit_model, edit_store, tmp_path):
    """Rank 0 of an encoder on two nodes' caches is killed right after the manifest, before store.json's swap: v1
    is complete on the remote, not current. The rerun counted v1 as taken, found nothing identical in its cache,
    and encoded everything again into v2 (hours at 1M samples); now it only redoes the swap. Each node's rejected
    samples (its cache's quarantine.parquet) reach the remote then, and also on a rerun that finds the table up
    to date: before, only global rank 0's cache was pushed there, so a node whose merge failed after the commit
    never had its rows on the remote."""
    from store import quarantine

    url = s3_env.url("swap")
    push(edit_store, url)
    cfg_file = tmp_path / "encode.yaml"
    cfg_file.write_text(yaml.safe_dump({"encode_vae": {"shard_size_mb": 0.002, "batch_size": 1, "dtype": "float32",
                                                       "device": "cpu"}}))
    args = ["run", "encode-vae", "--store", url, "--model", tiny_edit_model, "--config", str(cfg_file)]
    node0, node1 = start_nodes(args, ({"STORE_CRASH_AT": "after_manifest"}, {}), _caches(tmp_path))
    node0.communicate(timeout=300)
    assert node0.returncode != 0
    kill_node(node1)  # waiting for rank 0 at the commit
    node1.communicate(timeout=60)
    tables, manifests = _remote_tables(s3_env, "swap")
    assert "vae" not in tables and [m for m in manifests if "/vae/" in m] == ["swap/vae/v1/manifest.parquet"]

    def reject(key: str) -> None:  # a sample node 1 rejected, in its cache only
        root = local_store(url, ["images"], tmp_path / "cache-node1", lease=False)
        quarantine.add_rows(root, [{"key": key, "source": "s", "stage": "encode-vae", "reason": "too_small"}])

    reject("rejected-by-node-1")
    outs = _finished(start_nodes(args, node_args=_caches(tmp_path)))
    assert "is up to date" in outs[0][0] and f"committed table 'vae' v1 at {url}" in outs[0][0], outs[0]
    tables, manifests = _remote_tables(s3_env, "swap")
    assert tables["vae"]["current"] == 1 and not [m for m in manifests if "/vae/v2/" in m]  # nothing encoded again
    for node in (0, 1):  # each node's part of v1 left its cache
        assert not [p for p in (tmp_path / f"cache-node{node}").rglob("v1") if p.parent.name == "vae"]
    assert "rejected-by-node-1" in _remote_rejects(s3_env, "swap")

    reject("rejected-by-node-1-later")  # as if its merge after a commit had failed
    outs = _finished(start_nodes(args, node_args=_caches(tmp_path)))
    assert "v1 is up to date" in outs[0][0], outs[0]
    assert "rejected-by-node-1-later" in _remote_rejects(s3_env, "swap")
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert sorted(Store(pulled).reader("vae").keys()) == sorted(Store(edit_store).reader("images").keys())


def test_two_nodes_refusing_a_version_that_left_a_damaged_input_out_say_so_once_and_carry_its_samples(
        s3_env, tiny_edit_model, edit_store, tmp_path):
    """The remote's text v1 (on_damaged=skip left a sample damaged on the server out; its store.json swap lost),
    refused by two nodes' fresh caches under stop: rank 0 alone says so, in one line (each node's local rank 0
    printed it before: the same line once per node), and the run stops on the sample; once it is repaired, the
    rerun carries v1's samples forward on both nodes (v1 opened in each cache) and encodes only that one."""
    from damage import damaged_on_server, lose_current

    url, keys, key, repair = damaged_on_server(s3_env, edit_store, "nodes")
    args = ["run", "encode-text", "--model", tiny_edit_model, "--device", "cpu", "--json", "--store", url]
    one = CliRunner().invoke(app, [*args, "--cache-dir", str(tmp_path / "cache-one"), "--set",
                                   "encode_text.on_damaged=skip", "--set", "encode_text.max_damaged_fraction=0.5"])
    assert one.exit_code == 0, one.output
    lose_current(s3_env, "nodes", "text")  # its store.json swap lost

    nodes = start_nodes(args, node_args=_caches(tmp_path))
    outs = [p.communicate(timeout=300) for p in nodes]
    assert all(p.returncode != 0 for p in nodes), outs
    said = [(out + err).count("left out 1 damaged input sample(s)") for out, err in outs]
    assert said == [1, 0], outs  # rank 0 alone
    assert key in outs[0][0] + outs[0][1]

    repair()
    outs = _finished(start_nodes(args, node_args=_caches(tmp_path)))
    rec = json.JSONDecoder().raw_decode(outs[0][0][outs[0][0].index("{"):])[0]
    assert (rec["up_to_date"], rec["version"], rec["encoded"]) == (False, 2, 1), rec
    assert rec["reused"] + rec["resumed"] == len(keys) - 1, rec
    tables, _ = _remote_tables(s3_env, "nodes")
    assert tables["text"]["current"] == 2
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert sorted(Store(pulled).reader("text").keys()) == sorted(keys)
