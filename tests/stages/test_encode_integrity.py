"""The encode stages refuse a damaged `images` sample (one line naming it), and an encoder that finds its table
completed by another process meanwhile reports "up to date" instead of writing a duplicate version."""

from __future__ import annotations

from pathlib import Path

import pytest

from typer.testing import CliRunner

from damage import flip_bit, key_at, sample_byte
from pipeline.cli import app
from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.encode.common import EncodeJob
from store import Store
from store.verify import verify_store

F32 = {"encode_vae.dtype": "float32"}


def test_encode_vae_refuses_a_damaged_png_in_images(tiny_edit_model, edit_store):
    key = key_at(edit_store, "images", 1)
    shard, pos = sample_byte(edit_store, "images", key, "target.png")
    flip_bit(shard, pos, 3)  # inside the PNG's pixel data: still decodes, wrong pixels
    res = CliRunner().invoke(app, ["run", "encode-vae", "--store", str(edit_store), "--model", tiny_edit_model,
                                   "--device", "cpu"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    line = [ln for ln in res.output.splitlines() if "error:" in ln][0]
    assert "table 'images' v1" in line and key in line and shard.name in line and "pipeline store repair" in line
    assert "vae" not in Store(edit_store).tables()


def test_encoder_finding_its_table_completed_meanwhile_reports_up_to_date(tiny_edit_model, edit_store, monkeypatch):
    real = EncodeJob.open_writer
    raced = []

    def other_process_finishes_first(self, schema, shard_size_mb):
        if not raced:  # another encoder (same config) completes the table while this one loads its model
            raced.append(1)
            other = encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)
            assert not other.up_to_date and other.version == 1
        return real(self, schema, shard_size_mb)

    monkeypatch.setattr(EncodeJob, "open_writer", other_process_finishes_first)
    summary = encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)
    assert summary.up_to_date and summary.version == 1 and summary.encoded == 0
    st = Store(edit_store)
    assert st.versions("vae") == [1] and st.tables()["vae"] == 1  # no duplicate version
    assert verify_store(Path(edit_store), progress=False) == []


def test_two_ranks_agree_on_a_table_completed_meanwhile(tiny_edit_model, edit_store):
    """Another launch's commit lands between rank 0's and rank 1's "completed meanwhile?" look: rank 0 adopted
    it and ended while rank 1 encoded its share and waited for rank 0 at the commit (a hang, or gloo's
    "connection closed" traceback). Now the ranks agree: both adopt the complete version, nothing is written."""
    from two_ranks import launch_two, results

    first = encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)  # "the other launch"
    assert first.version == 1
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("completed_meanwhile_ranks.py", str(edit_store),
                                                      tiny_edit_model, timeout=300)
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    assert results(out0) == results(out1) == {"summary": "1 True"}, (out0, out1, err1[-2000:])
    st = Store(edit_store)
    assert st.versions("vae") == [1] and st.tables()["vae"] == 1
    assert verify_store(Path(edit_store), progress=False) == []


@pytest.mark.parametrize("mine, peers, several_caches, adopted", [
    (1, [None], False, 1),   # one store folder: the peer will read the version this rank saw
    (None, [1], False, 1),
    (1, [None], True, None),  # several caches of a store URL: a cache without it cannot adopt it; all encode
    (1, [1], True, 1),
    (None, [None], True, None),
])
def test_the_version_adopted_is_one_every_rank_can_read(monkeypatch, mine, peers, several_caches, adopted):
    import models.collective as collective
    from stages.encode.output import agreed_found

    def all_max(world, values):  # the peers' looks, reduced as the all-reduce does
        looks = [[-1 if f is None else f, -(-1 if f is None else f)] for f in peers]
        return [max(v, *(look[i] for look in looks)) for i, v in enumerate(values)]

    monkeypatch.setattr(collective.agree, "all_max", all_max)  # spread's
    assert agreed_found(mine, 2, several_caches) == adopted


def test_the_empty_version_dropped_for_one_completed_meanwhile_is_never_another_writers(
        tiny_edit_model, edit_store, monkeypatch):
    """The encoder that finds its table completed meanwhile drops the empty version it opened. It gave its writer
    lock back first, then deleted the folder: a writer of the same settings opening in between (another launch)
    resumed that folder and lost it under its feet. Now the folder goes while the lock is held."""
    from store.writer import TableWriter

    real_open, real_close, other, armed = EncodeJob.open_writer, TableWriter.close, [], []

    def other_process_finishes_first(self, schema, shard_size_mb):
        if not armed:
            armed.append(1)
            encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)  # v1, complete
            armed.append(2)  # from here on: this run's writer
        return real_open(self, schema, shard_size_mb)

    def close(self):
        real_close(self)
        if self.table == "vae" and len(armed) == 2 and not other:  # its lock just given back: another launch opens
            other.append(TableWriter(Store(edit_store), "vae", self.schema))

    monkeypatch.setattr(EncodeJob, "open_writer", other_process_finishes_first)
    monkeypatch.setattr(TableWriter, "close", close)
    summary = encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)
    assert summary.up_to_date and summary.version == 1
    assert other and (other[0].dir / "schema.json").is_file(), "another writer's version was removed"
    other[0].close()


def test_an_empty_version_not_removed_is_one_line_the_ranks_agree_on(tiny_edit_model, edit_store, monkeypatch):
    """The encoder that finds its table completed meanwhile removes the empty version it opened (rank 0). A rename
    that fails there (a read-only store, a folder busy on another host's mount) raised its OSError on rank 0 alone,
    before the ranks' agreement on the adoption: the others went on into it and learnt of the failure only through
    the CLI's top level. Now the removal runs inside that agreement (`together`, recorded here: the one process of
    this test is rank 0 of 1) and fails in one line naming the folder."""
    import contextlib
    import errno

    import models.collective as collective
    import store.writer_commit as writer_commit
    from schemas.errors import UserError

    real_open, armed = EncodeJob.open_writer, []

    def other_process_finishes_first(self, schema, shard_size_mb):
        if not armed:
            armed.append(1)
            encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)  # v1, complete
        return real_open(self, schema, shard_size_mb)

    def rename(src, dst):
        raise OSError(errno.EBUSY, "Device or resource busy", str(src))

    agreed: list[tuple[str, BaseException | None]] = []
    real_together = collective.together

    @contextlib.contextmanager
    def together(world, what="", uneven=False):
        with real_together(world, what, uneven):
            try:
                yield
            except BaseException as e:
                agreed.append((what, e))
                raise
            agreed.append((what, None))

    monkeypatch.setattr(EncodeJob, "open_writer", other_process_finishes_first)
    monkeypatch.setattr(writer_commit.os, "rename", rename)
    monkeypatch.setattr(collective, "together", together)
    with pytest.raises(UserError) as refused:
        encode_vae.run(load_config(None, F32), edit_store, tiny_edit_model)
    line = str(refused.value)
    assert "\n" not in line and "v2: its empty version folder" in line and "pipeline store gc" in line, line
    assert agreed and agreed[-1][0] == "encode-vae: reusing table 'vae' v1" and agreed[-1][1] is refused.value
