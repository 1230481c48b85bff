"""resize-bucket reads parquet sources (image bytes in columns, HF datasets' `{bytes, path}` struct layout or plain
binary, a column mapping in `resize.columns`): the same `images` table as the folder source of the same samples;
bad rows are quarantined with the same reasons as bad files; a missing mapped column is one UserError line."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from pipeline.demo_data import generate_samples, make_demo_data, write_folder
from schemas.errors import UserError
from stages.resize import parquet_source
from stages.resize.stage import run
from store import Store
from test_resize_shard_urls import _table  # key -> (row without `source`, files)

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2}
N = 20
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # HF datasets' Image() feature in parquet


def cfg(**columns):
    return load_config(None, {**SMALL, **{f"resize.columns.{k}": v for k, v in columns.items()}})


def _img(data: bytes | None, name: str) -> dict | None:
    return None if data is None else {"bytes": data, "path": name}


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> dict:
    """Demo samples as a folder source and that folder's table."""
    base = tmp_path_factory.mktemp("pq")
    ss = list(generate_samples(n=N, max_controls=2, seed=11, with_masks=True))  # a generator: used twice here
    write_folder(base / "folder", ss)
    s = run(cfg(), base / "folder", base / "store-folder")
    assert s.written == N and not s.quarantined
    return {"base": base, "samples": ss, "table": _table(base / "store-folder")}


def _edit_dataset(path: Path, ss, row_group_size: int = 3) -> None:
    """MagicBrush-like names: one column per reference image (null when the sample has fewer), a mask column."""
    def ref(i):
        return pa.array([_img(s.controls[i] if len(s.controls) > i else None, f"{s.stem}.{i}.png") for s in ss], IMAGE)

    pq.write_table(pa.table({
        "id": pa.array([s.stem for s in ss]),
        "source_img": ref(0),
        "source_img_2": ref(1),
        "target_img": pa.array([_img(s.target, f"{s.stem}.png") for s in ss], IMAGE),
        "instruction": pa.array([s.caption for s in ss]),
        "mask_img": pa.array([_img(s.mask, f"{s.stem}.mask.png") for s in ss], IMAGE),
    }), path, row_group_size=row_group_size)


MAPPING = {"target": "target_img", "references": ["source_img", "source_img_2"], "instruction": "instruction",
           "mask": "mask_img"}


def test_hf_struct_columns_with_a_mapping_give_the_folder_table(samples, tmp_path, monkeypatch):
    _edit_dataset(tmp_path / "edits.parquet", samples["samples"])
    # read in row batches: a batch never holds the whole file
    seen = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, **kw):
        for b in real(self, *a, **kw):
            seen.append(b.num_rows)
            yield b

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(parquet_source, "BATCH_ROWS", 4)
    s = run(cfg(**MAPPING), tmp_path / "edits.parquet", tmp_path / "store")
    assert s.written == N and not s.quarantined
    assert _table(tmp_path / "store") == samples["table"]
    assert sum(seen) == N and max(seen) <= 4
    assert run(cfg(**MAPPING), tmp_path / "edits.parquet", tmp_path / "store").up_to_date
    # another mapping reads other bytes: a new version (here: no masks)
    s = run(cfg(**{**MAPPING, "mask": None}), tmp_path / "edits.parquet", tmp_path / "store")
    assert not s.up_to_date


def test_a_list_column_folder_of_files_and_the_demo_layout(samples, tmp_path):
    # make-demo-data --format parquet: HF's data/train-*.parquet, `controls` a list of images, default mapping
    make_demo_data(tmp_path / "demo", n=N, fmt="parquet", max_controls=2, seed=11, with_masks=True)
    s = run(cfg(mask="mask"), tmp_path / "demo", tmp_path / "store")
    assert s.written == N and not s.quarantined
    assert _table(tmp_path / "store") == samples["table"]
    # split into two files of plain binary columns: the same table; a store inside the source is not read
    ss = samples["samples"]
    for name, part in (("a.parquet", ss[:7]), ("b.parquet", ss[7:])):
        (tmp_path / "bin" / "data").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({
            "target": pa.array([s.target for s in part], pa.binary()),
            "controls": pa.array([s.controls for s in part], pa.list_(pa.binary())),
            "caption": pa.array([s.caption for s in part]),
            "mask": pa.array([s.mask for s in part], pa.binary()),
        }), tmp_path / "bin" / "data" / name)
    s = run(cfg(mask="mask"), tmp_path / "bin", tmp_path / "bin" / "store")
    assert s.written == N and _table(tmp_path / "bin" / "store") == samples["table"]
    assert run(cfg(mask="mask"), tmp_path / "bin", tmp_path / "bin" / "store").up_to_date


