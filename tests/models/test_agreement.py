"""The ranks' one decision on a setting each resolves for its own device (models/agreement.py), with the other
ranks' resolutions given in place of the all-gather: the widest precision every rank can run, one line naming
the ranks where a rank can run none, and the record of each rank's own."""

from __future__ import annotations

import json

import pytest

from models import collective
from models.precision import Precision, agreed_precision
from schemas import UserError


def others(monkeypatch, *ranks: dict) -> None:
    """This process is rank 0; `ranks` are what ranks 1.. resolved (the all-gather's other texts, each cut at
    `size` bytes as `collective.gather_texts` cuts them; None: whole)."""
    monkeypatch.setattr(collective, "gather_texts", lambda world, text, size: [
        t.encode()[:size].decode("utf-8", "replace") for t in [text, *(json.dumps(r) for r in ranks)][:world]])


def own(weights: str, autocast: bool = False, reason: str = "rank 0's own reason"):
    return lambda: Precision(weights, autocast, "auto", reason=reason)


def test_the_widest_precision_every_rank_can_run_is_taken_and_said(monkeypatch) -> None:
    others(monkeypatch, {"dtype": "float32 + bf16 autocast", "weights": "float32", "autocast_bf16": True,
                         "reason": "set"}, {"dtype": "bfloat16", "weights": "bfloat16", "autocast_bf16": True,
                                            "reason": "auto"})
    p = agreed_precision(own("bfloat16", True), 3, "train.dtype")
    assert (p.weights, p.autocast_bf16, p.requested) == ("float32", True, "auto")
    assert p.reason == ("all 3 ranks run float32 + bf16 autocast, the best precision every rank can run (bfloat16 "
                        "on rank(s) 0, 2 only): rank 1: set")
    assert [(r["rank"], r["dtype"]) for r in p.ranks] == [(0, "bfloat16"), (1, "float32 + bf16 autocast"),
                                                        (2, "bfloat16")]
    assert p.describe("train", "cuda:0").endswith(f"(auto), bf16 autocast; {p.reason}")


def test_ranks_that_agree_keep_their_precision_and_their_line(monkeypatch) -> None:
    others(monkeypatch, {"dtype": "float32", "weights": "float32", "autocast_bf16": False, "reason": "theirs"})
    p = agreed_precision(own("float32"), 2, "evaluate.dtype")
    assert (p.weights, p.reason) == ("float32", "rank 0's own reason; the same on all 2 ranks")
    assert p.describe("evaluate", "cpu") == "evaluate: float32 on cpu (auto)"  # no agreement worth a line


def test_a_rank_that_can_run_no_precision_stops_every_rank_with_one_line_naming_it(monkeypatch) -> None:
    others(monkeypatch, {"error": "train.dtype bfloat16: cuda:1 has no bf16 support; use float32 or auto"},
           {"dtype": "bfloat16", "weights": "bfloat16", "autocast_bf16": True, "reason": "set"})
    with pytest.raises(UserError) as e:
        agreed_precision(own("bfloat16", True), 3, "train.dtype")
    assert str(e.value) == "train.dtype bfloat16: cuda:1 has no bf16 support; use float32 or auto (on rank(s) 1 of 3)"


def test_this_rank_failing_takes_part_in_the_agreement_before_it_raises(monkeypatch) -> None:
    others(monkeypatch, {"dtype": "float32", "weights": "float32", "autocast_bf16": False, "reason": "theirs"})

    def fails():
        raise UserError("evaluate.device: 'cuda:3' requested but this machine has 2 CUDA device(s)")

    with pytest.raises(UserError, match=r"2 CUDA device\(s\) \(on rank\(s\) 0 of 2\)$"):
        agreed_precision(fails, 2, "evaluate.dtype")


def test_a_long_reason_reaches_every_rank_whole(monkeypatch) -> None:
    """A rank's error or reason of any length (a path on a deep filesystem, a library's several lines) is gathered
    whole: before, agree_on cut it at 600 characters silently, and a longer rank's JSON cut at the fixed buffer
    size was no JSON at all (a traceback on every rank)."""
    deep = "/" + "/".join(f"folder-{i:03d}" for i in range(300)) + "/model.safetensors"  # ~3,300 characters
    others(monkeypatch, {"error": f"evaluate.dtype bfloat16: cannot read {deep}"})
    with pytest.raises(UserError) as e:
        agreed_precision(own("bfloat16"), 2, "evaluate.dtype")
    assert str(e.value) == f"evaluate.dtype bfloat16: cannot read {deep} (on rank(s) 1 of 2)"

    def fails():
        raise UserError(f"evaluate.device: no such device file {deep[:1000]}")

    others(monkeypatch, {"dtype": "float32", "weights": "float32", "autocast_bf16": False, "reason": "theirs"})
    with pytest.raises(UserError) as e:
        agreed_precision(fails, 2, "evaluate.dtype")
    assert str(e.value) == f"evaluate.device: no such device file {deep[:1000]} (on rank(s) 0 of 2)"
    others(monkeypatch, {"dtype": "float32", "weights": "float32", "autocast_bf16": False, "reason": deep})
    p = agreed_precision(own("bfloat16", reason=deep), 2, "evaluate.dtype")
    assert p.reason.endswith(f"rank 1: {deep}") and [r["reason"] for r in p.ranks] == [deep, deep]


def test_one_process_resolves_as_before_without_any_collective(monkeypatch) -> None:
    monkeypatch.setattr(collective, "gather_texts", None)  # not called
    assert agreed_precision(own("bfloat16"), 1, "encode_vae.dtype").ranks is None
