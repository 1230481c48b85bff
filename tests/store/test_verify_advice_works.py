"""`store verify`'s advice is a command that gets the user out, and the one advice of its lines and its summary.
Before: a current version without its manifest was advised `store repair`, which then refused it ("rerun the stage
that writes it"); a store URL's damaged checksums.json was advised both "rerun `pipeline run encode-vae`" (its line)
and `store repair URL` (the summary), while repair said "delete it and push that version again": three answers."""

from __future__ import annotations

import io
import json

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_push import push
from store_samples import fill


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def _last(r) -> str:
    return r.output.strip().splitlines()[-1]


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_a_current_version_without_its_manifest_is_advised_the_rerun_that_completes_it(tmp_path) -> None:
    src, store = tmp_path / "src", tmp_path / "st"
    src.mkdir()
    for p in range(4):
        (src / f"t{p}.png").write_bytes(_png(2 * p))
        (src / f"c{p}.png").write_bytes(_png(2 * p + 1))
    (src / "m.jsonl").write_text("".join(json.dumps({"target": f"t{p}.png", "controls": [f"c{p}.png"],
                                                     "caption": f"edit {p}"}) + "\n" for p in range(4)))
    stage = ["run", "resize-bucket", "--source", src / "m.jsonl", "--store", store, "--set",
             "resize.target_area=4096", "--set", "resize.multiple=16"]
    assert _cli(*stage).exit_code == 0
    (store / "images" / "v1" / "manifest.parquet").unlink()  # a commit cut short before its last file
    r = _cli("store", "verify", store)
    assert r.exit_code == 1, r.output
    advice = "rerun `pipeline run resize-bucket` with the same store, model and config: it completes the version"
    assert _last(r) == f"1 problem(s): {advice}", r.output
    repaired = _cli("store", "repair", store)  # what it advised before: refused, for the same reason
    assert repaired.exit_code == 1 and advice in repaired.output, repaired.output
    assert _cli(*stage).exit_code == 0  # the advice, followed
    r = _cli("store", "verify", store)
    assert r.exit_code == 0, r.output
    assert len(Store(store, create=False).reader("images")) == 4


def test_a_url_whose_checksums_json_is_damaged_is_given_one_advice_that_works(s3_env, store: Store) -> None:
    fill(store, 4)
    url = s3_env.url()
    push(store.root, url)
    client, key = s3_env.client(), "store/vae/v1/checksums.json"
    bad = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    bad[len(bad) // 2] ^= 0x10
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(bad))
    r = _cli("store", "verify", url)
    assert r.exit_code == 1, r.output
    advice = (f"delete {url}/vae/v1/checksums.json (objects are never overwritten) and push that version again "
              "from an intact store")
    assert _last(r) == f"1 problem(s): {advice}", r.output
    assert "rerun" not in r.output and "`pipeline store repair" not in r.output.replace(
        "`pipeline store repair` cannot fix this", ""), r.output
    # the advice, followed: the object deleted, the local store pushed again
    client.delete_object(Bucket=s3_env.bucket, Key=key)
    assert _cli("store", "push", store.root, url).exit_code == 0
    r = _cli("store", "verify", url)
    assert r.exit_code == 0, r.output