def _png(colour=(200, 40, 40)) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(b, format="PNG")
    return b.getvalue()


def test_bad_rows_are_quarantined_with_the_reasons_of_bad_files(tmp_path):
    good, broken = _png(), _png((1, 2, 3))[:-30]  # cut inside its data: corrupt
    big = _png((9, 9, 9)) + b"\0" * 5000
    rows = [  # (target, references, instruction)
        (_img(good, "ok.png"), [], "fine"),
        (_img(broken, "broken.png"), [], "broken target"),
        (_img(good, "x.png"), [_img(broken, "c.png")], "broken control"),
        (_img(b"", "empty.png"), [], "empty"),
        (None, [], "no target"),
        ({"bytes": None, "path": "/etc/passwd"}, [], "only a path"),
        (_img(big, "big.png"), [], "big"),
        (_img(_png((5, 5, 5)), "nocap.png"), [], None),
        (_img(_png((6, 6, 6)), "c1.png"), [None], "null reference"),
    ]
    pq.write_table(pa.table({
        "t": pa.array([r[0] for r in rows], IMAGE),
        "refs": pa.array([r[1] for r in rows], pa.list_(IMAGE)),
        "text": pa.array([r[2] for r in rows]),
    }), tmp_path / "d.parquet")
    # the same broken bytes as files of a folder source
    folder = tmp_path / "folder"
    (folder / "target").mkdir(parents=True)
    (folder / "control").mkdir()
    for stem, target, caption in (("ok", good, "fine"), ("broken", broken, "broken target"), ("x", good, "broken control"),
                                  ("empty", b"", "empty")):
        (folder / "target" / f"{stem}.png").write_bytes(target)
        (folder / "target" / f"{stem}.txt").write_text(caption)
    (folder / "control" / "x.png").write_bytes(broken)
    run(cfg(), folder, tmp_path / "store-folder")
    by_file = {Path(r["source"]).stem: r["reason"] for r in Store(tmp_path / "store-folder").quarantine().to_pylist()}

    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(tmp_path / "d.parquet"), "--store",
                                      str(tmp_path / "store"), "--set", "resize.target_area=4096", "--set",
                                      "resize.multiple=16", "--set", "resize.max_file_bytes=4000", "--set",
                                      "resize.columns={target: t, references: [refs], instruction: text}"])
    assert result.exit_code == 0, result.output
    q = {int(r["source"].rsplit(":", 1)[1]): (r["reason"], r["detail"]) for r in Store(tmp_path / "store").quarantine().to_pylist()}
    assert sorted(q) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert q[1][0] == by_file["broken"] == "corrupt-image"
    assert q[2][0] == by_file["x"] == "corrupt-image" and f"{tmp_path / 'd.parquet'}:2[refs[0]]" in q[2][1]
    assert q[3][0] == by_file["empty"] == "empty-image"
    assert q[4] == ("bad-source", "target (column 't') is null")
    assert q[5][0] == "bad-source" and "only a path ('/etc/passwd'): not read" in q[5][1]
    assert q[6][0] == "file-too-large" and "resize.max_file_bytes" in q[6][1]
    assert q[7][0] == "missing-caption"
    assert q[8] == ("bad-source", "control 0 (column 'refs[0]') is null")


