"""An HTTP proxy in front of the S3 test server that misbehaves on purpose: for requests `fault(method, path)`
selects, it answers 503 SlowDown (throttling), 409 ConditionalRequestConflict (a conditional write that raced
another operation on its key, as AWS answers one) or cuts the body off half-way and closes the connection (a reset
mid-transfer); every other request is relayed as it is. Point AWS_ENDPOINT_URL at `.endpoint`."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from s3_server import SHUTDOWN_POLL_S

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
CONFLICT = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code>'
            b"<Message>A conflicting operation occurred. If using PutObject you can retry the request. If using "
            b"multipart upload you should initiate another CreateMultipartUpload request and re-upload each part."
            b"</Message></Error>")
ANSWERS = {"slow": (503, SLOW_DOWN), "conflict": (409, CONFLICT)}


class FaultProxy:
    def __init__(self, upstream: str, fault: Callable[[str, str], str | None]) -> None:
        """`fault(method, path)`: None (relay), "slow" (503 SlowDown), "conflict" (409 ConditionalRequestConflict),
        "cut" (half the body, then close), "flip" (one bit of the body flipped, the server's headers kept) or
        "norange" (the request relayed without its Range header: the whole object, 200, as a server or proxy that
        ignores Range answers)."""
        target = urlsplit(upstream)
        proxy = self
        self.faults: list[tuple[str, str, str]] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                how = fault(self.command, self.path)
                if how in ANSWERS:
                    proxy.faults.append((how, self.command, self.path))
                    status, answer = ANSWERS[how]
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    headers = dict(self.headers)
                    ranges = [k for k in headers if k.lower() == "range"]
                    if how == "norange" and ranges:
                        proxy.faults.append((how, self.command, self.path))
                        del headers[ranges[0]]
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # a HEAD's answer has no body: its length is the object's, as the server said
                head = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", head if head is not None else str(len(data)))
                if how == "cut" and len(data) > 1:
                    proxy.faults.append((how, self.command, self.path))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if how == "flip" and len(data) > 1:  # one bit of the body flipped in transit, headers as sent
                    proxy.faults.append((how, self.command, self.path))
                    data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:]
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(SHUTDOWN_POLL_S,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
