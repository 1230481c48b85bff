"""Webdataset tars at URLs on a rerun (stages/resize/known_tars.py): an unchanged one (the same URL, size and content
tag: ETag or Last-Modified) is carried by its recorded rows, no byte of it fetched; one put again is read whole; a
header check (resize-bucket revision 4's transparent colour) reads its members' headers and first bytes by range
requests (picture_heads.TarIndex), not the tar. Bytes are counted as the test servers send them: an http.server on
127.0.0.1 that answers range requests (as real servers and object stores do), and moto's S3 server."""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import tarfile
import threading
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from schemas.errors import UserError
from stages.resize import parquet_source, picture_heads, source_count, stage
from stages.resize.header_checks import FIRST_READ
from stages.resize.picture_heads import WALK_BLOCK
from stages.resize.shards import if_match
from store import Store
from tests.stages.test_fix_revisions_resize import SMALL as REVISION_SMALL
from tests.stages.test_fix_revisions_resize import _contents
from tests.stages.test_fix_revisions_resize4 import _build_at_revision_3
from tests.stages.test_resize_rerun_parquet import ROWS, _png, _resized_header
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows

needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="webdataset streams http(s) with curl")


class _Ranges(SimpleHTTPRequestHandler):
    """Files with their size, Last-Modified and an ETag (size and mtime, as nginx's), one `bytes=a-b` range each
    (unless the server's `ranges` is off; `accept`: its Accept-Ranges header); the body bytes sent, per file name,
    in the server's `served`, and how many GETs asked for no range (a stream or a download of the whole) in its
    `whole`."""

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        if self.server.status is not None:  # type: ignore[attr-defined]  # every request refused so (403, 503)
            self.send_error(self.server.status)  # type: ignore[attr-defined]
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data, st = path.read_bytes(), path.stat()
        etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
        if self.headers.get("If-Match") not in (None, etag):  # another object's ETag: put again since
            self.server.refused += 1  # type: ignore[attr-defined]
            self.send_error(412)
            return
        start, end = 0, len(data)
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "") if self.server.ranges else "")
        if asked:
            start, end = int(asked[1]), min(len(data), int(asked[2]) + 1 if asked[2] else len(data))
        self.send_response(206 if asked else 200)
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", self.server.accept)  # type: ignore[attr-defined]
        self.send_header("Last-Modified", self.date_time_string(st.st_mtime))
        self.send_header("ETag", etag)
        self.end_headers()
        if body:
            # counted before the body goes, so a client holding it (the test's next line) sees the count; counted
            # after, a loaded machine ran the test's reset or assert before this thread's count landed (flaky)
            self.server.served[path.name] += end - start  # type: ignore[attr-defined]
            self.server.whole += "Range" not in self.headers  # type: ignore[attr-defined]
            self.wfile.write(data[start:end])


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # concurrent range requests: http.server's backlog of 5 drops their connections


@pytest.fixture
def served_root(tmp_path, without_proxies):
    """A folder served with range requests on 127.0.0.1 (a thread), its base URL and the bytes served per file."""
    root = tmp_path / "www"
    root.mkdir()
    server = _Server(("127.0.0.1", 0), functools.partial(_Ranges, directory=str(root)))
    server.served, server.ranges, server.whole, server.refused = Counter(), True, 0, 0  # type: ignore[attr-defined]
    server.accept = "bytes"  # type: ignore[attr-defined]  # its Accept-Ranges header
    server.status = None  # type: ignore[attr-defined]  # an error status answering every request instead
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", server  # type: ignore[attr-defined]
    server.shutdown()
    server.server_close()
    thread.join()


def _same_as_fresh(tmp_path: Path, out: Path, source: str, over: dict) -> None:
    fresh = tmp_path / f"fresh{len(list(tmp_path.glob('fresh*')))}"
    stage.run(load_config(None, {**SMALL, **over}), source, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh)) and _quarantine(Store(out)) == _quarantine(Store(fresh))


def _append_sample(tar: Path) -> None:
    picture = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 10)).save(picture, format="PNG")
    with tarfile.open(tar, "a") as tf:
        for name, data in (("extra.png", picture.getvalue()), ("extra.txt", b"make it green")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@needs_curl
def test_unchanged_tars_at_a_url_are_not_fetched_and_one_put_again_is_read_whole(served_root, tmp_path, monkeypatch):
    """A val_fraction rerun: before, every tar was streamed whole again (a download of the dataset a rerun)."""
    root, url, server = served_root
    served = server.served
    make_demo_data(tmp_path / "src", n=32, fmt="webdataset", max_controls=2, seed=5, with_masks=True)
    for tar in (tmp_path / "src").glob("*.tar"):
        shutil.copy(tar, root / tar.name)
    source, out = f"{url}/demo-{{000000..000001}}.tar", tmp_path / "store"
    assert stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.1}), source, out).written == 32

    served.clear()
    totals, real_count = [], source_count.count_samples
    monkeypatch.setattr(source_count, "count_samples", lambda *a: totals.append(real_count(*a)) or totals[-1])
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), source, out)
    assert (again.written, again.reused) == (0, 32)
    assert sum(served.values()) == 0, served  # before: the two tars whole
    assert totals == [32]  # the bar's total, from the record (before: none, the tars at URLs not counted)

    _append_sample(root / "demo-000001.tar")  # put again: another size and ETag
    served.clear()
    changed = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.3}), source, out)
    assert (changed.written, changed.reused) == (1, 32)
    assert served == {"demo-000001.tar": (root / "demo-000001.tar").stat().st_size}  # it alone, whole, once
    assert totals[-1] is None  # not counted ahead: a pass over it
    _same_as_fresh(tmp_path, out, source, {"resize.val_fraction": 0.3})


