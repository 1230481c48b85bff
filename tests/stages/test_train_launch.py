"""Which device a launched train process uses: N launched processes without GPUs are N gloo ranks on the CPU
(the 2-process CLI run itself is tests/stages/test_train_ddp.py). With several ranks the ranks decide it together
through the launcher's store (tests/models/test_launch_devices.py); a launch that names no store (no
MASTER_ADDR / MASTER_PORT, where no env:// process group can form either) decides on this rank's view."""

from __future__ import annotations


def test_multi_process_launch_without_gpu_trains_on_the_cpu(monkeypatch):
    import torch

    from stages.train.launch import launched_world_size, use_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert launched_world_size() == 1 and use_cpu(None) is False  # a plain run: accelerate's own choice
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_world_size() == 2 and use_cpu(None) is True  # N ranks over gloo, not N separate runs
    assert use_cpu("cuda") is False and use_cpu("cpu") is True  # an explicit train.device decides
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert use_cpu(None) is False  # GPUs present: NCCL as before
