"""A folder source's listing: one scan per folder per run (os.scandir: no stat or realpath per plain file), with
the same listing hash as before (a changed hash would make every store's images version look stale), and a
progress bar while a large folder is listed."""

from __future__ import annotations

import os
from pathlib import Path

from stages.resize.content import content_listing_hash
from stages.resize.source_count import count_samples
from stages.resize.folder_source import iter_folder
from stages.resize.sources import source_files


def _odd_folder(root: Path) -> Path:
    """Every kind of entry the folder layout meets: images, captions, controls, masks, a dotfile, a subfolder, a
    symlink inside the source, one pointing outside, a name that is not UTF-8, a non-image."""
    (root / "src" / "target" / "sub").mkdir(parents=True)
    for d in ("control", "control_1", "mask"):
        (root / "src" / d).mkdir()
    t = root / "src" / "target"
    for stem, data in (("b", b"bee"), ("a", b"ay"), ("a.b", b"dots"), ("Z", b"upper"), ("x.", b"dot end")):
        (t / f"{stem}.png").write_bytes(data)
        (t / f"{stem}.txt").write_bytes(b"caption " + data)
    (t / ".DS_Store").write_bytes(b"litter")
    (t / "notes.md").write_bytes(b"not an image")
    (t / "sub" / "deep.png").write_bytes(b"not read")
    Path(os.fsdecode(os.fsencode(t) + b"/caf\xe9.png")).write_bytes(b"latin1")
    (root / "outside.png").write_bytes(b"outside")
    (t / "out.png").symlink_to(root / "outside.png")
    (t / "in.png").symlink_to(t / "a.png")
    (root / "src" / "control" / "a.png").write_bytes(b"c0")
    (root / "src" / "control" / "b.jpg").write_bytes(b"c0b")
    (root / "src" / "control_1" / "a.png").write_bytes(b"c1")
    (root / "src" / "mask" / "b.png").write_bytes(b"m")
    (root / "src" / "mask" / "orphan.png").write_bytes(b"o")
    return root / "src"


# content_listing_hash of _odd_folder: the code before the scandir listing (Path.iterdir + realpath per file)
# could not hash it (UnicodeEncodeError on the Latin-1 name), so this pin is the new code's; PINNED_UTF8 is the
# old code's hash of the same folder without that name (computed at 46b9a90), which the new code must equal
PINNED_LISTING = "da32385673079d84"
PINNED_UTF8 = "562a9e8ea3318513"


def test_the_listing_hash_is_unchanged_by_the_faster_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = _odd_folder(tmp_path)
    assert content_listing_hash(src) == PINNED_LISTING
    names = [os.path.relpath(f, src) for f in source_files(src)]
    assert names == sorted(names, key=lambda n: Path(n).parts) and "target/out.png" not in names
    assert "target/in.png" in names and "target/sub/deep.png" not in names and "target/.DS_Store" not in names
    assert count_samples(src, "folder") == len(list(iter_folder(src))) == 11  # 8 targets, notes.md, sub/, an orphan mask
    os.unlink(os.fsencode(src / "target") + b"/caf\xe9.png")
    assert content_listing_hash(src) == PINNED_UTF8


def test_a_run_lists_each_folder_once_with_a_bar(tmp_path, monkeypatch, capsys):
    """The listing hash, the bar's total and the reader share one scan per layout folder (they listed target/
    three times, with a stat and two realpath calls per file); the scan has its own bar (a million entries
    take a while on a network file system)."""
    import stages.resize.folder_listing as fl
    from pipeline.config import load_config
    from pipeline.demo_data import make_demo_data
    from stages.resize.stage import run

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    make_demo_data(tmp_path / "src", n=6, max_controls=2, seed=3, with_masks=True)
    scanned: list[str] = []
    real_scandir = os.scandir

    def counting(path="."):
        if Path(path).parent == tmp_path / "src":  # os.scandir is the os module's: the store uses it too
            scanned.append(Path(path).name)
        return real_scandir(path)

    monkeypatch.setattr(fl.os, "scandir", counting)
    small = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
             "resize.multiple": 16, "resize.min_side": 16}
    s = run(load_config(None, small), tmp_path / "src", tmp_path / "store")
    assert s.written == 6
    assert sorted(scanned) == ["control", "control_1", "mask", "target"]
    assert "listing target/" in capsys.readouterr().err
    assert list(iter_folder(tmp_path / "src"))  # outside a run nothing is remembered: scanned afresh
    assert scanned.count("target") == 2


