"""One botocore loader for every botocore session of a test process, and of the warm parent's children
(tests/warm_parent.py). The code under test opens a fresh client per remote open (store/remote.open_remote: the
server may have restarted), each in a new session whose own loader parsed S3's model JSON again: 0.3-0.5 s of
CPU per open, most of a small push's time (2026-12-05). Within a session botocore already hands every client the
same parsed model (its loader's instance cache); this shares that cache across sessions, with no change to any
client or request."""

from __future__ import annotations


def share() -> None:
    import functools

    import botocore.session

    if not hasattr(botocore.session.create_loader, "cache_info"):  # once
        botocore.session.create_loader = functools.lru_cache(maxsize=None)(botocore.session.create_loader)


def prime() -> None:
    """`share`, and S3's model parsed now: a process that forks children (the warm parent) parses it once for all."""
    share()
    import botocore.session

    botocore.session.get_session().create_client(  # nothing is sent: a client's creation reads the model files
        "s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:1", aws_access_key_id="unused",
        aws_secret_access_key="unused")
