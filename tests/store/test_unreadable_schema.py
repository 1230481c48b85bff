"""A version whose schema.json does not read (empty, truncated or a flipped bit after a crash; its checksums.json
damaged) and that nothing has recorded as damaged yet: `find_version` treats it as a version `store verify`
marked (skipped, and recorded), never as a reason to stop every rerun nor as a version to reuse; `store inspect`
names it and describes the rest; `store gc` keeps what it may have been made from; a writer opens a new version
past an in-progress one whose schema.json a crash emptied."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from damage import flip_bit
from pipeline.cli import app
from store import Store
from store import format as fmt
from store_samples import fill, fill_images, lineage, vae_schema

runner = CliRunner()


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "renamed-field":  # still valid JSON and a valid schema, one bit off: "mask_weight" -> "mask_weighu"
        flip_bit(path, data.index(b"mask_weight") + len("mask_weigh"), 0)
    elif how == "checksums":
        flip_bit(path.with_name(fmt.CHECKSUMS), 30, 1)


@pytest.mark.parametrize("how", ["empty", "truncated", "renamed-field", "checksums"])
def test_find_version_skips_and_records_a_version_whose_schema_does_not_read(store: Store, how: str) -> None:
    """Before: "empty"/"truncated" raised from find_version for every lineage asked about (every rerun of the
    stage stopped there); "renamed-field" and "checksums" were reused as up to date, the damage unseen."""
    fill(store, 3, tag="a")
    fill(store, 3, tag="b")  # v2, current
    damage(store.root / "vae" / "v1" / fmt.SCHEMA_JSON, how)
    assert store.find_version("vae", lineage("b")) == 2  # another lineage's run goes on as before
    assert store.find_version("vae", lineage("a")) is None  # its own: a new version is written
    assert fmt.damaged_marker(store.root, "vae", 1).is_file()  # as `store verify` would have marked it
    assert store.find_version("vae", lineage("b")) == 2


def test_gc_keeps_what_a_kept_version_with_an_unreadable_schema_may_name(store: Store) -> None:
    """Before: `store gc` stopped with "schema.json is not valid JSON" (nothing collected until the stage was
    rerun). Now the versions it may have been made from are kept, and the line says why and what to run."""
    assert fill_images(store, "a") == 1  # what vae v1 names as upstream (store_samples.lineage)
    fill(store, 3)
    assert fill_images(store, "b") == 2  # current
    fill_images(store, "c")
    store.set_current("images", 2)
    (store.root / "vae" / "v1" / fmt.SCHEMA_JSON).write_bytes(b"")
    r = runner.invoke(app, ["store", "gc", str(store.root)])
    assert r.exit_code == 0, r.output
    assert "vae v1" in r.output and fmt.SCHEMA_JSON in r.output and "pipeline run encode-vae" in r.output
    assert all((store.root / "images" / f"v{v}").is_dir() for v in (1, 2, 3))
    assert not fmt.damaged_marker(store.root, "vae", 1).exists()  # gc records nothing (a dry run writes nothing)


def test_gc_of_a_store_of_that_table_alone_says_nothing_kept_for_it(store: Store) -> None:
    """No other table: nothing is kept for the unreadable version, so no line claims so (before: one did)."""
    fill(store, 3)
    (store.root / "vae" / "v1" / fmt.SCHEMA_JSON).write_bytes(b"")
    r = runner.invoke(app, ["store", "gc", str(store.root)])
    assert r.exit_code == 0 and "keep every version" not in r.output, r.output


def test_inspect_names_a_version_whose_schema_does_not_read_and_describes_the_rest(store: Store) -> None:
    """Before: `store inspect` stopped at the first such version, describing nothing."""
    fill(store, 3, tag="a")
    fill(store, 4, tag="b")
    (store.root / "vae" / "v1" / fmt.SCHEMA_JSON).write_bytes(b"{")
    r = runner.invoke(app, ["store", "inspect", str(store.root)])
    assert r.exit_code == 0, r.output
    v1 = next(ln for ln in r.output.splitlines() if "v1:" in ln)
    assert "damaged" in v1 and fmt.SCHEMA_JSON in v1
    assert "v2: schema v2, 4 samples" in r.output


def test_a_writer_opens_a_new_version_past_an_in_progress_one_whose_schema_a_crash_emptied(store: Store) -> None:
    """Before: every writer of the table (every run of its stage) stopped with "schema.json is not valid JSON"."""
    fill(store, 2)
    (store.root / "vae" / "v2").mkdir()
    (store.root / "vae" / "v2" / fmt.SCHEMA_JSON).write_bytes(b"")
    assert fill(store, 2, tag="b") == 3
    assert store.reader("vae").schema == vae_schema("b")


def test_gc_of_a_url_keeps_what_a_kept_version_with_an_unreadable_schema_may_name(s3_env, store: Store) -> None:
    """Before: `store gc URL` read the damaged schema.json as naming nothing and removed images v1 (what vae v1
    was built from) and v3, where the local gc keeps every version of the other tables; one mechanism now."""
    from store.remote import open_remote
    from store.remote_parts import make_current
    from store.remote_push import push

    assert fill_images(store, "a") == 1
    fill(store, 3)
    assert fill_images(store, "b") == 2
    url = s3_env.url()
    push(store.root, url)  # images v2 while current: a push leaves out versions a newer current one replaced
    fill_images(store, "c")
    push(store.root, url)  # with v3 current
    assert make_current(open_remote(url), "images", 2, over=3) == 2  # v3 switched away from at the URL
    client = s3_env.client()
    listed = lambda: {o["Key"] for o in client.list_objects_v2(Bucket=s3_env.bucket).get("Contents", [])}
    assert {f"store/images/v{v}/{fmt.MANIFEST}" for v in (1, 2, 3)} <= listed()
    client.put_object(Bucket=s3_env.bucket, Key=f"store/vae/v1/{fmt.SCHEMA_JSON}", Body=b"")
    r = runner.invoke(app, ["store", "gc", url])
    assert r.exit_code == 0, r.output
    assert "keep every version of the other tables: vae v1" in r.output and f"{url}/vae/v1" in r.output, r.output
    # the advice verify gives for it at a URL (a rerun writes a new local version; the remote's object stays)
    assert f"delete {url}/vae/v1/{fmt.SCHEMA_JSON} (objects are never overwritten) and push that version again" \
        in r.output and "rerun" not in r.output and "cached in" not in r.output, r.output
    assert {f"store/images/v{v}/{fmt.MANIFEST}" for v in (1, 2, 3)} <= listed()


def test_newest_complete_skips_a_version_whose_schema_reads_but_fails_its_checksum(store: Store) -> None:
    """`newest_complete` (what a run writing a new version compares itself with, and the version whose notes
    resize reads) parsed schema.json unchecked: a flipped bit that still parses ("mask_weight" -> "mask_weighu")
    stood for the version. Checked now, the version is skipped for the next older one and recorded as damaged."""
    fill(store, 3, tag="a")
    fill(store, 3, tag="b")
    damage(store.version_dir("vae", 2) / fmt.SCHEMA_JSON, "renamed-field")
    v, schema = store.newest_complete("vae")
    assert (v, schema.lineage) == (1, lineage("a"))
    assert fmt.damaged_marker(store.root, "vae", 2).exists()


def test_evaluate_never_takes_the_images_version_trained_on_from_a_schema_that_fails_its_checksum(
        store: Store) -> None:
    """evaluate's trained-on check reads which `images` version a run's `vae` table was encoded from in its
    schema.json: read unchecked, a flipped bit that still parses ("images": 1 -> 0) named another version, whose
    train rows the val samples were then compared with. Checked now, the check says it cannot be made."""
    import re

    from stages.evaluate.trained_val import training_images

    fill(store, 3, tag="a")
    path = store.version_dir("vae", 1) / fmt.SCHEMA_JSON
    data = path.read_bytes()
    at = re.search(rb'"images":\s*1', data).end() - 1
    flip_bit(path, at, 0)
    assert path.read_bytes()[at:at + 1] == b"0"
    images, why = training_images(store, {"vae": store.version_id("vae", 1)})
    assert images is None and "does not read" in why and fmt.SCHEMA_JSON in why


def test_a_schema_that_fails_its_checksum_never_lowers_the_pixel_limit_carried_rows_count_as_checked_under(
        store: Store) -> None:
    """resize's pixel limit: a version without a note counts as checked under the highest limit any complete
    version's schema.json records. Read unchecked, a flipped digit that still parses (3000000 -> 2000000) lowered
    that bound under a lowered limit, and the note-less version's rows were carried unchecked. Checked now, a
    limit that does not read is unknown: those rows are all checked."""
    from dataclasses import replace

    from stages.resize.pixel_limit import pixel_limit
    from stages.resize.recorded_resize import recorded_resize
    from store_samples import key_of, sample

    for tag, most, idx in (("a", 2_000_000, range(3)), ("b", 3_000_000, range(3, 6))):
        s = vae_schema(tag)
        w = store.writer("images", replace(s, name="images", attrs={**s.attrs, "resize": {"max_image_pixels": most}}),
                         shard_size_mb=0.004)
        for i in idx:
            got = sample(i)
            w.add(got["key"], tensors=got["tensors"], files=got["files"], meta=got["meta"])
        w.commit()
    path = store.version_dir("images", 2) / fmt.SCHEMA_JSON
    data = path.read_bytes()
    at = data.index(b"3000000")
    flip_bit(path, at, 0)
    assert path.read_bytes()[at:at + 7] == b"2000000"
    assert set(pixel_limit(store, 2_500_000, recorded_resize(store)).recheck) == {key_of(i) for i in range(3)}
