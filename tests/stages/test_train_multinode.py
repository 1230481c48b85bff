"""Two "nodes" on this machine (`torchrun --nnodes 2 --node-rank 0|1`, a static rendezvous on 127.0.0.1, gloo):
the launch helpers the multi-node tests share (tests/stages/test_remote_multinode.py trains on 2 nodes from a store
URL and compares with one process; test_encode_multinode.py kills a node of an encoder), and what torchrun sets
on a second node."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch_ports import Logged, start_host_first
from warm_start import PER_LAUNCH, WarmProcess

REPO = Path(__file__).resolve().parents[2]


def start_nodes(cli_args: list[str], node_env: tuple[dict, dict] = ({}, {}),
                node_args: tuple[list[str], list[str]] = ([], [])) -> list[Logged | WarmProcess]:
    """`torchrun --nnodes 2 --node-rank K --nproc-per-node 1 -m pipeline.cli ARGS` for K = 0, 1: two "nodes" on
    this machine, a static rendezvous hosted by node 0 on 127.0.0.1 (a free port: node 1 starts once node 0
    listens there, tests/launch_ports.py). Each in its own session, so a test can kill a whole node (its torchrun
    agent and worker). `node_env` / `node_args`: each node's own environment and extra arguments (e.g. its
    --cache-dir). Their output goes to files: `communicate()` returns it.
    The agents start warm (tests/warm_start.py: torch imported already, ~2 s of CPU less each), and so do their
    workers (~5-9 s each), where the nodes' environments add only per-launch variables: another variable would take
    a warm parent of its own, which costs more than the agents' imports."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    warm = all(name in PER_LAUNCH for extra in node_env for name in extra)

    def start(node: int, port: int) -> Logged | WarmProcess:
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "pipeline.cli", *cli_args, *node_args[node]]
        if warm:
            return WarmProcess(args, env={**env, **node_env[node]}, start_new_session=True)
        return Logged(args, env={**env, **node_env[node]}, start_new_session=True)

    return start_host_first(start, 2)


def nodes_ended(cli_args: list[str], node_env: tuple[dict, dict] = ({}, {}),
                node_args: tuple[list[str], list[str]] = ([], [])) -> list[tuple[int, str]]:
    """`start_nodes`, then each node's (exit status, stderr) once both ended. A node left waiting for the other
    hangs: the bound fails the test (generous under load, no timing assert); both nodes are killed either way."""
    nodes = start_nodes(cli_args, node_env, node_args)
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            kill_node(node)
    return [(node.returncode, err) for node, (_, err) in zip(nodes, outputs)]


def kill_node(node: Logged | WarmProcess) -> None:
    """SIGKILL a whole "node": its torchrun agent's process group and its workers, which torchrun starts in
    sessions of their own (a worker left alive would hold the node's output pipes open). A warm agent's workers are
    the warm parent's children, not the agent's: that parent kills them once their agent is gone
    (tests/warm_parent.py)."""
    import signal

    import psutil

    try:
        workers = psutil.Process(node.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for w in workers:
        try:
            w.kill()
        except psutil.NoSuchProcess:
            pass


def test_node_one_of_two_picks_its_device_by_local_rank(monkeypatch):
    """What torchrun sets on the second node of 2 x 1 (and 2 x 2): devices come from LOCAL_RANK, the launch size
    and the data split from WORLD_SIZE / RANK."""
    from models.precision import device_for_rank
    from stages.encode.common import Ranks, rank_device
    from stages.train.launch import launched_world_size

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert launched_world_size() == 2
    assert device_for_rank("cuda") == "cuda:0" and device_for_rank(["cuda:0"]) == "cuda:0"  # not cuda:1 (absent)
    assert rank_device("cuda", Ranks(rank=1, world_size=2, local_rank=0)) == "cuda:0"
    assert rank_device(["cuda:0", "cuda:1"], Ranks(rank=3, world_size=4, local_rank=1)) == "cuda:1"  # 2 x 2