def _noise_png(seed: int, shape: tuple[int, int], keyed: bool = False) -> bytes:
    b = io.BytesIO()
    arr = np.random.default_rng(seed).integers(1, 255, (*shape, 3), dtype=np.uint8)
    Image.fromarray(arr).save(b, format="PNG", compress_level=1, **({"transparency": (0, 0, 0)} if keyed else {}))
    return b.getvalue()


def _small_tar(path: Path, samples: int) -> dict[str, bytes]:
    """A tar of `samples` samples s0, s1, ... of a 40x60 picture and a caption; its members' bytes by name."""
    members = {}
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(samples):
            for ext, data in (("png", _noise_png(i, (40, 60))), ("txt", f"edit s{i}".encode())):
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                members[info.name] = data
    return members


@needs_curl
def test_a_revision_3_rerun_of_a_tar_at_a_url_reads_its_headers_by_range_requests(served_root, monkeypatch, tmp_path):
    """Each carried picture's first bytes and each member's header fetched by ranges; the cut-out (a transparent
    colour: rendered again) read whole by its members' offsets. Before, the tar was streamed whole. The table is a
    fresh run's."""
    root, url, server = served_root
    served = server.served
    pictures = {f"plain{i}": [_noise_png(i, (480, 640)), _noise_png(10 + i, (480, 640))] for i in range(4)}
    pictures["cutout"] = [_noise_png(20, (120, 160)), _noise_png(21, (120, 160), keyed=True)]
    with tarfile.open(root / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for stem, pics in pictures.items():
            for ext, data in (("png", pics[0]), ("control.png", pics[1]), ("txt", f"edit {stem}".encode())):
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    cfg, source = load_config(None, REVISION_SMALL), f"{url}/a.tar"
    _build_at_revision_3(monkeypatch, cfg, source, tmp_path / "store")

    served.clear()
    rerun = stage.run(cfg, source, tmp_path / "store")
    assert (rerun.written, rerun.reused) == (1, 4)
    size, cutout = (root / "a.tar").stat().st_size, sum(len(p) for p in pictures["cutout"])
    # each carried picture's first bytes, the cut-out's pictures twice (their headers, then whole to render them),
    # a WALK_BLOCK from each member header not in the one before; before: the tar whole (>= size)
    assert size > 6 << 20 and served["a.tar"] <= 8 * (FIRST_READ + 1) + 2 * cutout + 15 * (WALK_BLOCK + 512) \
        < size / 7, (served, size)
    stage.run(cfg, source, tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")


def test_an_s3_tar_is_carried_by_its_etag_and_one_put_again_is_read_whole(s3_env, tmp_path, monkeypatch):
    import s3fs

    make_demo_data(tmp_path / "src", n=32, fmt="webdataset", max_controls=2, seed=5, with_masks=True)
    client = s3_env.client()
    for tar in sorted((tmp_path / "src").glob("*.tar")):
        client.put_object(Bucket=s3_env.bucket, Key=f"shards/{tar.name}", Body=tar.read_bytes())
    source, out = f"s3://{s3_env.bucket}/shards", tmp_path / "store"
    assert stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.1}), source, out).written == 32
    second = tmp_path / "src" / "demo-000001.tar"
    _append_sample(second)
    client.put_object(Bucket=s3_env.bucket, Key="shards/demo-000001.tar", Body=second.read_bytes())

    fetched, real = Counter(), s3fs.core.S3File._fetch_range

    def fetch(self, start, end):  # the bytes asked of the server, per object
        fetched[self.path.rsplit("/", 1)[-1]] += min(end, self.size) - start
        return real(self, start, end)
    with monkeypatch.context() as m:
        m.setattr(s3fs.core.S3File, "_fetch_range", fetch)
        again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), source, out)
    assert (again.written, again.reused) == (1, 32)
    assert fetched == {"demo-000001.tar": second.stat().st_size}, fetched  # before: demo-000000.tar too
    # a carried tar's members read by range requests through s3fs, as a header check reads them
    first = tmp_path / "src" / "demo-000000.tar"
    with tarfile.open(first) as tf:
        member = next(m for m in tf if m.name.endswith(".png"))
        data = tf.extractfile(member).read()
    tar = f"s3://{s3_env.bucket}/shards/demo-000000.tar"
    index = picture_heads.TarIndex(tar, 1 << 30, still=lambda: True)
    sample = f"{tar}:{member.name.split('.')[0]}"
    assert index.heads(sample).target(64) == data[:64] and index.sample(sample).target == data
    _same_as_fresh(tmp_path, out, source, {"resize.val_fraction": 0.5})


