"""resize-bucket reads webdataset tars through the `webdataset` library from a brace list of local paths, from
`http://` (a real http.server on 127.0.0.1) and from `s3://` (the moto S3 server): the same `images` table as the
local folder of the same samples; the listing hash follows the shards' content (a changed shard is a new version,
an unchanged one is up to date)."""

from __future__ import annotations

import functools
import io
import os
import shutil
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from schemas.errors import UserError
from stages.resize.stage import run
from store import Store

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2}
N = 40  # 3 tars of 16, 16, 8 samples


def _table(store: Path) -> dict:
    """key -> (manifest row without `source`, files): what two sources of the same samples must agree on."""
    r = Store(store, create=False).reader("images")
    try:
        return {k: ({c: v for c, v in r.meta(k).items() if c != "source"}, r.files(k)) for k in r.keys()}
    finally:
        r.close()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    """The same samples as a folder source and as a folder of tars, and the folder source's table."""
    base = tmp_path_factory.mktemp("shards")
    make_demo_data(base / "folder", n=N, fmt="folder", max_controls=2, seed=5, with_masks=True)
    make_demo_data(base / "tars", n=N, fmt="webdataset", max_controls=2, seed=5, with_masks=True)
    s = run(load_config(None, SMALL), base / "folder", base / "store-folder")
    assert s.written == N and not s.quarantined
    return {"base": base, "tars": base / "tars", "table": _table(base / "store-folder")}


def test_a_brace_list_of_local_tars_is_the_folder_table(shards, tmp_path):
    tars = shards["tars"]
    assert sorted(p.name for p in tars.glob("*.tar")) == ["demo-000000.tar", "demo-000001.tar", "demo-000002.tar"]
    s = run(load_config(None, SMALL), f"{tars}/demo-{{000000..000002}}.tar", tmp_path / "store")
    assert s.written == N and not s.quarantined
    assert _table(tmp_path / "store") == shards["table"]
    rows = Store(tmp_path / "store", create=False).reader("images")
    assert {rows.meta(k)["source"].rsplit(":", 1)[0] for k in rows.keys()} == {str(p) for p in tars.glob("*.tar")}
    rows.close()
    # the brace list names the same files as the folder of tars: same listing, so that folder is up to date
    assert run(load_config(None, SMALL), tars, tmp_path / "store").up_to_date
    # a sub-range is another source (fewer shards): 32 samples, a new version
    s = run(load_config(None, SMALL), f"{tars}/demo-{{000000..000001}}.tar", tmp_path / "store")
    assert not s.up_to_date and s.written + s.reused == 32
    with pytest.raises(UserError, match="demo-000007.tar"):
        run(load_config(None, SMALL), f"{tars}/demo-{{000002,000007}}.tar", tmp_path / "store")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one stderr line per request otherwise
        pass


