"""A sample damaged on the S3 server, read through this node's cache of the store URL: the error names the object's
URL and advises `pipeline store repair URL`, not the cache folder. Before, it named the cache folder and advised
`pipeline store repair CACHE`, which changed nothing on the remote and stopped in a traceback (FileNotFoundError on
the damaged shard the cache never kept); `store verify CACHE` advised the same."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from damage import damaged_on_server
from pipeline.cli import app
from store import Store
from store.integrity import DamagedData
from store.remote_cache import local_store


def test_a_sample_damaged_on_the_server_is_named_by_its_url_and_repaired_there(s3_env, edit_store: Path,
                                                                             tmp_path: Path) -> None:
    url, _, key, _ = damaged_on_server(s3_env, edit_store, "dmg")
    cache = local_store(url, ["images"], tmp_path / "cache")
    with Store(cache, create=False).reader("images") as r, pytest.raises(DamagedData) as caught:
        r.files(key)
    message = str(caught.value)
    assert f"({url}/images/v1, cached in " in message and key in message, message
    assert f"run `pipeline store repair {url}` to recompute it" in message, message

    verified = CliRunner().invoke(app, ["store", "verify", str(cache)])
    assert verified.exit_code == 1 and f"`pipeline store repair {url}` recomputes" in verified.output, verified.output

    repaired = CliRunner().invoke(app, ["store", "repair", str(cache), "--dry-run"])
    assert repaired.exit_code == 1, repaired.output
    lines = [line for line in repaired.output.splitlines() if line.strip()]
    assert lines == [f"error: {cache} is this node's cache of {url}, not a store to repair: run `pipeline store "
                     f"repair {url}` (the damage is in the remote's objects; add the --model / --config the store "
                     "was built with)"], repaired.output
