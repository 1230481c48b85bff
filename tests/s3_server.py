"""An S3-protocol server for tests: moto's server in this process, on 127.0.0.1 (no other network).

`s3_server` (session) starts it on a free port; `s3_env` (per test) points the standard AWS environment at it and
gives a fresh bucket, so code under test is configured exactly as a user would configure it (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...), with no mock inside the process: requests go over HTTP to a real server.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from dataclasses import dataclass

import pytest

_buckets = itertools.count()


@contextlib.contextmanager
def unreachable_endpoint():
    """An endpoint URL where nothing answers (connections refused): its port is bound, never listened on, and held
    until the block ends, so no other test's server can take it meanwhile (tests run two files at a time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def start_server():
    """A started ThreadedMotoServer on 127.0.0.1 and its endpoint URL (stop it with `.stop()`)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    # Port 0: the server binds a port of the kernel's choice and keeps it. A port found free beforehand can be
    # taken meanwhile (tests run two files at a time), and moto's start() then waits forever for a server that
    # failed to bind.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{server.get_host_and_port()[1]}"


@dataclass
class S3Env:
    endpoint: str
    bucket: str

    def url(self, prefix: str = "store") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


def aws_env(monkeypatch, endpoint: str) -> None:
    """The standard variables a user sets for an S3-compatible server over plain http."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # a stopped server is reported after 2 tries, not 5
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture(scope="session")
def s3_server():
    server, endpoint = start_server()
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> S3Env:
    env = S3Env(s3_server, f"test-bucket-{next(_buckets)}")
    aws_env(monkeypatch, s3_server)
    env.client().create_bucket(Bucket=env.bucket)
    return env
