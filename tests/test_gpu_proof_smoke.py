"""bench/gpu/proof.py --smoke: every stage on the CPU with tiny dimensions, so a broken script never burns GPU
minutes. Checks the JSON the GPU run will be read from: its fields, the correctness errors within tolerance,
padded positions exactly 0, the same LoRA with and without offload / prefetch, the run record of the
attention choice."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import warm_start

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("gpu-proof")
    out = work / "proof.json"
    # a fresh process, as on the GPU machine (the stages set global torch state), started warm
    # (tests/warm_start.py: torch and diffusers imported already, the project's modules by the process itself)
    proc = warm_start.run([sys.executable, str(REPO / "bench" / "gpu" / "proof.py"), "--stage", "all", "--smoke",
                           "--out", str(out), "--work", str(work / "scratch"), "--budget-s", "600"],
                          cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), work


def test_env_and_every_stage_complete(smoke):
    data, _ = smoke
    assert data["env"]["smoke"] is True and data["env"]["torch"]
    assert data["env"]["default_attention"]["backend"] == "native"
    assert set(data["stages"]) == {"correctness", "train", "encode"}
    assert all(s["complete"] for s in data["stages"].values())


def test_correctness_errors_within_tolerance(smoke):
    data, _ = smoke
    eq = data["stages"]["correctness"]["equivalence"]
    for precision in ("float32", "bfloat16"):
        ran = {k: v for k, v in eq[precision].items() if isinstance(v, dict) and v.get("ran")}
        assert {"native", "_native_math", "packed"} <= set(ran)
        for name, r in ran.items():
            assert r["ok"], (precision, name, r)
            assert r["padded_out_exact_zero"] and r["padded_grad_image_exact_zero"] and r["padded_grad_text_exact_zero"]
            assert not r["missing_weight_grads"]
            for key, tol in eq[precision]["tolerance"].items():
                assert 0 <= r[key] <= tol, (precision, name, key)
        # a backend that cannot run here is recorded with its error, not dropped
        assert all("error" in v or "skipped" in v for v in eq[precision].values()
                   if isinstance(v, dict) and v.get("ran") is False)
    assert eq["float32"]["native"]["forward"] < 1e-5
    same = data["stages"]["correctness"]["same_lora"]
    for name in ("offload", "prefetch"):
        assert same[name]["ran"] and same[name]["bit_identical"] and same[name]["ok"], same[name]
    assert same["run_to_run_noise"] == 0.0  # the CPU kernels are deterministic
    q = data["stages"]["correctness"]["quantized"]
    for kind in ("int8", "fp8"):
        assert q[kind]["ran"] and q[kind]["lora_grads_finite"] and q[kind]["rel_loss_deviation"] < 0.05
    lin = data["stages"]["correctness"]["quantized_linear"]
    for shape in ("32x128", "128x32"):  # (in, out); every chunk size timed
        for kind in ("int8", "fp8"):
            per = lin[shape][kind]
            assert list(per) == [str(1 << 21), str(1 << 23), str(1 << 25), "whole"], per
            assert all(v["ms"] > 0 and v["x_bfloat16"] > 0 for v in per.values())
        assert lin[shape]["bfloat16_ms"] > 0


def test_train_fields(smoke):
    data, _ = smoke
    configs = data["stages"]["train"]["configs"]
    assert {"bf16-packed", "bf16-native", "bf16-anchors", "int8-offload-24g"} <= set(configs)
    for name, r in configs.items():
        assert "error" not in r, (name, r)
        for key in ("s_per_step", "samples_per_s", "target_tokens_per_s", "data_share", "mfu_vs_measured_matmul",
                    "plan_bytes", "attention_backend", "steps", "alloc_retries"):
            assert key in r, (name, key)
        assert r["steps"] == r["batches_per_epoch"] and 0 <= r["data_share"] < 1
        assert len(r["rows"]) == r["steps"] and all(row["seconds"] > 0 and row["lengths"] for row in r["rows"])
        real = sum(sum(row["lengths"]) for row in r["rows"])
        assert r["padding_share"] == pytest.approx(sum(row["padded_tokens"] for row in r["rows"]) / real)
    assert configs["bf16-anchors"]["batches_per_epoch"] >= configs["bf16-packed"]["batches_per_epoch"]
    assert configs["bf16-packed"]["attention_backend"] == "packed"
    assert configs["bf16-anchors"]["padding_share"] <= configs["bf16-packed"]["padding_share"]
    assert configs["bf16-packed"]["padding_share"] > 1  # mixed sizes at batch 4 pad
    # partial checkpointing (the smoke's 2 blocks: the first kept, the second checkpointed) trains as full does
    partial, full = configs["bf16-packed-b1-partial"], configs["bf16-packed-b1"]
    assert data["stages"]["train"]["layers"] == 2 and partial["config"]["uncheckpointed"] == 1
    assert partial["losses"] == full["losses"] and partial["plan_bytes"] > full["plan_bytes"]


def test_each_configuration_reports_its_wall_time_and_offload_what_it_held(smoke):
    """A lease holds one 600 s call: the next call's order is planned from what each configuration cost with its
    model's build (the 2026-12-04 call had only the stage's total), and the summary - the reply's tail - says
    whether offload held one block at a time (the JSON said it; the tail did not)."""
    sys.path.insert(0, str(REPO))
    from bench.gpu.proof import summary

    data, _ = smoke
    train = data["stages"]["train"]
    for name, r in train["configs"].items():
        assert r["wall_seconds"] >= sum(row["seconds"] for row in r["rows"]), name
    lines = {line.split()[0]: line for line in summary("train", train).splitlines()[1:]}
    assert set(lines) == set(train["configs"]) and all(", wall " in line for line in lines.values())
    offload = train["configs"]["int8-offload-24g"]
    assert offload["offload_most_live_blocks"] == 1
    assert ", live blocks at most 1, onloads waited for " in lines["int8-offload-24g"]
    assert "live blocks" not in lines["bf16-packed"]
    cut = {"cut": {"partial": True, "steps": 0, "rows": [], "plan_bytes": 2**30, "wall_seconds": 70.0},
           "warm": {"partial": False, "steps": 0, "rows": [], "plan_bytes": 2**30, "wall_seconds": 9.0}}
    text = summary("train", {"configs": cut})
    assert "cut                    no timed step, the deadline came first (plan 1.0 GiB, wall 70 s)" in text
    assert "warm                   no timed step, every batch was a warm-up one (plan 1.0 GiB, wall 9 s)" in text


def test_encode_fields(smoke):
    data, _ = smoke
    enc = data["stages"]["encode"]
    for name in ("encode_text", "encode_vae", "encode_text_padded"):  # steady state: second passes compared
        assert enc[name]["samples_per_s"] > 0 and enc[name]["x_stock"] > 0 and enc[name]["encoded"] == enc["samples"]
    for name in ("encode_text", "encode_vae"):  # the first passes, reported apart
        assert enc["first_pass"][name]["encoded"] == enc["samples"] and enc["first_pass"][name]["x_stock_first_pass"] > 0
    assert set(enc["stock_per_sample"]["first_pass"]) == {"encode_prompt_samples_per_s", "vae_samples_per_s"}


def test_a_rerun_of_one_train_config_keeps_the_others(smoke, tmp_path):
    data, work = smoke
    out = tmp_path / "proof.json"
    out.write_text(json.dumps(data))
    sys.path.insert(0, str(REPO))
    from bench.gpu.proof import main

    main(["--stage", "train", "--smoke", "--configs", "bf16-native", "--out", str(out), "--budget-s", "0"])
    again = json.loads(out.read_text())
    train = again["stages"]["train"]
    assert train["not_run_budget"] == ["bf16-native"] and train["complete"] is False  # budget 0: nothing new starts
    assert train["configs"]["bf16-packed"] == data["stages"]["train"]["configs"]["bf16-packed"]
    assert again["stages"]["correctness"] == data["stages"]["correctness"]


def test_a_rerun_of_one_correctness_part_keeps_the_others(smoke, tmp_path):
    """`--parts same_lora` after a full correctness call (bench/gpu/README.md, after the H200 session): the
    equivalence and quantized results stay in the JSON; the rerun part is replaced."""
    data, _ = smoke
    out = tmp_path / "proof.json"
    out.write_text(json.dumps(data))
    sys.path.insert(0, str(REPO))
    from bench.gpu.proof import main

    main(["--stage", "correctness", "--smoke", "--parts", "same_lora", "--out", str(out), "--budget-s", "0"])
    corr = json.loads(out.read_text())["stages"]["correctness"]
    old = data["stages"]["correctness"]
    assert corr["equivalence"] == old["equivalence"] and corr["quantized"] == old["quantized"]
    assert corr["same_lora"] != old["same_lora"] and corr["complete"] is False  # budget 0: nothing new ran


def test_the_train_run_records_its_attention_choice(smoke):
    _, work = smoke
    record = json.loads((work / "scratch" / "same-lora" / "run-plain" / "attention.json").read_text())
    assert record["backend"] == "native" and "default on cpu" in record["reason"]


class _Record(dict):
    def flush(self):
        pass


def test_absent_packages_and_bf16_only_kernels_read_as_such(monkeypatch):
    """flash-attn is not installed here (nor was it on the H200): its backends are reported as not installed,
    never run (diffusers' call would say only "'NoneType' object is not callable"); cuDNN attention in float32
    fails by design and is marked expected."""
    sys.path.insert(0, str(REPO))
    import torch

    from bench.gpu import correctness
    from bench.gpu.proof import summary

    monkeypatch.setattr(correctness, "CPU_BACKENDS", ["flash_varlen", "_flash_varlen_3", "_native_cudnn"])
    rec = _Record()
    correctness.run_equivalence(torch.device("cpu"), True, float("inf"), rec)
    fp32 = rec["equivalence"]["float32"]
    assert fp32["flash_varlen"] == {"ran": False, "skipped": "not installed (flash-attn absent)"}
    assert fp32["_flash_varlen_3"] == {"ran": False, "skipped": "not installed (flash-attn 3 absent)"}
    assert fp32["_native_cudnn"]["ran"] is False and fp32["_native_cudnn"]["expected"].startswith("no float32 kernel")
    assert "expected" not in rec["equivalence"]["bfloat16"]["_native_cudnn"]  # in bf16 a failure is a failure
    text = summary("correctness", {"equivalence": rec["equivalence"]})
    assert "flash_varlen       not installed (flash-attn absent)" in text and "NoneType" not in text
    assert "no float32 kernel (cuDNN attention takes bf16/fp16), expected" in text


def test_plan_comes_before_a_configuration_runs_and_skips_what_cannot_fit(monkeypatch):
    """A configuration whose plan exceeds its memory cap by more than 10 % is skipped with the reason; one that
    fails still records its plan and padding (on the H200, bf16-packed-nockpt ran out of memory with none)."""
    sys.path.insert(0, str(REPO))
    import torch

    from bench.gpu import fullsize

    def fails(*a, **k):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(fullsize, "run_config", fails)
    monkeypatch.setitem(fullsize.CONFIGS, "tiny-cap", fullsize.cfg(cap_gib=1e-4))
    monkeypatch.setattr(fullsize, "SMOKE_CONFIGS", ["bf16-packed", "tiny-cap"])
    rec = _Record()
    fullsize.run_train(torch.device("cpu"), True, float("inf"), rec, ["bf16-packed", "tiny-cap"], 1, 4)
    failed, skipped = rec["configs"]["bf16-packed"], rec["configs"]["tiny-cap"]
    assert failed["error"].startswith("RuntimeError") and failed["plan_bytes"] > 0 and failed["padding_share"] >= 1
    assert failed["wall_seconds"] >= 0  # a failure costs the lease its build too
    assert skipped["skipped"].startswith("plan ") and "exceeds the 0.0001 GiB cap" in skipped["skipped"]
    assert "error" not in skipped and skipped["plan_bytes"] > 1.1 * 1e-4 * 2**30
    assert fullsize.over_limit(100, fullsize.CONFIGS["bf16-packed"], 95) is None  # within 10 %: run it
    assert "card" in fullsize.over_limit(120, fullsize.CONFIGS["bf16-packed"], 100)


def test_a_quantised_linear_that_fails_keeps_its_timed_chunks_and_the_summary_says_so(monkeypatch):
    """A kind that fails at a larger chunk (out of memory at the whole weight, say) keeps the chunks timed before
    it, and the summary prints them with the failure; before, the summary raised TypeError on the failed entry."""
    sys.path.insert(0, str(REPO))
    import torch

    import models.quantize as qmod
    from bench.gpu import quantized_linear
    from bench.gpu.proof import summary

    timed = quantized_linear._time

    def ooms_from_the_second_chunk(fn, device, repeat):
        if qmod.DEQUANT_ELEMENTS == 1 << 23:
            raise RuntimeError("CUDA out of memory (simulated)")
        return timed(fn, device, repeat)

    monkeypatch.setattr(quantized_linear, "_time", ooms_from_the_second_chunk)
    rec = _Record()
    quantized_linear.run_quantized_linear(torch.device("cpu"), True, float("inf"), rec)
    int8 = rec["quantized_linear"]["32x128"]["int8"]
    assert int8["ran"] is False and "out of memory" in int8["error"] and int8[str(1 << 21)]["ms"] > 0
    text = summary("correctness", {"quantized_linear": rec["quantized_linear"]})
    assert f"linear 32x128      int8 x bf16 by chunk: {1 << 21}=" in text and "failed: RuntimeError: CUDA out" in text
