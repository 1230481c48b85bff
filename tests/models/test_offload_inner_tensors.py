"""Offload records the compute stream on the plain tensors a weight is made of: torchao's quantised weights are
wrapper subclasses without record_stream (NotImplementedError on the H200), their inner tensors have it."""

from __future__ import annotations

import torch

from models.offload import _plain_tensors
from models.quantize import quantize_rows


def test_a_quantised_weight_is_recorded_through_its_inner_plain_tensors():
    w = quantize_rows(torch.randn(64, 32, dtype=torch.bfloat16), "int8")
    inner = list(_plain_tensors(w))
    assert type(w) is not torch.Tensor and inner
    assert all(type(t) is torch.Tensor for t in inner)
    assert any(t.dtype == torch.int8 and t.shape == (64, 32) for t in inner)  # the quantised values themselves


def test_a_plain_weight_is_itself():
    w = torch.randn(4, 4)
    assert [t is w for t in _plain_tensors(w)] == [True]
