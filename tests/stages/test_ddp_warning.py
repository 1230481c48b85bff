"""The DDP wrapper raises no deprecation warning (torch >= 2.13 warns on `broadcast_buffers`, once per rank)."""

from __future__ import annotations

import socket
import warnings

import torch
import torch.distributed as dist

from stages.train.parallel import wrap


def test_wrap_gives_no_future_warning():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        model[1].requires_grad_(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = wrap(model, 2)
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
        wrapped(torch.randn(3, 4)).sum().backward()
        assert model[0].weight.grad is not None
    finally:
        dist.destroy_process_group()
