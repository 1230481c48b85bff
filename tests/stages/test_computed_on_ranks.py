"""`loss_groups.on_every_rank` over two ranks: a rank's device and libraries are gathered whole, however long
their JSON (many libraries, long device names or versions). Before: each rank's text was cut at 4096 bytes, and
a longer one stopped every rank with a JSONDecodeError traceback (the cut JSON) in the middle of an evaluation."""

from __future__ import annotations

import json

from two_ranks import launch_two, results

LIBRARIES = 120  # rank 1's JSON: ~20 KB


def test_every_ranks_machine_is_gathered_whole_however_long() -> None:
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("computed_on_ranks.py", str(LIBRARIES))
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    gathered = [json.loads(results(out)["machines"]) for out in (out0, out1)]
    assert gathered[0] == gathered[1]
    first, second = gathered[0]
    assert first == {"device": ["cpu", [""]], "libraries": {"torch": "2.5.1"}}
    assert len(json.dumps(second)) > 4 * 4096 and len(second["libraries"]) == LIBRARIES
    assert second["libraries"][f"library_{LIBRARIES - 1:03d}"] == f"{LIBRARIES - 1}.0.0+é{'x' * 150}"