@needs_curl
def test_a_tar_at_a_url_put_again_is_streamed_and_one_without_ranges_downloaded_once(served_root, tmp_path):
    """The offsets of one walk name the recorded object's bytes: an object put again before or during the walk (its
    tag asked again: `still`) gives none, and each sample is read by streaming the tar, as a local tar rewritten
    since its walk is. A server that ignores range requests fails the walk: the tar is downloaded once and walked
    and read there (before: each sample to read streamed the tar up to it, a tar of n samples read ~n/2 times)."""
    root, url, server = served_root
    tar, pictures = f"{url}/a.tar", _small_tar(root / "a.tar", 4)
    index = picture_heads.TarIndex(tar, 1 << 30, still=lambda: True)
    assert index.heads(f"{tar}:s1").target(100) == pictures["s1.png"][:100]  # by a range request
    assert index.sample(f"{tar}:s1").target == pictures["s1.png"]
    index = picture_heads.TarIndex(tar, 1 << 30, still=lambda: False)
    assert index.heads(f"{tar}:s1") is None
    assert index.sample(f"{tar}:s1").target == pictures["s1.png"]  # streamed

    server.ranges, server.whole = False, 0
    index = picture_heads.TarIndex(tar, 1 << 30, still=lambda: True)
    for i in range(4):
        assert index.heads(f"{tar}:s{i}").target(100) == pictures[f"s{i}.png"][:100]
        assert index.sample(f"{tar}:s{i}").target == pictures[f"s{i}.png"]
    assert server.whole == 1  # the download (before: the 4 samples streamed, a GET each)


@needs_curl
def test_a_tar_at_a_url_whose_server_says_it_takes_no_ranges_is_downloaded_once_and_walked_there(served_root):
    """A server answering `Accept-Ranges: none` is given a streaming file by fsspec, whose seek (tarfile's, from
    one header to the next) raises ValueError: before, that ended the stage with a traceback, where a server that
    ignores ranges silently had the tar downloaded once and walked there. Now the same download."""
    root, url, server = served_root
    tar, pictures = f"{url}/a.tar", _small_tar(root / "a.tar", 3)
    server.ranges, server.accept = False, "none"
    index = picture_heads.TarIndex(tar, 1 << 30, still=lambda: True)
    for i in range(3):
        assert index.heads(f"{tar}:s{i}").target(100) == pictures[f"s{i}.png"][:100]
        assert index.sample(f"{tar}:s{i}").target == pictures[f"s{i}.png"]
    assert index._copy is not None  # read from the one download, not streamed per sample


