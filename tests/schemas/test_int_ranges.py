"""Every integer setting has a finite range, refused at config load in one line naming the key, value and range."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, get_args, get_origin

import numpy as np
import pytest
import torch
from pydantic import BaseModel
from typer.testing import CliRunner

from diffusers.loaders.peft import PeftAdapterMixin

from models.lora import add_lora
from pipeline.cli import app
from pipeline.config import ConfigError, load_config
from schemas.config import LoraConfig, PipelineConfig
from schemas.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _int_settings(model: type[BaseModel], prefix: str = ""):
    """(dotted key, field) of every field holding an int (alone, optional or in a list), sections walked."""
    for name, field in model.model_fields.items():
        kinds = [a for a in [field.annotation, *get_args(field.annotation)] if a is not type(None)]
        section = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if section is not None:
            yield from _int_settings(section, f"{prefix}{name}.")
        elif int in kinds or any(get_origin(k) is Annotated and get_args(k)[0] is int for k in kinds) \
                or any(get_origin(k) is list and int in (get_args(get_args(k)[0]) or get_args(k)) for k in kinds):
            yield prefix + name, field


def _ranges(annotation) -> list:
    """The IntRange validators anywhere in an annotation (an optional or list item's included)."""
    from schemas.config import IntRange  # (imported here: the collection of the other tests does not need it)

    found = [getattr(m, "func", None) for m in getattr(annotation, "__metadata__", ())]
    return [f for f in found if isinstance(f, IntRange)] + [r for a in get_args(annotation) for r in _ranges(a)]


def test_every_integer_setting_has_a_finite_range():
    keys = dict(_int_settings(PipelineConfig))
    assert {"train.batch_size", "train.lora.rank", "evaluate.noise_seeds", "train.validate_every"} <= set(keys)
    unbounded = [k for k, f in keys.items() if not _ranges(Annotated[f.annotation, *f.metadata])]
    assert not unbounded, f"integer settings without an IntRange family (schemas/config.py): {unbounded}"


def test_the_json_schema_shows_each_integer_setting_s_range():
    # what a user's editor validates a config against: the ranges, as the bounds before them were shown
    defs = PipelineConfig.model_json_schema()["$defs"]
    assert {k: defs["LoraConfig"]["properties"]["rank"].get(k) for k in ("minimum", "maximum")} == \
        {"minimum": 1, "maximum": 1 << 16}
    tokens = defs["TrainConfig"]["properties"]["max_tokens_per_batch"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 1 << 40} in tokens and {"type": "null"} in tokens
    seeds = defs["EvaluateConfig"]["properties"]["noise_seeds"]["items"]
    assert (seeds["minimum"], seeds["maximum"]) == (-(1 << 63), (1 << 63) - 1)


@pytest.mark.parametrize("key, value, bounds", [
    ("train.batch_size", 10**20, "1 .. 65536"),  # an OverflowError in the sampler after setup
    ("evaluate.batch_size", 1 << 17, "1 .. 65536"),
    ("train.grad_accum", 1.0e+23, "1 .. 65536"),  # a step that never ended (YAML 1.0e+23 reads as a float)
    ("train.grad_accum", 10**23, "1 .. 65536"),
    ("train.lora.rank", 10**12, "1 .. 65536"),  # failed allocating the adapter
    ("train.max_steps", 10**19, "1 .. 1000000000"),
    ("train.warmup_steps", -1, "0 .. 1000000000"),
    ("train.validate_every", 10**10, "1 .. 1000000000"),
    ("predict.steps", 10**6, "1 .. 10000"),
])
def test_an_integer_outside_its_range_is_refused_naming_key_value_and_range(key, value, bounds):
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: value})
    line = next(ln for ln in str(e.value).splitlines() if key in ln)
    assert bounds in line and repr(value) in line


def test_an_out_of_range_integer_from_the_command_line_is_one_line_and_exit_2():
    r = CliRunner().invoke(app, ["config", "show", "--set", "train.grad_accum=1.0e+23"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "'train.grad_accum': should be 1 .. 65536" in r.output and "1e+23" in r.output


def test_the_bounds_and_every_shipped_config_load():
    cfg = load_config(None, {"train.batch_size": 1 << 16, "train.grad_accum": 1 << 16, "train.lora.rank": 1 << 16,
                             "train.max_steps": 10**9, "train.warmup_steps": 0, "evaluate.num_samples": 0})
    assert (cfg.train.batch_size, cfg.train.max_steps) == (1 << 16, 10**9)
    shipped = sorted((REPO / "configs").glob("*.yaml"))
    assert shipped
    for path in shipped:
        load_config(path)


class _Block(torch.nn.Module, PeftAdapterMixin):
    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)


def test_a_rank_above_the_smallest_adapted_width_is_refused_before_the_adapter_is_built():
    lora = LoraConfig(rank=9, target_modules=["to_q", "to_out"])
    with pytest.raises(UserError, match=r"train.lora.rank 9 is above the width of the adapted layer to_out \(8,.*"
                                        r"at most 8"):
        add_lora(_Block(), lora)
    for rank, targets in ((8, ["to_q", "to_out"]), (32, ["to_q"])):  # at the width; to_out not adapted
        block = _Block()
        add_lora(block, LoraConfig(rank=rank, target_modules=targets))
        assert block.to_q.lora_A["default"].weight.shape == (rank, 32)


def test_a_lokr_rank_above_the_width_builds_its_full_kronecker_factor():
    # peft's LoKr takes a rank at or above half its second factor's larger side as "that factor whole" (LyCORIS's
    # full-matrix idiom: a rank of 10000): no low-rank pair is allocated, so the width cap does not apply
    block = _Block()
    add_lora(block, LoraConfig(kind="lokr", rank=64, target_modules=["to_q", "to_out"]))
    assert block.to_out.lokr_w2["default"].shape == (4, 8)  # the factor whole, no lokr_w2_a / _b pair


@pytest.mark.parametrize("key", ["evaluate.noise_seeds", "train.validate_noise_seeds"])
def test_a_noise_seed_past_int64_is_refused_as_the_losses_file_stores_int64(key):
    # 2**63 is inside torch's generator range, but the losses file's seed column is int64 (store/loss_array.py):
    # it stopped the first validation (or evaluate's losses) with an OverflowError
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: [0, 1 << 63]})
    assert "int64" in str(e.value) and str(1 << 63) in str(e.value)
    cfg = load_config(None, {key: [-(1 << 63), (1 << 63) - 1]})
    seeds = cfg.evaluate.noise_seeds if key.startswith("evaluate") else cfg.train.validate_noise_seeds
    assert np.asarray(seeds, dtype="int64").tolist() == [-(1 << 63), (1 << 63) - 1]
