"""Device-aware defaults: `dtype: auto` is float32 on the CPU and bf16 on a bf16-capable CUDA device (mocked
here: no GPU on this machine); per-rank device lists and cuda = cuda:LOCAL_RANK; every stage resolves them."""

from __future__ import annotations

import pytest
import torch

from models import precision
from models.precision import device_for_rank, resolve_dtype
from pipeline.config import load_config
from schemas import UserError


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two CUDA devices of a given compute capability, without a GPU."""
    def install(capability=(9, 0), count=2):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: capability[0] >= 8)
        chosen = []
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
        return chosen
    return install


def test_every_stage_defaults_to_auto_and_auto_is_float32_on_cpu():
    cfg = load_config(None)
    for section in (cfg.encode_text, cfg.encode_vae, cfg.train, cfg.evaluate, cfg.predict):
        assert section.dtype == "auto"
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16  # explicit settings are kept


def test_auto_is_bf16_on_a_bf16_gpu_and_float32_on_an_older_one(fake_gpus):
    fake_gpus((9, 0))
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32
    fake_gpus((7, 5))  # Turing: no native bf16
    assert resolve_dtype("auto", "cuda:0") == torch.float32


def test_stage_sections_resolve_and_record_a_concrete_dtype(fake_gpus):
    from stages.encode.common import config_hash, resolve_precision
    from stages.evaluate.settings import resolved_config
    from stages.train.settings import resolve_precision as train_precision

    cfg = load_config(None)
    cpu_vae = resolve_precision(cfg.encode_vae, "cpu", "encode-vae")
    assert cpu_vae.dtype == "float32"
    # auto on the CPU is the same lineage as an explicit float32 (existing tables stay current)
    explicit = resolve_precision(load_config(None, {"encode_vae.dtype": "float32"}).encode_vae, "cpu", "encode-vae")
    assert config_hash(cpu_vae) == config_hash(explicit)
    tc = train_precision(cfg.train, torch.device("cpu"))
    assert (tc.dtype, tc.mixed_precision) == ("float32", "no")
    assert resolved_config(cfg.evaluate, "tiny-model").dtype == "float32"

    fake_gpus((8, 0))
    assert resolve_precision(cfg.encode_text, "cuda:0", "encode-text").dtype == "bfloat16"
    tc = train_precision(cfg.train, torch.device("cuda:0"))
    assert (tc.dtype, tc.mixed_precision) == ("bfloat16", "bf16")  # a bf16 base computes under bf16 autocast
    cuda = cfg.evaluate.model_copy(update={"device": "cuda:1", "attention_backend": "native"})  # no packed probe here
    assert resolved_config(cuda, "tiny-model").dtype == "bfloat16"
    assert train_precision(cfg.train.model_copy(update={"dtype": "float32"}), torch.device("cuda:0")).dtype == "float32"


def test_device_lists_and_local_rank(fake_gpus, monkeypatch):
    assert device_for_rank(["cuda:0", "cuda:1"], 1, 2) == "cuda:1"
    assert device_for_rank("cuda", 1, 2) == "cuda:1"
    assert device_for_rank("cuda", 0, 1) == "cuda"
    assert device_for_rank("cuda:1", 0, 2) == "cuda:1"
    with pytest.raises(UserError, match="one device per process"):
        device_for_rank(["cuda:0"], 1, 2, "encode_vae.device")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert device_for_rank(["cpu", "cuda:1"]) == "cuda:1"

    from stages.encode.common import Ranks, rank_device
    from stages.train.settings import train_device

    assert rank_device(["cuda:1", "cuda:0"], Ranks(1, 2, 1)) == "cuda:0"
    chosen = fake_gpus((9, 0))
    cfg = load_config(None, {"train.device": "cuda:1"}).train
    assert train_device(cfg, 0, 1) == torch.device("cuda:1") and chosen == [torch.device("cuda:1")]
    cfg = load_config(None, {"train.device": ["cuda:1", "cuda:0"]}).train
    assert train_device(cfg, 1, 2) == torch.device("cuda:0")
    with pytest.raises(UserError, match="2 CUDA device"):
        train_device(load_config(None, {"train.device": "cuda:2"}).train, 0, 1)


def test_dtype_flag_on_every_stage_command():
    from typer.testing import CliRunner

    from pipeline.cli import app

    for cmd in (["run", "encode-text"], ["run", "encode-vae"], ["run", "train"], ["run", "evaluate"], ["predict"]):
        out = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"}).output
        assert "--dtype" in out, cmd


def test_quantize_alias_reads_as_int8():
    assert load_config(None, {"train.quantize_base": "int8_weight_only"}).train.quantize_base == "int8"
    assert precision.first_device(["cuda:0", "cuda:1"]) == "cuda:0"


def test_one_resolver_train_dtype_is_the_base_and_mixed_precision_the_autocast(fake_gpus):
    """models.precision.resolve_precision: what loads (and is recorded) and whether bf16 autocast runs."""
    from models.precision import Precision, resolve_precision

    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == Precision("float32", requested="auto")  # encode / evaluate / predict
    assert resolve_precision("float32", cpu, "bf16") == Precision("float32", True, "float32")  # honoured as set
    assert resolve_precision("auto", cpu, "bf16") == Precision("bfloat16", True, "auto")
    assert resolve_precision("bfloat16", cpu, "no") == Precision("bfloat16", True, "bfloat16")  # bf16 base: autocast
    fake_gpus((7, 5))
    assert resolve_precision("auto", "cuda:0", "bf16") == Precision("float32", False, "auto")  # falls back, said
    with pytest.raises(UserError, match="train.dtype bfloat16: cuda:0 has no bf16 support"):
        resolve_precision("bfloat16", "cuda:0", "no", what="train.dtype")


def test_device_auto_is_the_default_and_resolves_to_cuda_only_with_cuda(fake_gpus, monkeypatch, capsys):
    """`auto` (encode, evaluate, predict): the GPU where CUDA is available (cuda:LOCAL_RANK under a launcher), else
    the CPU; an explicit `cpu` stays on the CPU. Mocked CUDA: only the resolved strings are checked."""
    from models.precision import first_device
    from stages.encode.common import Ranks, rank_device, resolve_precision

    cfg = load_config(None)
    specs = [cfg.encode_text.device, cfg.encode_vae.device, cfg.evaluate.device, *cfg.predict.devices.values()]
    assert specs == ["auto"] * 6
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [device_for_rank(s) for s in specs] == ["cpu"] * 6 and first_device("auto") == "cpu"
    assert resolve_precision(cfg.encode_vae, rank_device("auto", Ranks()), "encode-vae").dtype == "float32"
    assert capsys.readouterr().out.strip() == "encode-vae: float32 on cpu (auto), device auto (no CUDA)"

    fake_gpus((9, 0))
    assert [device_for_rank(s) for s in specs] == ["cuda"] * 6 and first_device(["auto"]) == "cuda"
    assert rank_device("auto", Ranks(1, 2, 1)) == "cuda:1"  # under a launcher: this rank's own GPU
    assert device_for_rank("cpu") == "cpu" and device_for_rank(["cpu", "auto"], 0, 2) == "cpu"
    assert resolve_precision(cfg.encode_vae, rank_device("auto", Ranks()), "encode-vae").dtype == "bfloat16"
    assert capsys.readouterr().out.strip() == "encode-vae: bfloat16 on cuda (auto), device auto (CUDA)"
    explicit = load_config(None, {"encode_vae.device": "cpu"}).encode_vae
    assert resolve_precision(explicit, rank_device(explicit.device, Ranks()), "encode-vae").dtype == "float32"
    assert capsys.readouterr().out.strip() == "encode-vae: float32 on cpu (auto)"  # no device note: it was set


def test_device_auto_on_a_cpu_machine_keeps_the_old_default_hashes(monkeypatch):
    """The features hashes and evaluate's resolved settings of the default config, without CUDA, as computed with
    the default `cpu` before `auto` existed: stores and reports made then stay current."""
    from stages.encode.common import Ranks, config_hash, rank_device, resolve_precision
    from stages.evaluate.settings import resolved_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None)
    hashes = {stage: config_hash(resolve_precision(section, rank_device(section.device, Ranks()), stage))
              for stage, section in (("encode-text", cfg.encode_text), ("encode-vae", cfg.encode_vae))}
    assert hashes == {"encode-text": "ffa1c0861ba5171c", "encode-vae": "7065852b67a71bf0"}  # main before auto
    evaluate = resolved_config(cfg.evaluate, "tiny-model")
    assert (evaluate.device, evaluate.dtype) == ("cpu", "float32")
    from stages.evaluate.base_images import machine  # the device in evaluate's cache keys: as the old default's

    assert machine(cfg.evaluate)["device"] == machine(cfg.evaluate.model_copy(update={"device": "cpu"}))["device"]


def test_parse_dtype_looks_up_a_resolved_name_and_refuses_auto():
    """`auto` depends on the device: parsed by name alone it was float32 even for a bf16 GPU's setting."""
    from models.loading import parse_dtype

    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="auto"):
        parse_dtype("auto")
    with pytest.raises(UserError, match="unknown dtype"):
        parse_dtype("fp8")