@pytest.fixture
def http_root(tmp_path, without_proxies):
    """A folder served by http.server on 127.0.0.1 (a thread) and its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="webdataset streams http(s) with curl")


@needs_curl
def test_an_http_source_is_the_folder_table_and_a_changed_shard_a_new_version(shards, http_root, tmp_path):
    root, url = http_root
    for tar in shards["tars"].glob("*.tar"):
        (root / tar.name).write_bytes(tar.read_bytes())
    source = f"{url}/demo-{{000000..000002}}.tar"
    s = run(load_config(None, SMALL), source, tmp_path / "store")
    assert s.written == N and not s.quarantined
    assert _table(tmp_path / "store") == shards["table"]
    assert run(load_config(None, SMALL), source, tmp_path / "store").up_to_date  # same sizes and Last-Modified
    # one shard re-published with one more sample: a new version that renders only that sample
    with tarfile.open(root / "demo-000002.tar", "a") as tf:
        for name, data in (("extra.png", _png()), ("extra.txt", b"make it green")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    os.utime(root / "demo-000002.tar", (1_000_000_000, 1_000_000_000))  # another Last-Modified, whatever the clock
    s = run(load_config(None, SMALL), source, tmp_path / "store")
    assert not s.up_to_date and s.written == 1 and s.reused == N
    with pytest.raises(UserError, match="missing.tar"):
        run(load_config(None, SMALL), f"{url}/missing.tar", tmp_path / "store")


def test_an_s3_source_by_brace_list_or_prefix_is_the_folder_table(shards, s3_env, tmp_path):
    client = s3_env.client()
    for tar in sorted(shards["tars"].glob("*.tar")):
        client.put_object(Bucket=s3_env.bucket, Key=f"shards/{tar.name}", Body=tar.read_bytes())
    braces = f"s3://{s3_env.bucket}/shards/demo-{{000000..000002}}.tar"
    s = run(load_config(None, SMALL), braces, tmp_path / "store")
    assert s.written == N and not s.quarantined
    assert _table(tmp_path / "store") == shards["table"]
    rows = Store(tmp_path / "store", create=False).reader("images")
    assert all(rows.meta(k)["source"].startswith(f"s3://{s3_env.bucket}/shards/demo-") for k in rows.keys())
    rows.close()
    assert run(load_config(None, SMALL), braces, tmp_path / "store").up_to_date  # same sizes and ETags
    # the prefix: every tar under it, the same table
    s = run(load_config(None, SMALL), f"s3://{s3_env.bucket}/shards", tmp_path / "store-prefix")
    assert s.written == N and _table(tmp_path / "store-prefix") == shards["table"]
    with pytest.raises(UserError, match=f"s3://{s3_env.bucket}/shards/nope.tar"):
        run(load_config(None, SMALL), f"s3://{s3_env.bucket}/shards/nope.tar", tmp_path / "store")


def _png() -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 10)).save(b, format="PNG")
    return b.getvalue()


class _CutHandler(_QuietHandler):
    """Announces the whole file, sends half of it, hangs up: a server that stops mid-transfer."""

    def copyfile(self, source, outputfile) -> None:
        data = source.read()
        outputfile.write(data[: len(data) // 2])
        outputfile.flush()
        self.close_connection = True


@needs_curl
def test_a_transfer_cut_mid_shard_stops_with_one_line_and_a_rerun_completes(shards, tmp_path, without_proxies):
    root = tmp_path / "www"
    root.mkdir()
    for tar in shards["tars"].glob("*.tar"):
        (root / tar.name).write_bytes(tar.read_bytes())
    servers = {}
    for kind, handler in (("cut", _CutHandler), ("whole", _QuietHandler)):
        server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[kind] = server
    try:
        cut = f"http://127.0.0.1:{servers['cut'].server_address[1]}/demo-000000.tar"
        with pytest.raises(UserError, match="source shard .*demo-000000.tar: the transfer failed") as e:
            run(load_config(None, SMALL), cut, tmp_path / "store")
        assert "\n" not in str(e.value)
        q = Store(tmp_path / "store", create=False).quarantine().to_pylist() if (tmp_path / "store").exists() else []
        assert q == []  # nothing blamed on the data
        whole = f"http://127.0.0.1:{servers['whole'].server_address[1]}/demo-000000.tar"
        s = run(load_config(None, SMALL), whole, tmp_path / "store")
        assert s.written == 16 and not s.quarantined
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()


class _UntaggedHandler(_QuietHandler):
    """A server that says nothing about a file's version (no ETag, no Last-Modified)."""

    def send_header(self, keyword, value) -> None:
        if keyword.lower() not in ("last-modified", "etag"):
            super().send_header(keyword, value)


def test_a_shard_from_a_server_without_tags_is_identified_by_its_bytes(tmp_path, without_proxies):
    from stages.resize.shards import remote_identity

    (tmp_path / "a.tar").write_bytes(b"one" * 100)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_UntaggedHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.tar"
        if shutil.which("curl") is None:
            pytest.skip("webdataset streams http(s) with curl")
        before = remote_identity(url)
        assert before.startswith("300 sha256=")
        (tmp_path / "a.tar").write_bytes(b"two" * 100)  # same size, same (absent) tags: only the bytes differ
        assert remote_identity(url) != before
    finally:
        server.shutdown()
        server.server_close()