def _revision_3_tar(path: Path, samples: int) -> dict[str, bytes]:
    """A tar of `samples` samples of two ~100 KiB pictures (each past WALK_BLOCK: a walk request of its own) and a
    caption; the last one's control has a transparent colour (rendered again at revision 4)."""
    members = {}
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(samples):
            control = _noise_png(100 + i, (160, 200), keyed=i == samples - 1)
            target, caption = _noise_png(i, (160, 200)), f"edit {i}".encode()
            for ext, data in (("png", target), ("control.png", control), ("txt", caption)):
                info = tarfile.TarInfo(f"s{i:03d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                members[info.name] = data
    return members


class _RoundTrips:
    """The requests a TarIndex makes one after another (a range read, a block of the walk's file) and its rounds of
    concurrent ones (cat_ranges: one round trip each, however many ranges)."""

    def __init__(self, monkeypatch) -> None:
        from fsspec.implementations.http import HTTPFile

        self.sequential, self.rounds, self.ranges = 0, 0, 0
        real_range, real_fetch = picture_heads.read_range, HTTPFile._fetch_range
        real_cat = getattr(picture_heads, "cat_ranges", None)

        def read_range(*a, **k):
            self.sequential += 1
            return real_range(*a, **k)

        def fetch(f, start, end):
            self.sequential += 1
            return real_fetch(f, start, end)

        def cat_ranges(fs, path, starts, *a, **k):
            self.rounds, self.ranges = self.rounds + 1, self.ranges + len(starts)
            return real_cat(fs, path, starts, *a, **k)
        monkeypatch.setattr(picture_heads, "read_range", read_range)
        monkeypatch.setattr(HTTPFile, "_fetch_range", fetch)
        monkeypatch.setattr(picture_heads, "cat_ranges", cat_ranges, raising=False)



def _ranges_per_round(monkeypatch) -> list[int]:
    """The number of ranges each cat_ranges round asks for, in order (the spy of the window tests)."""
    fetched, real_cat = [], picture_heads.cat_ranges

    def cat_ranges(fs, path, starts, *a, **k):
        fetched.append(len(starts))
        return real_cat(fs, path, starts, *a, **k)
    monkeypatch.setattr(picture_heads, "cat_ranges", cat_ranges)
    return fetched

@needs_curl
def test_a_revision_3_rerun_of_a_url_tar_fetches_its_headers_concurrently(served_root, monkeypatch, tmp_path):
    """The tar's member header offsets, recorded when it was streamed, let a rerun fetch its headers and its
    pictures' first bytes by concurrent range requests (a few rounds), not one request after another. Before: a
    walk request per picture past WALK_BLOCK and a head request per picture, in sequence (~4 a sample here; 20-50 ms
    each on a real network: 100k samples took hours, longer than streaming the tar). The table is a fresh run's."""
    root, url, server = served_root
    samples = 40
    members = _revision_3_tar(root / "a.tar", samples)
    cfg, source = load_config(None, REVISION_SMALL), f"{url}/a.tar"
    _build_at_revision_3(monkeypatch, cfg, source, tmp_path / "store")

    trips = _RoundTrips(monkeypatch)
    server.served.clear()
    server.whole = 0
    rerun = stage.run(cfg, source, tmp_path / "store")
    assert (rerun.written, rerun.reused) == (1, samples - 1)
    # the walk: a round of 3 x samples header blocks and one for the tar's end; the heads: a round per HEADS_AHEAD
    # samples; the cut-out read whole: one round (before: ~4 x samples = 160 requests one after another)
    assert trips.sequential == 0 and trips.rounds <= 3 + -(-samples // picture_heads.HEADS_AHEAD), vars(trips)
    cutout = sum(len(m) for name, m in members.items() if name.startswith(f"s{samples - 1:03d}."))
    assert server.whole == 0 and server.served["a.tar"] <= \
        3 * samples * picture_heads.HEADER_BLOCK + 512 + 2 * samples * (FIRST_READ + 1) + cutout  # no stream
    stage.run(cfg, source, tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")

    # the next rerun (revision 4 carried, a pixel limit lowered: each header checked again) walks by the headers the
    # last one recorded, as concurrently
    trips.sequential = trips.rounds = 0
    lower = load_config(None, {**REVISION_SMALL, "resize.max_image_pixels": 160 * 200})
    assert stage.run(lower, source, tmp_path / "store").reused == samples
    assert trips.sequential == 0 and 2 <= trips.rounds <= 2 + -(-samples // picture_heads.HEADS_AHEAD), vars(trips)


@needs_curl
def test_recorded_headers_that_are_not_the_tars_are_walked_instead(served_root):
    """Offsets that name no member header (a record of another object under the same tag: never trusted) fail the
    header checksum: the tar is walked by ranges instead, and each sample read right; a server ignoring ranges
    still gets the tar downloaded once."""
    root, url, server = served_root
    members = _revision_3_tar(root / "a.tar", 4)
    tar = f"{url}/a.tar"
    for headers in ([0, 1536, 9000], [0]):  # wrong offsets; a record of too few members (a sample missing)
        index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, [f"{tar}:s{i:03d}" for i in range(4)], headers)
        for i in range(4):
            assert index.heads(f"{tar}:s{i:03d}").controls[0](100) == members[f"s{i:03d}.control.png"][:100]
            assert index.sample(f"{tar}:s{i:03d}").target == members[f"s{i:03d}.png"]
    # samples asked against the rows' order: each before the last window alone, not a window ahead each (before the
    # guard: 2, 4, 6, 8, 2 heads fetched)
    sources = [f"{tar}:s{i:03d}" for i in range(4)]
    with pytest.MonkeyPatch.context() as m:
        fetched = _ranges_per_round(m)
        index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources, None)
        for i in (3, 2, 1, 0, 3):
            assert index.heads(sources[i]).target(100) == members[f"s{i:03d}.png"][:100]
    assert fetched == [2, 2, 2, 2, 2], fetched
    with tarfile.open(root / "a.tar") as tf:  # the walk's header offsets, for the next run's record
        assert index.headers == [m.offset for m in tf.getmembers()]

    server.ranges, server.whole = False, 0
    index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, [f"{tar}:s000"], [0])
    assert index.heads(f"{tar}:s000").target(100) == members["s000.png"][:100] and server.whole == 1


@needs_curl
def test_heads_asked_for_a_few_samples_apart_fetch_no_window_ahead(served_root, monkeypatch):
    """Only some samples' headers are checked (a lowered pixel limit: the rows without controls over it): a window
    of HEADS_AHEAD samples fetched for each such sample is HEADS_AHEAD times the bytes asked for (4 MiB of heads a
    picture asked). Samples asked far apart fetch their own heads alone; samples asked in a row still a window."""
    root, url, _ = served_root
    members = _revision_3_tar(root / "a.tar", 12)
    tar = f"{url}/a.tar"
    sources, fetched = [f"{tar}:s{i:03d}" for i in range(12)], _ranges_per_round(monkeypatch)
    monkeypatch.setattr(picture_heads, "HEADS_AHEAD", 4)
    index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources, None)
    for i in (0, 5, 10):
        assert index.heads(sources[i]).controls[0](100) == members[f"s{i:03d}.control.png"][:100]
    assert fetched[1:] == [2, 2], fetched  # the first ask a window (nothing known yet); before: 8, 4 (samples 5-8, 10-11)
    fetched.clear()
    index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources, None)
    for i in range(12):  # in a row: a window a round
        assert index.heads(sources[i]).target(100) == members[f"s{i:03d}.png"][:100]
    assert fetched == [8, 8, 8], fetched