def _jsonl_source(root: Path) -> Path:
    """A manifest naming files through a subfolder, '..', a symlink inside and one outside, names that sort
    differently as strings and as paths ('a-b' / 'a/b'), a missing file (no absolute path: the manifest's bytes,
    hashed too, would depend on where the test runs)."""
    src = root / "j"
    (src / "a").mkdir(parents=True)
    (src / "a" / "b.png").write_bytes(b"ab")
    (src / "a-b.png").write_bytes(b"a-b")
    (src / "z.png").write_bytes(b"z")
    (root / "outside.png").write_bytes(b"outside")
    (src / "out.png").symlink_to(root / "outside.png")
    (src / "in.png").symlink_to(src / "z.png")
    lines = [
        {"target": "a/b.png", "controls": ["a-b.png", "a/../z.png"], "caption": "x"},
        {"target": "in.png", "control": "out.png", "caption": "y"},
        {"target": "missing.png", "caption": "gone"},
    ]
    import json

    (src / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return src


def test_the_jsonl_listing_hash_is_unchanged(tmp_path, monkeypatch):
    """Real paths from the folder's remembered real path and the sort in C give the hash the Path sort and a
    realpath per file gave (value computed with that code)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = _jsonl_source(tmp_path)
    from stages.resize.folder_listing import remembered

    with remembered():
        inside = content_listing_hash(src)
    assert inside == content_listing_hash(src) == PINNED_JSONL_LISTING


PINNED_JSONL_LISTING = "50b0a7cdc04bd995"  # content_listing_hash of _jsonl_source before this change


def test_pictures_many_lines_name_are_listed_as_once(tmp_path):
    """A picture named by several lines (a control shared by many edits), and a refused one named again (outside
    the folder, missing), is judged once: the listing is the one of each named once."""
    import json

    from stages.resize.folder_listing import remembered
    from stages.resize.jsonl_source import jsonl_files

    src = _jsonl_source(tmp_path)
    with remembered():
        once = jsonl_files(src)
    lines = (src / "m.jsonl").read_text()
    again = [{"target": "a/../z.png", "controls": ["a/b.png", "out.png", "missing.png"], "caption": "again"},
             {"target": "a-b.png", "controls": ["in.png", str(src / "a" / "b.png")], "caption": "and again"}]
    (src / "m.jsonl").write_text(lines + "".join(json.dumps(line) + "\n" for line in again))
    with remembered():
        assert jsonl_files(src) == once
    assert jsonl_files(src) == once  # outside a run: no folder's real path remembered
    assert [p.name for p in once].count("b.png") == 1 and not any(p.name in ("out.png", "missing.png") for p in once)


def test_a_picture_refused_by_a_relative_path_and_read_by_an_absolute_one_is_listed(tmp_path):
    """The reader refuses a relative path that leaves the folder (a symlink out) but reads the same file named by
    an absolute path: listed, so a change to it changes the listing (judged once per name, it was left out when
    the refused line came first, and a resize run after an edit of that picture could reuse what it made of it)."""
    import json

    from stages.resize.jsonl_source import jsonl_files

    src, outside = tmp_path / "src", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    for f in (src / "t.png", src / "t2.png", outside / "x.png"):
        f.write_bytes(b"png")
    (src / "link").symlink_to(outside)
    lines = [{"target": "t.png", "controls": ["link/x.png"], "caption": "refused: leaves the folder"},
             {"target": "t2.png", "controls": [str(src / "link" / "x.png")], "caption": "read where it points"}]
    (src / "m.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert src / "link" / "x.png" in jsonl_files(src)
    (src / "m.jsonl").write_text(json.dumps(lines[0]) + "\n")
    assert src / "link" / "x.png" not in jsonl_files(src)  # named relatively alone: refused, not listed


def _old_hash(lines: list[tuple], settled: dict | None = None, unread: frozenset = frozenset()) -> str:
    """Listing.hash as it was, over (path, name, digest) tuples: the settled hash must not move."""
    import hashlib

    h = hashlib.sha256()
    for path, name, digest in lines:
        if path is None:
            h.update(f"{name}\n".encode())
            continue
        digest = "left unread" if path in unread else (settled or {}).get(path, digest)
        h.update(f"{name}\0{digest}\n".encode("utf-8", "surrogateescape"))
    for path in sorted(unread):
        h.update(f"read error\0{path}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def test_the_kept_listing_settles_to_the_hashes_its_lines_gave(tmp_path, monkeypatch):
    """The listing kept to settle a provisional lineage (first_read.py) is one buffer now, not a tuple of strings a
    file: every settled or unread variant hashes as the tuples did (a Latin-1 name, a symlink, a URL line too)."""
    from stages.resize.content import Listing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = _odd_folder(tmp_path)
    seen: list[tuple] = []
    real_add = Listing.add
    monkeypatch.setattr(Listing, "add", lambda self, path, name, digest="": (seen.append((path, name, digest)),
                                                                              real_add(self, path, name, digest))[1])
    kept = Listing()
    assert content_listing_hash(src, keep=kept) == PINNED_LISTING == kept.hash()
    kept.add(None, "https://host/shard-0.tar 10 etag")  # a URL line: no path
    latin1 = next(p for p, _, _ in seen if p is not None and "caf" in p)
    link = next(p for p, _, _ in seen if p is not None and p.endswith("in.png"))
    for settled, unread in (({}, frozenset()), ({link: "f" * 64}, frozenset()), ({}, frozenset({latin1, link})),
                            ({latin1: "changed while read: x"}, frozenset({str(src / "target" / "a.png")}))):
        assert kept.hash(settled, unread) == _old_hash(seen, settled, unread)
    assert kept.digests(frozenset({latin1, link})) == {p: d for p, _, d in seen if p in (latin1, link)}


def test_the_kept_listing_holds_little_a_file(tmp_path, monkeypatch):
    """A 1M-sample folder source lists ~3M files: the kept listing held ~430 B a file as (path, name, digest)
    strings (~1.2 GB); its lines' bytes are ~140 B."""
    import gc
    import tracemalloc

    from stages.resize.content import Listing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "src" / "target").mkdir(parents=True)
    files = 3000
    for i in range(files // 2):
        (tmp_path / "src" / "target" / f"pair_{i:07d}.png").write_bytes(b"p%d" % i)
        (tmp_path / "src" / "target" / f"pair_{i:07d}.txt").write_bytes(b"c%d" % i)
    content_listing_hash(tmp_path / "src")  # the cache rows written, modules imported: not counted
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = Listing()
        content_listing_hash(tmp_path / "src", keep=kept)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept.hash() == content_listing_hash(tmp_path / "src")
    assert held / files < 200, held / files
