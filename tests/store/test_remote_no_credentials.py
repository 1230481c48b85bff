"""A store URL with no AWS credentials set (a newcomer's first try of the S3 demo without the `export AWS_...`
line): one line naming the variables to set, not botocore's NoCredentialsError traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app


def test_no_credentials_is_one_line_naming_the_variables(s3_env, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))  # not the user's ~/.aws
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    for args in (["store", "inspect", s3_env.url()], ["store", "verify", s3_env.url(), "--cache-dir",
                                                     str(tmp_path / "cache")]):
        res = CliRunner().invoke(app, args)
        out = res.output.strip()
        assert res.exit_code == 1 and len(out.splitlines()) == 1, out[-3000:]
        assert f"no credentials for {s3_env.url()}" in out and "AWS_ACCESS_KEY_ID" in out


@pytest.mark.parametrize("case", ["AWS_PROFILE absent", "-o profile= absent", "config file malformed"])
def test_an_unusable_aws_configuration_is_one_line_naming_it(case, s3_env, tmp_path, monkeypatch):
    """A profile a node's ~/.aws lacks (one node of eight set up without it), or a config file botocore cannot parse:
    botocore's ProfileNotFound / ConfigParseError traceback (a dozen frames) on every command before."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "aws-config"
    config.write_text("[profile other]\nregion = us-east-1\n" if case != "config file malformed" else "[broken\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    args = ["store", "inspect", s3_env.url()]
    if case == "AWS_PROFILE absent":
        monkeypatch.setenv("AWS_PROFILE", "absent")
    elif case == "-o profile= absent":
        args = ["store", "pull", s3_env.url(), str(tmp_path / "pulled"), "-o", "profile=absent"]
    res = CliRunner().invoke(app, args)
    out = res.output.strip()
    assert res.exit_code == 1 and len(out.splitlines()) == 1, out[-3000:]
    assert f"the AWS configuration for {s3_env.url()} is unusable" in out
    if case == "config file malformed":
        assert "ConfigParseError" in out and str(config) in out
    else:
        assert "ProfileNotFound" in out and ("AWS_PROFILE=absent" if case == "AWS_PROFILE absent" else
                                              "-o profile=absent") in out


def test_a_bad_aws_variable_value_is_one_line_naming_the_variable(s3_env, monkeypatch):
    """AWS_MAX_ATTEMPTS=abc: botocore's config provider raises a bare ValueError while making the client, a
    traceback of thirty frames before; told from other ValueErrors by where it was raised."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "abc")
    res = CliRunner().invoke(app, ["store", "inspect", s3_env.url()])
    out = res.output.strip()
    assert res.exit_code == 1 and len(out.splitlines()) == 1, out[-3000:]
    assert f"the AWS configuration for {s3_env.url()} is unusable" in out and "AWS_MAX_ATTEMPTS='abc'" in out
