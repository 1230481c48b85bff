"""Credentials against a server that checks them: moto with its IAM authentication on (`enable_iam_authentication`,
the in-process form of moto's INITIAL_NO_AUTH_ACTION_COUNT=0), an IAM user whose key may do s3:*. A wrong secret,
an unknown key id, or none: one line saying what (access denied / no credentials), which URL, what to do. No secret
key - the wrong one tried or the right one - appears in any message, log line, or file the commands store (the
local store, its cache, the lease objects written on the remote: a key given as `-o secret=...` on the command
line was copied into every lease record's argv)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store, lease
from store import remote as remote_mod
from store_samples import fill

WRONG_SECRET = "wrongSecret/Def456+uvwWRONG111111111111"


@pytest.fixture
def iam_key(s3_env, monkeypatch):
    """(access key id, secret key) of an IAM user allowed s3:*, with moto's authentication on for the test (the
    bucket and the user are made before: the fixtures' own key is no IAM user's)."""
    from moto.core.authorization import enable_iam_authentication

    admin = dict(endpoint_url=s3_env.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing")
    import boto3

    iam = boto3.client("iam", **admin)
    user = f"store-user-{s3_env.bucket}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    with enable_iam_authentication():
        yield key["AccessKeyId"], key["SecretAccessKey"]


def _files_holding(root: Path, secrets: list[str]) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets)]


def _one_line(res) -> str:
    out = res.output.strip()
    assert res.exit_code == 1 and len(out.splitlines()) == 1, out[-3000:]
    return out


@pytest.mark.parametrize("case", ["wrong secret", "unknown key id", "no credentials"])
def test_wrong_or_missing_credentials_are_one_line_without_the_secret(case, s3_env, iam_key, store: Store,
                                                                    tmp_path: Path, monkeypatch, caplog) -> None:
    key_id, secret = iam_key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    fill(store, 4)
    url = s3_env.url()
    res = CliRunner().invoke(app, ["store", "push", str(store.root), url])  # the right key: allowed
    assert res.exit_code == 0, res.output

    if case == "no credentials":
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))  # not the user's ~/.aws
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    else:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
        if case == "unknown key id":
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")
    caplog.set_level(logging.DEBUG)
    for args in (["store", "pull", url, str(tmp_path / "pulled")],
                 ["store", "push", str(store.root), url],
                 ["store", "verify", url, "--cache-dir", str(tmp_path / "cache")]):
        out = _one_line(CliRunner().invoke(app, args))
        if case == "no credentials":
            assert f"no credentials for {url}" in out
        else:
            assert f"access to {url} denied" in out
        assert "AWS_SECRET_ACCESS_KEY" in out  # what to do
        assert WRONG_SECRET not in out and secret not in out
    assert WRONG_SECRET not in caplog.text and secret not in caplog.text
    assert _files_holding(tmp_path, [WRONG_SECRET, secret]) == []


def test_a_secret_given_on_the_command_line_is_in_no_stored_record(s3_env, iam_key, store: Store, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """`-o secret=... -o key=...` before the arguments: the push lease object (read by anyone who may list the
    bucket) and a local read lease held the command line's first words, the secret among them."""
    key_id, secret = iam_key
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")  # the -o options are what is used
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    fill(store, 4)
    words = ["store", "push", "-o", f"secret={secret}", "-o", f"key={key_id}", str(store.root), s3_env.url()]
    monkeypatch.setattr(sys, "argv", ["pipeline", *words])  # as the shell hands it to the process
    written: list[bytes] = []
    real_write = remote_mod.Remote.write
    monkeypatch.setattr(remote_mod.Remote, "write",
                        lambda self, rel, data, *a, **k: written.append(bytes(data)) or real_write(self, rel, data,
                                                                                                  *a, **k))
    res = CliRunner().invoke(app, words)
    assert res.exit_code == 0, res.output
    leases = [w for w in written if b'"argv"' in w]
    assert leases, "the push wrote no lease"
    assert not [w for w in written if secret.encode() in w]
    assert json.loads(leases[0])["argv"][:4] == ["pipeline", "store", "push", "-o"]  # still says what ran

    held = lease.hold(store.root, {"vae": 1}, "a reader")  # a local lease file, with the same command line
    try:
        assert _files_holding(store.root, [secret]) == []
    finally:
        held.release()
    assert secret not in res.output


def test_a_malformed_secret_option_is_refused_without_echoing_it(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["store", "pull", "s3://bucket/store", str(tmp_path / "d"), "-o",
                                   f"secret=[{WRONG_SECRET}"])
    assert res.exit_code != 0 and "--option" in res.output and WRONG_SECRET not in res.output, res.output


@pytest.mark.parametrize("case", ["-o key and secret", "environment"])
def test_access_denied_names_where_the_credentials_came_from(case, s3_env, iam_key, store: Store, tmp_path: Path,
                                                            monkeypatch) -> None:
    """Credentials given as `-o key=... -o secret=...` are the ones used (the AWS_* variables are not): the line
    told the user to check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, which were right, and not the options."""
    key_id, secret = iam_key
    fill(store, 4)
    if case == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
        options = []
    else:  # the environment holds the right key; the command's options a wrong one
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        options = ["-o", "key=AKIAUNKNOWN000000000", "-o", f"secret={WRONG_SECRET}"]
    for args in (["store", "push", *options, str(store.root), s3_env.url()],
                 ["store", "pull", *options, s3_env.url(), str(tmp_path / "pulled")]):
        out = _one_line(CliRunner().invoke(app, args))
        assert f"access to {s3_env.url()} denied" in out and WRONG_SECRET not in out and secret not in out
        if case == "environment":
            assert "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in out, out
        else:
            assert "-o key=... / -o secret=..." in out and "AWS_SECRET_ACCESS_KEY" not in out, out
