"""A rank on node 0 (the node whose torchrun agent serves the launch's store) fails alone inside training
(`fails_alone`: out of memory in its backward) while the rank on node 1 cannot read the published line at once:
its main thread holds the GIL for seconds (a long call that does not release it), so its watch thread, which
polls the store every 0.5 s, does not run. Every node still ends on the failing rank's line. Before: the failed
rank exited at once, its agent stopped and took the store with it; node 1's rank then found its peer and the
store gone and ended on its own line (gloo's "connection closed"; with NCCL it would have waited in the
gradient all-reduce until the collective timeout)."""

from __future__ import annotations

import os

from rank_hook import REPO
from schemas.config import TrainConfig
from stages.train.recipe import step_oom_advice
from test_settings_one_node import _one_line_each
from test_train_multinode import nodes_ended
from train_store import make_train_store, mixed_specs

# Rank 1 announces (a file) that it is about to hold the GIL for HOLD_SECONDS in its first backward; rank 0 waits
# for that file, then runs out of memory in its own first backward, so it publishes while rank 1 holds the GIL.
# HOLD_SECONDS: longer than the failed node's exit took here (2-4 s), shorter than the bound a rank waits for
# every rank to read the line (models/collective/timing.py HOST_WAIT_SECONDS, 10 s).
HOOK = """
import os, sys, time
rank, marker = os.environ.get('RANK'), HOLDING_MARKER
if rank in ('0', '1'):
    import torch
    real = torch.Tensor.backward
    def backward(self, *a, **k):
        if rank == '0':
            while not os.path.exists(marker):
                time.sleep(0.01)
            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (test)')
        if not os.path.exists(marker):
            open(marker, 'w').close()
            sys.setswitchinterval(30)  # no other thread of this process runs until the loop ends
            end = time.monotonic() + 6
            while time.monotonic() < end:
                pass
            sys.setswitchinterval(0.005)
        return real(self, *a, **k)
    torch.Tensor.backward = backward
"""


def test_a_rank_failing_alone_on_the_stores_node_ends_every_node_on_its_line(tiny_edit_model, tmp_path):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    hook = tmp_path / "hook"
    hook.mkdir()
    # the marker's path in the hook's text, not a variable: an environment of per-launch variables alone starts the
    # nodes warm (test_train_multinode.start_nodes)
    (hook / "sitecustomize.py").write_text(HOOK.replace("HOLDING_MARKER", repr(str(tmp_path / "holding"))))
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(REPO)])}
    ended = nodes_ended(["run", "train", "--store", str(store), "--model", tiny_edit_model, "--out",
                         str(tmp_path / "run"), "--device", "cpu", "--max-steps", "2", "--batch-size", "2",
                         "--set", "train.lora.rank=4"], (env, env))
    _one_line_each(ended,
                   "error: rank 0 ran out of memory in optimizer step 1 (CUDA out of memory. Tried to allocate 2.00 "
                   f"GiB (test)): {step_oom_advice(TrainConfig())}")
    assert not (tmp_path / "run" / "lora").exists()
