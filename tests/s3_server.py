"""An S3-protocol server for tests: moto's server in this process, on 127.0.0.1 (no other network).

`s3_server` (session) starts it on a free port; `s3_env` (per test) points the standard AWS environment at it and
gives a fresh bucket, so code under test is configured exactly as a user would configure it (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...), with no mock inside the process: requests go over HTTP to a real server.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import socket
from dataclasses import dataclass

import pytest

_buckets = itertools.count()
# How often a test server's loop looks for its shutdown: socketserver's default, 0.5 s, was half a second of every
# test that stops one (0.5-0.7 s for the whole command against the HTML endpoint).
SHUTDOWN_POLL_S = 0.02


@contextlib.contextmanager
def unreachable_endpoint():
    """An endpoint URL where nothing answers (connections refused): its port is bound, never listened on, and held
    until the block ends, so no other test's server can take it meanwhile (tests run two files at a time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def silent_endpoint():
    """An endpoint URL that accepts connections and never answers (a blackholing proxy, a stuck server), and the
    list of the connections it accepted so far: each request attempt of the client opens one."""
    import threading

    accepted: list[socket.socket] = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)

        def accept() -> None:
            while True:
                try:
                    accepted.append(s.accept()[0])
                except OSError:  # the socket was closed: the block ended
                    return

        threading.Thread(target=accept, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{s.getsockname()[1]}", accepted
        finally:
            for c in accepted:
                c.close()


@contextlib.contextmanager
def html_endpoint(listing_status: int = 200, status: int = 200):
    """An endpoint URL that answers every request with an HTML page, 200 OK (a web console on the wrong port, e.g.
    MinIO's console): a server, but no S3 one. `listing_status`: the status of its answer to a listing (a 404 there:
    the listing reads as empty, the object reads as the page's bytes); `status`: of every other answer (a 502: a
    proxy's error page in front of an S3 server that is down)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = b"<!doctype html><html><head><title>MinIO Console</title></head><body></body></html>"

    class Page(BaseHTTPRequestHandler):
        def _page(self) -> None:
            self.send_response(listing_status if "list-type=" in self.path else status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(page)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _page

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Server:
    """moto's S3 app served from a thread. The socket is bound here, in the caller: a taken port is an OSError at
    once (moto's ThreadedMotoServer binds in its thread, and its start() then waits forever)."""

    def __init__(self, port: int) -> None:
        import threading

        from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                                   create_backend_app)
        from werkzeug.serving import make_server

        try:
            self._server = make_server("127.0.0.1", port, DomainDispatcherApplication(create_backend_app),
                                       threaded=True, request_handler=MotoRequestHandler)
        except SystemExit:  # werkzeug's answer to a taken port: a message, then sys.exit(1)
            raise OSError(errno.EADDRINUSE, f"port {port} is taken") from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()  # the port is free again (a test may start the server there again)
        self._thread.join()


def start_server(port: int = 0):
    """A started S3 server on 127.0.0.1 and its endpoint URL (stop it with `.stop()`). Port 0: one of the kernel's
    choice, bound and kept (a port found free beforehand can be taken meanwhile: tests run two files at a time);
    a port of a server stopped before: that server back at the same address, as a real one comes back."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = _Server(port)
    return server, f"http://127.0.0.1:{server.port}"


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


def new_bucket(endpoint: str) -> S3Env:
    """A fresh, empty bucket of the server at `endpoint` (a name no other test of the session has)."""
    env = S3Env(endpoint, f"test-bucket-{next(_buckets)}")
    env.client().create_bucket(Bucket=env.bucket)
    return env


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> S3Env:
    aws_env(monkeypatch, s3_server)
    return new_bucket(s3_server)
