"""Progress bars a user watches: resize-bucket's has a total (so a % and an ETA); the encode bars move per
encoded request and count samples read from the first second, instead of sitting at 0% until batches fill."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from pipeline.demo_data import make_demo_data
from stages.encode.progress import SampleProgress
import warm_start

REPO = Path(__file__).resolve().parents[2]
def _cli(*args: str) -> subprocess.CompletedProcess:
    # started warm (tests/warm_start.py): the CLI's own process, output to files (not a terminal) as to pipes. The
    # environment is the test's (the session's TMPDIR and caches, tests/conftest.py), so the warm parent is the
    # other tests' (one taken at import had its own: ~9 s of CPU importing torch again)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "COLUMNS": "200"}
    proc = warm_start.run([sys.executable, "-m", "pipeline.cli", *args], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_sample_progress_moves_before_a_sample_is_complete():
    out = io.StringIO()
    bar = SampleProgress(3, "encode-vae", file=out)
    bar.bar.mininterval = 0  # draw every change
    for _ in range(3):
        bar.sample_read()  # read and preprocessed, waiting for a batch
    assert "0.0/3 samples" in out.getvalue() and "read 3" in out.getvalue()
    bar.encoded(2)  # the target of a sample with one control (2 requests)
    assert "0.5/3 samples" in out.getvalue().rsplit("\r", 1)[-1]
    for requests in (2, 3, 3, 3):
        bar.encoded(requests)
    bar.skipped()  # a quarantined sample counts as done
    bar.close()
    last = out.getvalue().rsplit("\r", 1)[-1]
    assert bar.bar.n == 3  # exactly: thirds never sum past the total
    assert "100%" in last and "3.0/3 samples" in last and "sample/s" in last


def test_resize_bucket_and_encode_bars_through_the_cli(tiny_plus_model, tmp_path):
    make_demo_data(tmp_path / "data", n=5, fmt="folder", max_controls=2, seed=4)
    store = str(tmp_path / "store")
    resize = _cli("run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", store, "--area", "4096")
    assert "resize-bucket (folder): 100% 5/5 [" in resize.stderr, resize.stderr
    vae = _cli("run", "encode-vae", "--store", store, "--model", tiny_plus_model, "--batch-size", "4")
    # stderr is a file here, as a job's log: each bar's lines (pipeline/bars.py), no \r frames, no cursor codes
    [final] = [line for line in vae.stderr.split("\n") if line.startswith("encode-vae:")]
    assert final.startswith("encode-vae: 100% 5.0/5 samples [") and final.endswith("read 5]"), vae.stderr
    for out in (resize.stderr, vae.stderr):
        assert "\r" not in out and "\x1b" not in out, repr(out)


def test_resize_bar_total_counts_every_source_format(tmp_path):
    from stages.resize.source_count import count_samples
    from stages.resize.sources import detect_format, iter_source

    for fmt in ("folder", "webdataset", "jsonl", "parquet"):
        root = tmp_path / fmt
        make_demo_data(root, n=7, fmt=fmt, max_controls=2, seed=1)
        found = detect_format(root)
        assert count_samples(root, found) == sum(1 for _ in iter_source(root)) == 7, fmt
    braces = f"{tmp_path / 'webdataset'}/demo-{{000000..000000}}.tar"  # a brace list of local shards: counted too
    assert count_samples(braces, detect_format(braces)) == 7


def test_counting_a_webdataset_source_has_its_own_bar(tmp_path, capsys):
    """The count behind the resize bar's total walks every shard's tar headers: over a million samples that is
    minutes (2.5 s measured for 20,000 samples), which passed without a bar before the resize bar appeared."""
    import shutil

    from stages.resize.source_count import count_samples

    make_demo_data(tmp_path / "one", n=4, fmt="webdataset", max_controls=1, seed=1)
    [tar] = (tmp_path / "one").glob("*.tar")
    (tmp_path / "src").mkdir()
    for i in range(3):
        shutil.copy(tar, tmp_path / "src" / f"part-{i}.tar")
    capsys.readouterr()
    assert count_samples(tmp_path / "src", "webdataset") == 12
    assert "counting samples:   0%|          | 0/3 [" in capsys.readouterr().err



def test_the_val_read_bar_counts_samples(capsys):
    """evaluate's and validation's read of the val samples counted "it" (as did the held-out passes, generation
    and denoising: batches, images and steps now): its rate and ETA are in samples."""
    from features.damaged import read_intact

    class Tables(list):  # what read_intact uses of a join: its rows and its damage bookkeeping
        on_damaged, damaged, max_damaged_fraction = "stop", {}, 0.0

    assert read_intact(Tables(range(3)), 3, lambda i: i * 10, "read val samples") == [0, 10, 20]
    err = capsys.readouterr().err
    assert "read val samples:" in err and "sample/s" in err and "it/s" not in err, err


def test_resize_bar_ends_at_100_percent_past_an_orphan_file(tmp_path):
    """A folder source's total counts targets; an orphan control file is one more entry read. The bar's total is
    settled to what was read at the end: before, the bar (a tqdm iterated, closed when exhausted) was already
    closed there, so it ended as a bare count past its total ('6sample [...]'), no percentage."""
    from PIL import Image

    make_demo_data(tmp_path / "data", n=5, fmt="folder", max_controls=1, seed=4)
    Image.new("RGB", (32, 32)).save(tmp_path / "data" / "control" / "no_such_target.png")
    resize = _cli("run", "resize-bucket", "--source", str(tmp_path / "data"), "--store", str(tmp_path / "store"),
                  "--area", "4096")
    final = resize.stderr.rsplit("resize-bucket (folder):", 1)[-1].split("\n")[0]
    assert "100% 6/6 [" in final and "sample/s" in final, resize.stderr
