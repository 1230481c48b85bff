"""A resize-bucket run over several webdataset tars SIGKILLed right after its version's manifest was written (the
version complete, store.json not yet switched to it): the rerun makes that version current as it is, reads no tar
byte (the streamed hashes were cached before the commit), renders nothing, and the store equals an uninterrupted
run's. Also for a second version, one tar added to the source."""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import load_config
from stages.resize import rendering, stage
from store import Store
from tests.stages.read_counter import count_reads_under
from tests.stages.test_resize_first_read import _png, _source
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows
import warm_start


def _add_tar(src: Path) -> None:
    rng = np.random.default_rng(9)
    with tarfile.open(src / "shard-0009.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(3):
            for name, data in ((f"s9_{i}.png", _png(rng, 256)), (f"s9_{i}.txt", f"edit 9 {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("version", [1, 2])
def test_a_run_sigkilled_after_its_manifest_loses_nothing_and_reads_no_tar_again(tmp_path: Path, monkeypatch,
                                                                                version: int) -> None:
    src, out = _source(tmp_path, tars=3), tmp_path / "store"
    cfg = load_config(None, SMALL)
    if version == 2:
        stage.run(cfg, src, out)
        _add_tar(src)
    code = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
            f"run(load_config(None, {SMALL!r}), sys.argv[1], sys.argv[2])")
    killed = warm_start.run([sys.executable, "-c", code, str(src), str(out)],  # started warm (tests/warm_start.py)
                            env={**os.environ, "STORE_CRASH_AT": "after_manifest"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    st = Store(out)
    assert (st.version_dir("images", version) / "manifest.parquet").is_file()
    assert st.tables().get("images") == (None if version == 1 else 1)  # killed before the switch

    reads = count_reads_under(monkeypatch, src)
    rendered = []
    real_render = rendering.render
    monkeypatch.setattr(rendering, "render", lambda rec, *a, **k: rendered.append(rec.source) or real_render(rec, *a, **k))
    again = stage.run(cfg, src, out)
    monkeypatch.undo()
    assert (again.up_to_date, again.version, again.written) == (True, version, 0)
    assert again.reused == (9 if version == 1 else 12) and not rendered
    assert Store(out).tables()["images"] == version
    assert not {f: n for f, n in reads.items() if f.endswith(".tar") and n}, reads  # no tar byte read again

    fresh = tmp_path / "fresh"
    stage.run(cfg, src, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh)) and _quarantine(Store(out)) == _quarantine(Store(fresh))
    assert stage.run(cfg, src, out).up_to_date
