"""One parse of S3's service model per process. `store.remote.open_remote` opens a fresh S3 client for every remote
open (a cached one may hold a session to a server that has since restarted), each in a new botocore session whose
own loader parses S3's model JSON again: 0.3-0.5 s of CPU per open (each lease write, push, pull, inspect), more
than a small push's transfers (measured 2026-12-05, bench/remote_open_cpu.py). botocore shares the parsed model
between the clients of one session (its loader's instance cache) but offers no way to share it between sessions
that s3fs creates itself; hence this: the loader factory returns one loader per data path. Sessions, credentials,
clients and requests are unchanged (a loader only reads botocore's bundled JSON files, read-only once loaded)."""

from __future__ import annotations

import functools


def share() -> None:
    """Every botocore session of this process from now on shares one loader per AWS_DATA_PATH (idempotent; a
    no-op without botocore)."""
    try:
        import botocore.session
    except ImportError:
        return
    if not hasattr(botocore.session.create_loader, "cache_info"):  # once
        botocore.session.create_loader = functools.lru_cache(maxsize=None)(botocore.session.create_loader)


def prime() -> None:
    """`share`, and S3's model parsed now: a process that forks children (a launcher's warm parent) parses it once
    for all of them. Nothing is sent (a client's creation reads the model files)."""
    share()
    import botocore.session

    botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:1", aws_access_key_id="unused",
        aws_secret_access_key="unused")
