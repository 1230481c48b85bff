"""A report written over an earlier one and interrupted between its files (a full disk, a kill) leaves no report:
the earlier metrics.json - what a rerun calls "up to date" - is gone before the first new file is written. Before:
grid.png and index.html of settings B beside A's metrics.json, and a rerun with A said "up to date" over B's page."""

from __future__ import annotations

import errno
import json
import re
import shutil

import pytest

from test_same_content_tables import EVAL, _copy, _steps, trained  # noqa: F401 (the module fixture)


def _both(store, run, single, every, model, skip_if_done=False, **settings):
    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import stage

    cfg = EvaluateConfig(**{**EVAL, **settings})
    return (stage.run(cfg, store, model, run / "lora", single, skip_if_done=skip_if_done),
            ev.run(cfg, store, model, _steps(run), every, skip_if_done=skip_if_done))


def test_a_report_cut_off_before_metrics_json_is_no_report(trained, tiny_plus_model, tmp_path, monkeypatch):
    from schemas.errors import UserError
    from store import format as fmt

    store, run = _copy(trained, tmp_path)
    single, every = tmp_path / "report", tmp_path / "checkpoints"
    _both(store, run, single, every, tiny_plus_model)  # settings A: both reports complete
    pages_a = {out: (out / "index.html").read_text() for out in (single, every)}

    write = fmt.atomic_write_bytes

    def disk_full_at_metrics(path, data, *a, **k):
        if path.name == "metrics.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(path, data, *a, **k)

    from schemas.config import EvaluateConfig
    from stages.evaluate import checkpoints as ev
    from stages.evaluate import stage

    cfg_b = EvaluateConfig(**{**EVAL, "noise_seeds": [7]})  # settings B: other numbers
    with monkeypatch.context() as m:
        m.setattr(fmt, "atomic_write_bytes", disk_full_at_metrics)
        for write_b in (lambda: stage.run(cfg_b, store, tiny_plus_model, run / "lora", single),
                        lambda: ev.run(cfg_b, store, tiny_plus_model, _steps(run), every)):
            with pytest.raises((UserError, OSError)):
                write_b()
    for out in (single, every):
        assert (out / "index.html").read_text() != pages_a[out]  # B's page was written ...
        assert not (out / "metrics.json").exists()  # ... and no report claims it: A's evidence is gone

    one, all_ = _both(store, run, single, every, tiny_plus_model, skip_if_done=True)  # `run all` with A again
    assert not one.up_to_date and not all_.up_to_date  # before: both "up to date", index.html showing B
    for out in (single, every):
        assert json.loads((out / "metrics.json").read_text())  # A's report again, complete
        assert (out / "index.html").read_text() == pages_a[out]


def test_a_flipped_bit_in_metrics_json_is_no_report_and_the_rerun_writes_it_again(trained, tiny_plus_model, tmp_path,
                                                                                    capsys):
    """metrics.json holds the numbers and the best checkpoint that `run all` prints when the report is up to date.
    A bit flipped there (a loss 1.02 -> 1.03, a step 50 -> 40) passed as "up to date" and was printed and used.
    Now the file is sealed (its own CRC32C): a damaged one is named in one line and the report written again."""
    store, run = _copy(trained, tmp_path)
    single, every = tmp_path / "report", tmp_path / "checkpoints"
    _both(store, run, single, every, tiny_plus_model)
    clean = {out: (out / "metrics.json").read_bytes() for out in (single, every)}
    for out in (single, every):
        data = bytearray(clean[out])
        data[re.search(rb'": \d\.\d{4}', data).end() - 1] ^= 0x01  # the 4th decimal of a figure
        (out / "metrics.json").write_bytes(bytes(data))
    capsys.readouterr()
    one, all_ = _both(store, run, single, every, tiny_plus_model, skip_if_done=True)
    assert not one.up_to_date and not all_.up_to_date
    said = capsys.readouterr().out
    for out in (single, every):
        assert f"{out / 'metrics.json'} is damaged (checksum mismatch" in said
        assert (out / "metrics.json").read_bytes() == clean[out]
    again = _both(store, run, single, every, tiny_plus_model, skip_if_done=True)
    assert all(r.up_to_date for r in again)


def test_pipeline_compare_refuses_a_damaged_metrics_json_naming_it(trained, tiny_plus_model, tmp_path):
    """`pipeline compare` reads the report beside each loss array (whether its EMA curve is the report's, which
    backend an unset one was): it parsed metrics.json unchecked, so a flipped figure there was taken as it read.
    Now a damaged one is refused in one line naming the file and the evaluate that writes it again."""
    from schemas.errors import UserError
    from stages.evaluate.compare import write_compare

    store, run = _copy(trained, tmp_path)
    single, every = tmp_path / "report", tmp_path / "checkpoints"
    _both(store, run, single, every, tiny_plus_model)
    other = tmp_path / "copy"  # a second report of the same held-out set, intact
    shutil.copytree(every, other)
    write_compare([str(other), str(every)], tmp_path / "cmp")  # intact: compared
    data = bytearray((every / "metrics.json").read_bytes())
    data[re.search(rb'": \d\.\d{4}', data).end() - 1] ^= 0x01  # the 4th decimal of a figure: still valid JSON
    (every / "metrics.json").write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        write_compare([str(other), str(every)], tmp_path / "cmp-damaged")
    assert str(e.value).startswith(f"{every / 'metrics.json'} is damaged (checksum mismatch")
    assert "pipeline run evaluate --all-checkpoints" in str(e.value)
    assert not (tmp_path / "cmp-damaged").exists()
