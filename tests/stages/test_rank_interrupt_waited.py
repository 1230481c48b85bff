"""A Ctrl-C that stops one launched rank outside `fails_alone` / `together` while another waits for it (at an
arrival: rank 0's checkpoint write, an encoder's share ending late; tests/stages/rank_interrupt_waited.py, two gloo
processes through the CLI's entry point): the CLI's top level publishes it (pipeline/cli.py `_publish_interrupt`),
so the waiting rank stops at once with the line naming the stop, and the interrupted rank still stops as a Ctrl-C
stops it (130, its own line). Before: nothing was published; the waiting rank named the stopped rank as killed
after LOST_SECONDS (rank 1 interrupted) or met its store gone (rank 0, which serves it, interrupted)."""

from __future__ import annotations

import pytest

from two_ranks import launch_two


@pytest.mark.parametrize("interrupted", [1, 0])  # rank 0 also serves the launch's store
def test_a_ctrl_c_on_a_rank_another_waits_for_stops_the_waiting_rank_with_its_line(interrupted) -> None:
    outs = launch_two("rank_interrupt_waited.py", str(1 - interrupted), timeout=300)
    (rc_i, out_i, err_i), (rc_w, out_w, err_w) = outs[interrupted], outs[1 - interrupted]
    assert "Traceback" not in err_w + out_w + err_i + out_i, (err_w[-3000:], err_i[-3000:])
    assert rc_i == 130 and rc_w == 1, (rc_i, rc_w, err_i[-2000:], err_w[-2000:])
    errors = [line for line in err_w.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: rank {interrupted} was stopped by SIGINT (Ctrl-C): what the ranks committed is kept "
                      "(a run's checkpoints); rerun the same command to continue (`run train`: with --resume)"], err_w
    assert err_i.strip().splitlines()[-1] == "stopped by SIGINT (Ctrl-C)", err_i[-2000:]  # its own line, unchanged