def test_a_missing_mapped_column_is_one_line_naming_it_and_the_file(samples, tmp_path):
    _edit_dataset(tmp_path / "edits.parquet", samples["samples"][:3])
    with pytest.raises(UserError) as e:
        run(cfg(**{**MAPPING, "references": ["source_img", "source_image_2"]}), tmp_path / "edits.parquet",
            tmp_path / "store")
    msg = str(e.value)
    assert "\n" not in msg and "'source_image_2'" in msg and str(tmp_path / "edits.parquet") in msg
    assert "resize.columns.references" in msg and "source_img_2" in msg  # what is there, to pick from
    result = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(tmp_path / "edits.parquet"), "--store",
                                      str(tmp_path / "store")])  # the default mapping: no column 'target'
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "no column 'target' (resize.columns.target)" in result.output
    with pytest.raises(UserError, match="column 'id' .* is string, not image bytes"):
        run(cfg(**{**MAPPING, "target": "id"}), tmp_path / "edits.parquet", tmp_path / "store")


def test_parquet_at_an_s3_url_gives_the_table_of_the_local_file(samples, s3_env, tmp_path):
    """A parquet file (and a prefix of them) on the S3 test server, read through fsspec: the same `images` table as
    the same file read locally; unchanged objects are up to date, a missing one is one line naming it."""
    local = tmp_path / "edits.parquet"
    _edit_dataset(local, samples["samples"])
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="data/train-00000.parquet", Body=local.read_bytes())
    url = f"s3://{s3_env.bucket}/data/train-00000.parquet"
    s = run(cfg(**MAPPING), url, tmp_path / "store")
    assert s.written == N and not s.quarantined
    assert _table(tmp_path / "store") == samples["table"]
    assert run(cfg(**MAPPING), url, tmp_path / "store").up_to_date  # same size and ETag
    s = run(cfg(**MAPPING), f"s3://{s3_env.bucket}/data", tmp_path / "store-prefix")  # the prefix: its files
    assert s.written == N and _table(tmp_path / "store-prefix") == samples["table"]
    with pytest.raises(UserError, match=f"s3://{s3_env.bucket}/data/nope.parquet"):
        run(cfg(**MAPPING), f"s3://{s3_env.bucket}/data/nope.parquet", tmp_path / "store")


def test_a_server_stopped_mid_file_is_one_line_not_quarantined_rows(samples, tmp_path, monkeypatch):
    from s3_server import aws_env, start_server

    local = tmp_path / "edits.parquet"
    _edit_dataset(local, samples["samples"])
    server, endpoint = start_server()
    aws_env(monkeypatch, endpoint)
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="outage-parquet")
    client.put_object(Bucket="outage-parquet", Key="edits.parquet", Body=local.read_bytes())
    monkeypatch.setattr(parquet_source, "BATCH_ROWS", 2)
    monkeypatch.setattr(parquet_source, "URL_BLOCK_BYTES", 4096)  # the file is not all fetched before the stop
    rows = parquet_source.iter_parquet("s3://outage-parquet/edits.parquet", cfg(**MAPPING).resize.columns, 1 << 30)
    assert next(rows).problem is None
    server.stop()
    with pytest.raises(UserError, match="lost the connection to s3://outage-parquet/edits.parquet") as e:
        for s in rows:
            assert s.problem is None  # nothing blamed on the data
    assert "\n" not in str(e.value)



def test_a_dictionary_encoded_instruction_column_is_read_as_text(tmp_path):
    """pandas writes a `category` column (captions repeated across rows) dictionary-encoded: it was refused as
    'dictionary<values=string, ...>, not text; fix resize.columns.instruction', a fix no mapping gives. Its values
    are text: read as a plain string column's, the same table."""
    images = pa.array([_img(_png((i, 9, 9)), f"{i}.png") for i in range(3)], IMAGE)
    text = pa.array(["make it red", "make it blue", "make it red"])
    for name, captions in (("plain", text), ("category", text.dictionary_encode())):
        (tmp_path / name).mkdir()
        pq.write_table(pa.table({"t": images, "text": captions}), tmp_path / name / "d.parquet")
    mapping = {"target": "t", "references": [], "instruction": "text"}
    plain, category = (run(cfg(**mapping), tmp_path / name, tmp_path / f"store-{name}") for name in ("plain", "category"))
    assert category.written == plain.written == 3 and not category.quarantined
    assert _table(tmp_path / "store-category") == _table(tmp_path / "store-plain")
