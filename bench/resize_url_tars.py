"""What a resize-bucket rerun fetches of a webdataset source at an http(s) URL, before (a tar at a URL had no
recorded identity: streamed whole every rerun) and now (stages/resize/known_tars.py: an unchanged tar, by its URL,
size and ETag, is carried; a header check reads its member headers and its pictures' first bytes by range
requests, picture_heads.TarIndex), measured in the same run on copies of the same store. "before" is this code
with the URL identity off (known_tars._remote_identity answering None, as it did for tars).

    python bench/resize_url_tars.py --samples 60 --side 700 --controls 2 [--delay 0.02]

`--delay`: seconds the server waits before answering each request (a round trip of a real network; concurrent
requests wait side by side). Three reruns each: "before" (the tar streamed whole), "walk" (the header walk by
sequential range requests and a request per picture head: KnownTars.headers off, picture_heads.HEADS_AHEAD 0), and
"now" (headers from their recorded offsets, heads HEADS_AHEAD samples ahead, concurrent).

Two reruns: `val_fraction` changed (no byte needed), and resize-bucket revision 3 -> 4 (each carried picture's
header checked for a transparent colour: bench/resize_header_reads.py's case, its source served over HTTP). The
server is an http.server on 127.0.0.1 answering range requests, with an ETag; bytes are those it sent, time the
rerun's wall time (loopback: a real network's latency and bandwidth widen the gap, both ways: a range request
costs a round trip, a whole tar its size).
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from resize_header_reads import SETTINGS, make_source


class _Ranges(SimpleHTTPRequestHandler):
    """Files with size, Last-Modified, an ETag and one `bytes=a-b` range a request; body bytes sent in `served`."""

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(False)

    def do_GET(self) -> None:
        self._answer(True)

    def _answer(self, body: bool) -> None:
        time.sleep(self.server.delay)  # type: ignore[attr-defined]
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        st = path.stat()
        start, end = 0, st.st_size
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if asked:
            start, end = int(asked[1]), min(st.st_size, int(asked[2]) + 1 if asked[2] else st.st_size)
        self.send_response(206 if asked else 200)
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Last-Modified", self.date_time_string(st.st_mtime))
        self.send_header("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}"')
        self.end_headers()
        if body:
            with open(path, "rb") as f:
                f.seek(start)
                self.wfile.write(f.read(end - start))
            self.server.served += end - start  # type: ignore[attr-defined]
            self.server.requests += 1  # type: ignore[attr-defined]


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # concurrent range requests: http.server's backlog of 5 drops their connections


def _serve(root: Path) -> ThreadingHTTPServer:
    server = _Server(("127.0.0.1", 0), functools.partial(_Ranges, directory=str(root)))
    server.served = server.requests = server.delay = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _rerun(cfg, url: str, store: Path, copy: Path, server, how: str) -> tuple[int, int, float, object]:
    from stages.resize import known_tars, picture_heads, stage

    real = known_tars._remote_identity, known_tars.KnownTars.headers, picture_heads.HEADS_AHEAD
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(store, copy)
    if how == "before":
        known_tars._remote_identity = lambda url: (None, None)  # (identity, strong ETag): none known
    if how == "walk":
        known_tars.KnownTars.headers, picture_heads.HEADS_AHEAD = lambda self, tar: None, 0
    server.served = server.requests = 0
    try:
        t = time.perf_counter()
        s = stage.run(cfg, url, copy)
        return server.served, server.requests, time.perf_counter() - t, s
    finally:
        known_tars._remote_identity, known_tars.KnownTars.headers, picture_heads.HEADS_AHEAD = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--side", type=int, default=700)
    ap.add_argument("--controls", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/resize_url_tars")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds before each answer (a network's round trip)")
    a = ap.parse_args()

    import os

    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        os.environ.pop(name, None)
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    from features import decode
    from pipeline.config import load_config
    from stages.resize import images_table, stage

    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    size = make_source(work / "www", "webdataset", a.samples, a.side, a.controls)
    tar = work / "www" / "shard-000.tar"
    print(f"source: one tar at a URL, {a.samples} samples x {a.controls + 1} pictures, "
          f"{tar.stat().st_size / 2**20:.1f} MiB ({size / 2**20:.1f} MiB of members)")
    server = _serve(work / "www")
    url = f"http://127.0.0.1:{server.server_address[1]}/shard-000.tar"
    cfg = load_config(None, SETTINGS)
    fixes, keyed = images_table.FIXES, decode._colour_keyed
    images_table.FEATURE_REVISION, images_table.FIXES = 3, tuple(f for f in fixes if f[0] < 3)
    decode._colour_keyed = lambda im: None  # revision 3's decode
    stage.run(cfg, url, work / "store")
    images_table.FEATURE_REVISION, images_table.FIXES, decode._colour_keyed = 4, fixes, keyed
    stage.run(cfg, url, work / "store")  # revision 4 (now's code): the store a view-setting rerun starts from
    images_table.FEATURE_REVISION, images_table.FIXES = 3, tuple(f for f in fixes if f[0] < 3)
    decode._colour_keyed = lambda im: None
    stage.run(cfg, url, work / "store3")
    images_table.FEATURE_REVISION, images_table.FIXES, decode._colour_keyed = 4, fixes, keyed
    view = load_config(None, {**SETTINGS, "resize.val_fraction": 0.3})
    server.delay = a.delay
    print(f"each request answered after {a.delay * 1000:.0f} ms")
    for what, c, store in (("val_fraction rerun", view, work / "store"), ("revision 3 -> 4 rerun", cfg, work / "store3")):
        for label in ("before", "walk", "now") if c is cfg else ("before", "now"):
            served, requests, seconds, s = _rerun(c, url, store, work / "rerun", server, label)
            print(f"{what}, {label}: written {s.written}, reused {s.reused}; served {served / 2**20:.2f} MiB in "
                  f"{requests} GETs, {seconds:.2f} s")
    server.shutdown()


if __name__ == "__main__":
    main()
