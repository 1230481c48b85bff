"""`pipeline demo --store s3://bucket/prefix` against the S3 test server (moto on 127.0.0.1): every stage runs with
its store on the URL (configured by the AWS_* environment only); the remote then holds the three tables, which pull
back checked and verify; the held-out losses are those of the demo on a local store; a rerun finds every
stage up to date."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_pull import pull
from store.verify import verify_store


# the demo, smaller: a few steps and one generated sample keep it to a minute on a busy CPU
SMALL = ["-s", "train.max_steps=2", "-s", "train.checkpoint_every=2", "-s", "evaluate.num_samples=1",
         "-s", "evaluate.num_inference_steps=2", "-s", "evaluate.noise_seeds=[0]", "-s", "evaluate.timesteps=[0.5]"]


def test_demo_runs_end_to_end_on_a_store_url(s3_env, tmp_path: Path) -> None:
    url = s3_env.url("demo")
    work = tmp_path / "work"
    res = CliRunner().invoke(app, ["demo", "--workdir", str(work), "--store", url, *SMALL])
    assert res.exit_code == 0, res.output
    assert "== demo summary" in res.output and f"--cache-dir {work / 'store-cache'}" in res.output
    for table in ("images", "text", "vae"):
        assert f"copied {table}/v1" in res.output  # each writer pushed its table as it committed
    assert not (work / "store").exists()  # the store is the URL; locally only its cache
    assert (work / "run" / "lora").is_dir() and (work / "report" / "metrics.json").is_file()

    keys = {o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_env.bucket)["Contents"]}
    assert {f"demo/{t}/v1/manifest.parquet" for t in ("images", "text", "vae")} <= keys
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert verify_store(pulled) == []
    assert Store(pulled, create=False).tables() == {"images": 1, "text": 1, "vae": 1}
    # the same numbers as the demo on a local store
    local = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "local"), *SMALL])
    assert local.exit_code == 0, local.output
    loss, reference = (json.loads((w / "report" / "metrics.json").read_text())["loss"]
                       for w in (work, tmp_path / "local"))
    assert loss["overall"]["n"] > 0 and loss["overall"] == reference["overall"]
    assert loss["per_sample"] == reference["per_sample"]

    again = CliRunner().invoke(app, ["demo", "--workdir", str(work), "--store", url, *SMALL])
    assert again.exit_code == 0, again.output
    assert again.output.count("skipped, up to date") == 5, again.output
    assert "nothing new" in again.output  # nothing pushed twice
