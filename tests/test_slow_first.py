"""xdist's own loadfile scheduler, driven in-process over a made-up collection, hands the files out longest first
(tests/slow_first.py) - not re-sorted by their number of tests, as it does unless told not to."""

from __future__ import annotations

from types import SimpleNamespace

from xdist.scheduler import LoadFileScheduling

import slow_first


class _Worker:
    """What the scheduler calls on a worker: the test indices sent to it, in order."""

    shutting_down = False

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def test_xdist_hands_out_the_longest_files_first_whatever_their_number_of_tests() -> None:
    longest, second = slow_first.SLOW_FILES_FIRST[:2]
    collected = [f"tests/test_many.py::t{i}" for i in range(6)] + [f"{second}::t{i}" for i in range(3)] + \
                [f"{longest}::t0", "tests/test_few.py::t0"]
    items = [SimpleNamespace(nodeid=n) for n in collected]
    slow_first.pytest_collection_modifyitems(None, None, items)
    order = [i.nodeid for i in items]
    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True), getvalue={"tx": ["1*popen"]}.get)
    slow_first.pytest_configure(config)
    sched, worker = LoadFileScheduling(config), _Worker()
    sched.add_node(worker)
    sched.add_node_collection(worker, order)
    sched.schedule()
    done = 0
    while done < len(worker.sent):  # each test run in the order sent; the scheduler sends more as they finish
        sched.mark_test_complete(worker, worker.sent[done])
        done += 1
    files = list(dict.fromkeys(order[i].split("::")[0] for i in worker.sent))
    assert files == [longest, second, "tests/test_many.py", "tests/test_few.py"]