@needs_curl
def test_a_picture_the_window_could_not_fetch_is_read_alone_not_another_window(served_root, monkeypatch):
    """A picture of the window fetched that did not come (an empty member, a range the server failed) is read alone
    (read_range, which names an error): before, its sample fetched a new window from it (every sample with one: a
    window each)."""
    root, url, _ = served_root
    members = {}
    with tarfile.open(root / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(8):
            for ext in ("png", "txt"):
                data = b"" if (ext, i) == ("png", 1) else _noise_png(i, (40, 60)) if ext == "png" else b"edit"
                info = tarfile.TarInfo(f"s{i}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                members[info.name] = data
    tar = f"{url}/a.tar"
    sources, fetched = [f"{tar}:s{i}" for i in range(8)], _ranges_per_round(monkeypatch)
    monkeypatch.setattr(picture_heads, "HEADS_AHEAD", 4)
    index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources, None)
    for i in range(8):
        assert index.heads(sources[i]).target(100) == members[f"s{i}.png"][:100]
    assert fetched == [3, 4], fetched  # before: 3, 3, 3 (a window from s1 again, s1-s4, then s5-s7)


def _put_again_swapped(path: Path) -> None:
    """The tar put again at its URL with each sample's target and control names swapped: the same size and data
    offsets (USTAR headers are 512 bytes whatever the name), other content, another ETag (its mtime)."""
    swap = {".png": ".control.png", ".control.png": ".png"}
    out = io.BytesIO()
    with tarfile.open(path) as src, tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as dst:
        for m in src.getmembers():
            stem, _, ext = m.name.partition(".")
            data = src.extractfile(m).read()
            m.name = stem + swap.get(f".{ext}", f".{ext}")
            dst.addfile(m, io.BytesIO(data))
    size = path.stat().st_size
    _put_bytes_again(path, out.getvalue())
    assert path.stat().st_size == size


def _put_bytes_again(path: Path, data: bytes) -> None:
    """`data` written to the served file as an object put again: its mtime a second on, so another ETag (the test
    server's tag is its size and mtime) even for bytes of the same size."""
    before = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


def _put_again_at_row(path: Path, data: bytes, at: int):
    """parquet_source._sample, with the served file put again (its captions upper-cased) as row `at` is read."""
    real = parquet_source._sample

    def sample(row, lay, where, no, *a):
        if no == at and path.read_bytes() == data:
            _put_bytes_again(path, data.replace(b"edit ", b"EDIT "))
        return real(row, lay, where, no, *a)
    return sample


@needs_curl
def test_a_url_tar_put_again_while_its_samples_are_read_stops_the_run(served_root, monkeypatch, tmp_path):
    """An object put again after the walk (its tag asked before and after it) but before its samples are read by
    the walk's offsets: before, the rerun read the old offsets into the new bytes silently (the cut-out's pictures
    judged and rendered as the old tar's names say, a table neither tar's fresh run gives). Now its tag is asked
    once more after its last sample: the run stops with one line, and the rerun it asks for is a fresh run's."""
    root, url, server = served_root
    _revision_3_tar(root / "a.tar", 4)
    cfg, source = load_config(None, REVISION_SMALL), f"{url}/a.tar"
    _build_at_revision_3(monkeypatch, cfg, source, tmp_path / "store")

    real_index = picture_heads.TarIndex._index

    def walked_then_put_again(self):
        runs = real_index(self)
        _put_again_swapped(root / "a.tar")
        return runs
    with monkeypatch.context() as m:
        m.setattr(picture_heads.TarIndex, "_index", walked_then_put_again)
        with pytest.raises(UserError, match=r"a\.tar: the tar was put again while this run read its samples.*rerun"):
            stage.run(cfg, source, tmp_path / "store")
    assert server.refused > 0  # the cut-out's members asked If-Match the walked object's ETag: 412, streamed
    stage.run(cfg, source, tmp_path / "store")
    stage.run(cfg, source, tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")


@needs_curl
def test_range_reads_of_a_url_tar_put_again_after_its_walk_are_refused_not_read(served_root):
    """The walked object's ETag sent as If-Match with each range read: the server refuses (412) a read of the
    object put again, so the sample is streamed from the new object (its own bytes), never read by the old offsets.
    Before: the old offsets read the new object's bytes (here the old target's data under the new control name)."""
    root, url, server = served_root
    members = _revision_3_tar(root / "a.tar", 4)
    tar, st = f"{url}/a.tar", (root / "a.tar").stat()
    etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'
    sources = [f"{tar}:s{i:03d}" for i in range(4)]
    index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources, None, lambda: if_match(tar, etag))
    assert index.heads(sources[0]).target(100) == members["s000.png"][:100]  # walked, the first window fetched
    _put_again_swapped(root / "a.tar")
    assert index.sample(sources[1]).target == members["s001.control.png"]  # the new object's target, streamed
    assert server.refused == 3  # its three members' ranges


@needs_curl
def test_an_empty_member_of_a_url_tar_is_asked_of_no_server(served_root, monkeypatch):
    """A sample read whole by its members' offsets with an empty caption: the empty member is not asked (s3fs sends
    `bytes=o-(o-1)` for it, a range S3 may ignore and answer with the whole object); its bytes are b""."""
    root, url, server = served_root
    members = _small_tar(root / "a.tar", 2)
    with tarfile.open(root / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tf:  # s1's caption emptied
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = 0 if name == "s1.txt" else len(data)
            tf.addfile(info, io.BytesIO(b"" if name == "s1.txt" else data))
    asked, real = [], picture_heads.cat_ranges

    def cat_ranges(fs, path, starts, ends, *a, **k):
        asked.extend(zip(starts, ends))
        return real(fs, path, starts, ends, *a, **k)
    monkeypatch.setattr(picture_heads, "cat_ranges", cat_ranges)
    tar = f"{url}/a.tar"
    sample = picture_heads.TarIndex(tar, 1 << 30, still=lambda: True).sample(f"{tar}:s1")
    assert sample.target == members["s1.png"] and sample.caption == b""
    assert asked and all(end > start for start, end in asked), asked


@needs_curl
def test_a_pax_tar_with_a_global_header_is_read_by_its_recorded_offsets(served_root, monkeypatch):
    """A tar with a global pax header (`git archive` writes one: its commit) records its first member header at
    1024, past it: before, the recorded offsets were refused on every rerun (the first not 0) and the tar walked one
    request after another each time. Now the bytes before it are read as tarfile reads them, global headers only,
    and each recorded header after them (a member's own pax header, a long name here, under their keys): no
    sequential request, each sample's bytes. Offsets past a member (not a global header) are still refused."""
    root, url, server = served_root
    names = [f"s{i}" for i in range(3)] + ["d" * 120 + "/s3"]  # the last: a name only a pax header holds
    members = {}
    with tarfile.open(root / "a.tar", "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "0" * 40}) as tf:
        for i, key in enumerate(names):
            for ext, data in (("txt", f"edit {i}".encode()), ("png", _noise_png(i, (40, 60)))):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                members[info.name] = data
    tar = f"{url}/a.tar"
    sources = [f"{tar}:{key}" for key in names]
    with tarfile.open(root / "a.tar") as tf:
        recorded = [m.offset for m in tf.getmembers()]
    walked = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources)
    assert walked.heads(sources[0]) is not None and walked.headers == recorded and recorded[0] == 1024

    trips = _RoundTrips(monkeypatch)
    server.whole = 0
    for headers, walks in ((recorded, False), (recorded[1:], True)):  # the record; one past s0.txt's header
        trips.sequential = 0
        index = picture_heads.TarIndex(tar, 1 << 30, lambda: True, sources, headers)
        for key, source in zip(names, sources):
            assert index.heads(source).target(100) == members[f"{key}.png"][:100]
            sample = index.sample(source)
            assert (sample.target, sample.caption) == (members[f"{key}.png"], members[f"{key}.txt"])
        assert (trips.sequential > 0) == walks and index.headers == recorded and server.whole == 0, vars(trips)


def test_a_url_file_put_again_while_its_row_groups_are_read_stops_the_run(served_root, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """A carried parquet file at a URL put again after it was judged (its footer read) but before a row group is
    read by that footer's offsets: here the same bytes but row 4's target header saying 64x64 (pages carry no
    checksum). Before, a pixel limit lowered under 96x96 (rows 4-7's) quarantined rows 5-7 and carried row 4, its new
    header passing, silently (a table of neither object). Now the row group's reads send the judged ETag as If-Match
    (412) and the tag is asked again: the run stops with one line naming the URL; the rerun is a fresh run's."""
    root, url, server = served_root
    rng = np.random.default_rng(5)
    pngs = [_png(rng, 64 if i < 4 else 96) for i in range(ROWS)]
    path = root / "part-0.parquet"
    pq.write_table(pa.table({"target": pa.array(pngs, pa.binary()), "controls": pa.array(
        [[] for _ in range(ROWS)], pa.list_(pa.binary())), "caption": pa.array([f"edit {i}" for i in range(ROWS)])}),
        path, row_group_size=3, compression="none", use_dictionary=False, write_statistics=False)
    source, out, lowered = f"{url}/part-0.parquet", tmp_path / "store", {"resize.max_image_pixels": 96 * 96 - 1}
    stage.run(load_config(None, SMALL), source, out)
    data = path.read_bytes()
    assert data.count(pngs[4]) == 1
    real = parquet_source._RowGroups._read_group

    def put_again_then_read(self, no):
        if path.read_bytes() == data:
            _put_bytes_again(path, data.replace(pngs[4], _resized_header(pngs[4], 64)))
        return real(self, no)
    with monkeypatch.context() as m:
        m.setattr(parquet_source._RowGroups, "_read_group", put_again_then_read)
        with pytest.raises(UserError, match=r"part-0\.parquet: the parquet file was put again while this run .*rerun"):
            stage.run(load_config(None, {**SMALL, **lowered}), source, out)
    assert server.refused > 0  # the row group's ranges asked If-Match the judged object's ETag: 412
    stage.run(load_config(None, {**SMALL, **lowered}), source, out)
    fresh = tmp_path / "fresh"
    stage.run(load_config(None, {**SMALL, **lowered}), source, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh)) and _quarantine(Store(out)) == _quarantine(Store(fresh))


def _captioned_parquet(path: Path) -> bytes:
    """ROWS rows of noise targets captioned `edit <i>`, three a row group, plain pages: each caption's bytes in the
    file as they are (another object of the same size and offsets: `.replace(b"edit ", b"EDIT ")`)."""
    rng = np.random.default_rng(5)
    pq.write_table(pa.table({"target": pa.array([_png(rng, 64) for _ in range(ROWS)], pa.binary()),
                             "controls": pa.array([[] for _ in range(ROWS)], pa.list_(pa.binary())),
                             "caption": pa.array([f"edit {i}" for i in range(ROWS)])}),
        path, row_group_size=3, compression="none", use_dictionary=False, write_statistics=False)
    return path.read_bytes()


def test_a_url_file_put_again_while_it_is_read_the_first_time_stops_the_run(served_root, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """A parquet file at a URL read for the first time is fetched a block at a time (8 MiB; 4 KiB here, the file
    larger than one), its row groups by the footer's offsets: one put again between two blocks (here the same
    sizes, its captions upper-cased) was read on into the new bytes and committed silently, rows 0-2 of the old
    object and 3-7 of the new (a table neither object's fresh run gives; only the note was left out). Now its reads
    send the ETag asked when it was judged as If-Match (412) and the tag is asked again after its last row: the run
    stops with one line naming the URL; the rerun is a fresh run's."""
    root, url, server = served_root
    path = root / "part-0.parquet"
    data = _captioned_parquet(path)
    monkeypatch.setattr(parquet_source, "URL_BLOCK_BYTES", 4096)
    monkeypatch.setattr(parquet_source, "BATCH_ROWS", 3)  # a row group a batch: row 0 is met before group 1 is read
    source, out = f"{url}/part-0.parquet", tmp_path / "store"
    with monkeypatch.context() as m:
        m.setattr(parquet_source, "_sample", _put_again_at_row(path, data, 0))
        with pytest.raises(UserError, match=r"part-0\.parquet: the parquet file was put again while this run .*rerun"):
            stage.run(load_config(None, SMALL), source, out)
    assert server.refused > 0  # the next row group's ranges asked If-Match the judged object's ETag: 412
    stage.run(load_config(None, SMALL), source, out)
    fresh = tmp_path / "fresh"
    stage.run(load_config(None, SMALL), source, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh)) and _quarantine(Store(out)) == _quarantine(Store(fresh))


def test_a_url_file_put_again_after_its_last_row_was_read_keeps_the_rows_read(served_root, tmp_path: Path,
                                                                              monkeypatch) -> None:
    """A parquet file at a URL read for the first time with its strong ETag as If-Match, put again once its last row
    was read: every row came from the object judged (a read of another is refused, 412), yet its tag was asked
    again and the run stopped ("put again ... rerun") with every row right. Now the run commits the old rows; the
    rerun reads the new object whole."""
    root, url, server = served_root
    path = root / "part-0.parquet"
    data = _captioned_parquet(path)
    source, out = f"{url}/part-0.parquet", tmp_path / "store"
    stage.run(load_config(None, SMALL), source, tmp_path / "old")
    with monkeypatch.context() as m:
        m.setattr(parquet_source, "_sample", _put_again_at_row(path, data, ROWS - 1))
        stage.run(load_config(None, SMALL), source, out)
    assert server.refused == 0 and _rows(Store(out)) == _rows(Store(tmp_path / "old"))
    stage.run(load_config(None, SMALL), source, out)
    _same_as_fresh(tmp_path, out, source, {})


def test_a_server_gone_before_a_url_files_tag_is_asked_again_is_named_not_taken_for_a_put_again(
        served_root, tmp_path: Path, monkeypatch) -> None:
    """A carried parquet file's row groups read by offsets, then its server stopped before its tag is asked again
    after its last row: before, the refused connection read as another identity, "put again ... rerun to read the
    new one" (the user reruns against a server that is down). Now the line says the server could not be reached,
    names the URL, and says to check the network and the server."""
    root, url, server = served_root
    path = root / "part-0.parquet"
    _captioned_parquet(path)
    source, out = f"{url}/part-0.parquet", tmp_path / "store"
    stage.run(load_config(None, SMALL), source, out)
    real = parquet_source._RowGroups.confirm

    def server_stopped_then_confirm(self):
        server.shutdown()
        server.server_close()
        return real(self)
    monkeypatch.setattr(parquet_source._RowGroups, "confirm", server_stopped_then_confirm)
    with pytest.raises(UserError) as stopped:  # a lowered pixel limit: each row's header read from its row group
        stage.run(load_config(None, {**SMALL, "resize.max_image_pixels": 64 * 64 - 1}), source, out)
    assert re.search(rf"the server of {re.escape(source)} could not be reached \(ClientConnectorError: .*check the "
                     r"network and that the server runs", str(stopped.value)) and "was put again" not in \
        str(stopped.value), stopped.value


@pytest.mark.parametrize("fault, said", [
    ("stopped", r"the server of {url} could not be reached \(ClientConnectorError: .*check the network and that the "
                r"server runs"),
    (403, r"access to {url} denied \(HTTP 403 Forbidden\); check that the URL may be read"),
    (503, r"{url} answered HTTP 503 Service Unavailable; rerun, or check the server")])
def test_a_source_urls_server_down_or_refusing_at_listing_time_is_named_not_called_missing(
        served_root, tmp_path: Path, fault, said) -> None:
    """fsspec's http reports a refused connection, and any error answer (a 403 from a signed URL that expired, a
    503), as FileNotFoundError(url), the connection's error or the answer its cause: the listing's line said "does
    not exist ...; fix the URL" for each, sending the user after a URL that is right. Now it says what it was."""
    root, url, server = served_root
    _captioned_parquet(root / "part-0.parquet")
    source = f"{url}/part-0.parquet"
    if fault == "stopped":
        server.shutdown()
        server.server_close()
    else:
        server.status = fault
    with pytest.raises(UserError) as refused:
        stage.run(load_config(None, SMALL), source, tmp_path / "store")
    assert re.search(said.format(url=re.escape(source)), str(refused.value)) and "does not exist" not in \
        str(refused.value), refused.value


@pytest.mark.parametrize("status, said", [
    (403, r"access to {url} denied \(HTTP 403 Forbidden\); check that the URL may be read"),
    (503, r"{url} answered HTTP 503 Service Unavailable; rerun, or check the server")])
def test_a_url_files_server_refusing_when_its_tag_is_asked_again_is_named_not_taken_for_a_put_again(
        served_root, tmp_path: Path, monkeypatch, status, said) -> None:
    """A carried parquet file's row groups read by offsets, then its server answering every request with an error
    (a signed URL expired meanwhile: 403; a 503) when its tag is asked again after its last row: before, the error
    read as another identity, "put again ... rerun to read the new one" (a rerun meets the same refusal). Now the
    store's line for the answer, naming the URL."""
    root, url, server = served_root
    _captioned_parquet(root / "part-0.parquet")
    source, out = f"{url}/part-0.parquet", tmp_path / "store"
    stage.run(load_config(None, SMALL), source, out)
    real = parquet_source._RowGroups.confirm

    def refusing_then_confirm(self):
        server.status = status
        return real(self)
    monkeypatch.setattr(parquet_source._RowGroups, "confirm", refusing_then_confirm)
    with pytest.raises(UserError) as stopped:  # a lowered pixel limit: each row's header read from its row group
        stage.run(load_config(None, {**SMALL, "resize.max_image_pixels": 64 * 64 - 1}), source, out)
    assert re.search(said.format(url=re.escape(source)), str(stopped.value)) and "was put again" not in \
        str(stopped.value), stopped.value


@pytest.mark.parametrize("raised, said", [
    # s3fs's translation of S3's ExpiredToken (s3fs.errors: PermissionError): before, "put again ... rerun"
    (PermissionError("The provided token has expired."), r"source shard: access to s3://b/a\.tar denied \(The "
                                                          r"provided token has expired\.\); check AWS_ACCESS_KEY_ID"),
    (FileNotFoundError("b/a.tar"), None),  # gone: not the file judged, as before
    (RuntimeError("a client error no line knows"), None)])  # as before: no traceback, not the file judged
def test_still_says_what_a_client_error_is_and_keeps_an_unknown_one_a_put_again(monkeypatch, raised, said) -> None:
    from stages.resize import shards
    from stages.resize.known_tars import KnownTars

    class Refusing:  # the client's answer to the metadata request
        def info(self, path):
            raise raised
    monkeypatch.setattr(shards, "remote_fs", lambda url: (Refusing(), url.split("://", 1)[1]))
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    known = KnownTars(None, {}, None, {})  # type: ignore[arg-type]  # no local file asked
    if said is None:
        assert known.still("s3://b/a.tar", "0" * 64) is False
    else:
        with pytest.raises(UserError, match=said):
            known.still("s3://b/a.tar", "0" * 64)
