"""Every remote open of an s3:// store creates a fresh client (a cached one may hold a session to a server that has
since restarted). Each came with a new botocore session whose loader parsed S3's service model JSON again: 0.3-0.5 s
of CPU per open (each lease write, push, pull, inspect; bench/remote_open_cpu.py: 13x the shared way's CPU). The
opens now share one loader (store/s3_models.py), and still get a session and client each."""

from __future__ import annotations

import pytest

pytest.importorskip("s3fs")


def test_two_opens_share_one_parse_of_s3s_model_and_not_their_clients(monkeypatch) -> None:
    from fsspec.asyn import sync

    from store.remote import open_remote

    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}.items():  # nothing is sent
        monkeypatch.setenv(name, value)
    opened = []
    for _ in range(2):
        remote = open_remote("s3://bucket/store")
        sync(remote.fs.loop, remote.fs.set_session)  # the client, as the first request creates it
        opened.append((remote.fs.session, remote.fs.s3, remote.fs.session.get_component("data_loader")))
    (session_a, client_a, loader_a), (session_b, client_b, loader_b) = opened
    assert session_a is not session_b and client_a is not client_b
    assert loader_a is loader_b
