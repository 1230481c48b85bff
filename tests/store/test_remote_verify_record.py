"""A store URL whose store.json is damaged (the bucket's copy): `store repair URL` rebuilds it from the versions
there (each table's newest intact complete version), as `store repair` does for a local folder, and verify, push
and every stage advise it. Before, the advice was to push the store again into an empty prefix (every object sent
again, from a local store that may no longer exist), and `store repair URL` refused it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store import format as fmt
from store.remote_push import push
from store_samples import fill


def _damage(s3_env, key: str) -> None:
    client = s3_env.client()
    bad = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    bad[len(bad) // 2] ^= 0x10
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(bad))


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def test_a_damaged_store_json_at_a_url_is_advised_and_rebuilt_by_store_repair(s3_env, store: Store) -> None:
    fill(store, 4)
    fill(store, 4, tag="b", start=4)  # vae v2 current
    url = s3_env.url()
    push(store.root, url)
    _damage(s3_env, "store/store.json")

    verified = _cli("store", "verify", url)
    assert verified.exit_code == 1, verified.output
    lines = [line for line in verified.output.splitlines() if line.strip()]
    advice = f"`pipeline store repair {url}` rebuilds its store.json from the versions there, then repairs the rest"
    assert lines[-1] == f"1 problem(s): {advice}", lines
    refused = _cli("store", "push", store.root, url)  # push's own line advises the same
    assert refused.exit_code == 1 and f"run `pipeline store repair {url}`" in refused.output, refused.output

    dry = _cli("store", "repair", url, "--dry-run")
    assert dry.exit_code == 0 and "rebuilt naming vae v2" in dry.output, dry.output
    assert _cli("store", "verify", url).exit_code == 1  # a dry run changes nothing

    repaired = _cli("store", "repair", url)
    assert repaired.exit_code == 0 and "store.json rebuilt" in repaired.output, repaired.output
    verified = _cli("store", "verify", url)
    assert verified.exit_code == 0, verified.output
    assert _cli("store", "push", store.root, url).exit_code == 0


def test_a_newest_version_whose_manifest_is_damaged_is_not_made_current(s3_env, store: Store) -> None:
    """As a local rebuild: the newest intact version, not merely the newest."""
    url = s3_env.url()
    fill(store, 4)
    push(store.root, url)  # v1 there (a push sends no version the store's gc would remove)
    fill(store, 4, tag="b", start=4)
    push(store.root, url)
    _damage(s3_env, "store/store.json")
    _damage(s3_env, f"store/vae/v2/{fmt.MANIFEST}")

    repaired = _cli("store", "repair", url, "--dry-run")
    assert repaired.exit_code == 0 and "rebuilt naming vae v1" in repaired.output, repaired.output


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_damaged_store_json_over_no_versions_is_no_store(s3_env, store: Store, dry_run: bool) -> None:
    fill(store, 4)
    url = s3_env.url()
    push(store.root, url)
    client = s3_env.client()
    for obj in client.list_objects_v2(Bucket=s3_env.bucket, Prefix="store/vae/")["Contents"]:
        client.delete_object(Bucket=s3_env.bucket, Key=obj["Key"])
    _damage(s3_env, "store/store.json")

    repaired = _cli("store", "repair", url, *(["--dry-run"] if dry_run else []))
    assert repaired.exit_code == 1, repaired.output
    assert "holds no table versions to rebuild it from" in repaired.output, repaired.output


def test_a_newer_releases_store_json_at_a_url_is_not_rebuilt(s3_env, store: Store) -> None:
    """Intact, of a later format: not damage, never rewritten in this format (its record would be lost)."""
    from store.checksum import seal, unseal

    fill(store, 4)
    url = s3_env.url()
    push(store.root, url)
    client, key = s3_env.client(), "store/store.json"
    rec = unseal(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    newer = seal({**rec, "format_version": fmt.STORE_FORMAT_VERSION + 1})
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=newer)

    repaired = _cli("store", "repair", url)
    assert repaired.exit_code == 1 and "rebuilt" not in repaired.output, repaired.output
    assert client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read() == newer
