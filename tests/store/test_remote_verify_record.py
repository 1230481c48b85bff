"""`store verify URL` of a remote whose store.json is damaged: its advice is what works - push the store again into
an empty prefix, as push and every stage say. Before, it advised `pipeline store repair URL`, which refused at once
("push the store again into an empty prefix"): two commands telling the user to run each other's alternative."""

from __future__ import annotations

from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_push import push
from store_samples import fill


def test_verify_of_a_url_with_a_damaged_store_json_advises_what_works(s3_env, store: Store) -> None:
    fill(store, 4)
    url = s3_env.url()
    push(store.root, url)
    client, key = s3_env.client(), "store/store.json"
    bad = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    bad[len(bad) // 2] ^= 0x10
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(bad))

    verified = CliRunner().invoke(app, ["store", "verify", url])
    assert verified.exit_code == 1, verified.output
    lines = [line for line in verified.output.splitlines() if line.strip()]
    # a progress bar's last state may precede a line (stderr and stdout mixed here)
    record = [line[line.index(f"{url}/store.json "):] for line in lines if f"{url}/store.json " in line]
    assert len(record) == 1 and record[0].endswith("push the store again into an empty prefix"), lines
    assert lines[-1] == ("1 problem(s): push the store again into an empty prefix (from the local store it was "
                         "pushed from)"), lines
    repaired = CliRunner().invoke(app, ["store", "repair", url])  # what verify advised before: refused
    assert repaired.exit_code == 1 and "push the store again into an empty prefix" in repaired.output, \
        repaired.output
