"""`over_ranks` on three ranks without a process group: each rank's integer vector summed as the all-reduce would
(models.collective.all_sum), so the gather of damaged names is checked where it is bounded (the first
NAMED_PER_RANK of each rank, and the count of all). The real collective runs in test_encode_launched_summary.py."""

from __future__ import annotations

from stages.encode import summary as summary_module
from stages.encode.summary import NAMED_PER_RANK, Summary, over_ranks


def _rank(rank: int, damaged: int) -> Summary:
    return Summary("encode-vae", "vae", version=1, encoded=10 + rank, quarantined=damaged, bytes_written=1000,
                   seconds=20.0 + rank, loop_seconds=[4.0, 8.0, 5.0][rank], forward_seconds=[3.0, 6.0, 4.0][rank],
                   forwards=5, forward_items=10 + rank, rank=rank, world_size=3, damaged={f"r{rank}-{i:02d}": f"crc of r{rank}-{i:02d}"
                                                      for i in range(damaged)})


def test_three_ranks_sum_their_counts_and_name_each_ranks_first_damaged(monkeypatch) -> None:
    import models.collective

    ranks = [_rank(0, 12), _rank(1, 0), _rank(2, 3)]
    sent, times = [], []
    monkeypatch.setattr(models.collective, "all_sum", lambda world, values: sent.append(values) or values)
    monkeypatch.setattr(models.collective, "all_max", lambda world, values: times.append(values) or values)
    for s in ranks:
        over_ranks(s, 3)
    total = [sum(column) for column in zip(*sent)]
    slowest = [max(column) for column in zip(*times)]
    monkeypatch.setattr(models.collective, "all_sum", lambda world, values: total)
    monkeypatch.setattr(models.collective, "all_max", lambda world, values: slowest)
    summed = [over_ranks(s, 3) for s in ranks]

    # every rank holds the same summary (each keeps its own `rank`, which neither the line nor the record shows)
    assert all((str(s), s.to_json()) == (str(summed[0]), summed[0].to_json()) for s in summed)
    one = summed[0]
    assert (one.encoded, one.quarantined, one.bytes_written, one.damaged_count) == (33, 15, 3000, 15)
    # the ranks ran side by side: the times are the slowest rank's, the rate every rank's samples over that time
    # (33 / 8 s, not rank 0's 4 s), the mean batch every rank's items over every rank's forwards
    assert (one.seconds, one.loop_seconds, one.forward_seconds) == (22.0, 8.0, 6.0)
    assert (one.forwards, one.forward_items) == (15, 33)
    assert "3 KiB written in 22.0 s (encoding 4.1 samples/s)" in str(one)
    named = sorted(one.damaged)
    assert named == [f"r0-{i:02d}" for i in range(NAMED_PER_RANK)] + ["r2-00", "r2-01", "r2-02"]
    assert one.damaged["r2-01"] == "crc of r2-01"
    line = str(one)
    assert line.startswith("encode-vae [3 ranks]: table 'vae' v1: encoded 33, ") and "[rank" not in line
    assert "skipped 15 damaged input sample(s)" in line and line.endswith(" …")  # 13 named of 15
    record = one.to_json()
    assert "rank" not in record and record["damaged_input_count"] == 15 and len(record["damaged_inputs"]) == 13
    assert summary_module.over_ranks(ranks[0], 1) is ranks[0]  # one process: as it is
