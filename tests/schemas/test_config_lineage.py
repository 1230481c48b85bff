"""The declared lineage scheme (schemas/lineage.py): every config field says what it changes, and every
settings hash is derived from that; the hashes of outputs made before the scheme are kept (pinned here)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from schemas import config as C
from schemas.lineage import Role, adds_columns, hashed_settings, role_of, section_fingerprint, serving_variants


def _sections(model: type[BaseModel], seen: set) -> list[type[BaseModel]]:
    """Every config model reachable from PipelineConfig (nested sections and list items)."""
    if model in seen:
        return []
    seen.add(model)
    found = [model]
    for info in model.model_fields.values():
        for t in _types(info.annotation):
            if isinstance(t, type) and issubclass(t, BaseModel):
                found += _sections(t, seen)
    return found


def _types(annotation) -> list:
    args = getattr(annotation, "__args__", ())
    return [annotation, *[t for a in args for t in _types(a)]]


def test_every_config_field_declares_its_lineage_role():
    sections = _sections(C.PipelineConfig, set())
    assert {C.TrainConfig, C.LoraConfig, C.MaskWeight, C.ExtraPrompt, C.EncodeTextConfig} <= set(sections)
    undeclared = [f"{m.__name__}.{n}" for m in sections for n in m.model_fields if role_of(m, n) is None]
    assert undeclared == []
    for m in sections:
        for n in m.model_fields:
            assert isinstance(role_of(m, n), Role) and role_of(m, n).kind in ("features", "identity", "throughput")
    # the markers add nothing to the JSON schema a user reads
    schema = json.dumps(C.PipelineConfig.model_json_schema())
    assert "Role" not in schema and "throughput" not in schema and '"identity"' not in schema


def test_where_it_runs_how_fast_and_how_many_workers_never_change_features():
    for section in (C.EncodeTextConfig(), C.EncodeVaeConfig(), C.ResizeConfig(), C.EvaluateConfig()):
        settings = hashed_settings(section, "sample")
        for name in ("device", "batch_size", "num_workers", "workers", "shard_size_mb", "max_open_shards"):
            assert name not in settings, f"{type(section).__name__}.{name}"
    for section in (C.TrainConfig(), C.PredictConfig()):
        for name in ("device", "devices", "num_workers", "prefetch", "check_ahead", "compile"):
            assert name not in hashed_settings(section)
    vae = C.EncodeVaeConfig(dtype="float32")
    assert section_fingerprint(vae) == section_fingerprint(vae.model_copy(update={"device": ["cuda:0", "cuda:1"],
                                                                                  "batch_size": 1, "num_workers": 0}))
    assert section_fingerprint(vae) != section_fingerprint(vae.model_copy(update={"dtype": "bfloat16"}))


def test_an_undeclared_field_is_refused():
    class Bare(C.Section):
        x: int = 0

    with pytest.raises(TypeError, match="Bare.x declares no lineage Role"):
        hashed_settings(Bare())


def test_a_setting_that_only_adds_columns_is_served_by_outputs_made_with_it_on():
    """Only on -> off is served (the output made with it on holds more); off -> on, or any other setting, is not."""
    from typing import Annotated

    from stages.encode.settings import config_hash, earlier_config_hashes, serving_config_hashes

    text = C.EncodeTextConfig(dtype="float32")
    on = text.model_copy(update={"no_control_embeds": True})
    assert serving_variants(text) == [on] and serving_variants(on) == []
    assert serving_config_hashes(text, a=1) == (config_hash(on, a=1),)
    # a table encoded with it on before the declared scheme (hashed with its device) serves too
    assert set(earlier_config_hashes(on, a=1)) < set(serving_config_hashes(text, earlier=True, a=1))
    assert serving_variants(C.EncodeVaeConfig()) == []

    class Two(C.Section):
        a: Annotated[bool, adds_columns()] = False
        b: Annotated[bool, adds_columns()] = False

    assert [(v.a, v.b) for v in serving_variants(Two())] == [(True, False), (False, True), (True, True)]
    assert [(v.a, v.b) for v in serving_variants(Two(a=True))] == [(True, True)]

    class Wrong(C.Section):
        n: Annotated[int, adds_columns()] = 0

    with pytest.raises(TypeError, match="Wrong.n: an adds-only setting must be a bool"):
        serving_variants(Wrong())


# Values computed by the code before the declared scheme (commit 34f7d89): runs and tables made then stay current.
def test_train_and_resize_fingerprints_equal_their_pre_scheme_values():
    from stages.train.settings import earlier_config_fingerprints

    def recognised(cfg: C.TrainConfig) -> set[str]:
        return set(earlier_config_fingerprints(cfg))

    assert "a0d4db39ac12a0bb" in recognised(C.TrainConfig(dtype="float32"))
    assert "d161a628dea67558" in recognised(C.TrainConfig(dtype="float32", lr_schedule="cosine", max_steps=7))
    assert "b2616a2dc036b31f" in recognised(C.TrainConfig(dtype="bfloat16", mixed_precision="bf16", optimizer="prodigy",
                                                          ema_decay=0.9, lora=C.LoraConfig(kind="dora", rank=4)))
    # a resume may change what is not hashed (device, cadence, failure policy, a constant-LR max_steps, and the
    # memory settings the OOM advice names: a run made with them off resumes with them on)
    assert "a0d4db39ac12a0bb" in recognised(C.TrainConfig(dtype="float32", device="cpu:0", max_steps=9, check_ahead=0,
                                                          on_damaged="skip", validate_every=2,
                                                          gradient_checkpointing=True, offload="blocks"))


def test_memory_settings_leave_the_run_fingerprint_alone():
    """Gradient checkpointing and block offload train the same weights (tests/stages/test_train.py, the 2.1 offload
    test): a resume after an out-of-memory may turn them on. Before: hashed, so the resume was refused (or, under
    `pipeline run all`, the run moved aside and trained again from step 0)."""
    from stages.train.settings import config_fingerprint

    base = C.TrainConfig(dtype="float32")
    for memory in ({"gradient_checkpointing": True}, {"offload": "blocks", "offload_blocks_on_device": 3},
                   {"gradient_checkpointing": True, "uncheckpointed_blocks": 7}):
        assert config_fingerprint(base.model_copy(update=memory)) == config_fingerprint(base)
    assert C.ResizeConfig().fingerprint() == "c1b31852610f2c40"
    assert C.ResizeConfig(workers=3, shard_size_mb=1).fingerprint() == "c1b31852610f2c40"


def test_encode_hashes_written_before_the_scheme_are_still_recognised():
    from stages.encode.common import config_hash, earlier_config_hashes

    vae = C.EncodeVaeConfig(dtype="float32")
    assert "4d6a6f3323d96796" in earlier_config_hashes(vae)  # device cpu (the default)
    assert "de58dd1da3969066" in earlier_config_hashes(vae.model_copy(update={"dtype": "bfloat16", "device": "cuda:3"}))
    text = C.EncodeTextConfig(dtype="float32")
    assert "b5c733014dabf077" in earlier_config_hashes(text, prompt_format={"a": 1})
    assert "4b1831adcaed648a" in earlier_config_hashes(text.model_copy(update={"no_control_embeds": True}),
                                                       prompt_format={"a": 1})
    assert config_hash(vae) not in earlier_config_hashes(vae)  # the new hash holds no device


def test_init_lora_enters_the_run_fingerprint_as_set_not_by_its_path():
    """Its bytes are the resume record's init_lora_sha256: the same file at another path is the same run (before,
    the path was hashed: a moved or re-mounted init LoRA refused the resume and `run all` trained again from
    step 0). A run fingerprinted with the path (72f64b7ff221fcd8, commit 88cb75f) stays current at that path."""
    from stages.train.settings import config_fingerprint, earlier_config_fingerprints

    at_a = C.TrainConfig(dtype="float32", init_lora="/data/init/a.safetensors")
    at_b = at_a.model_copy(update={"init_lora": "/mnt/elsewhere/a.safetensors"})
    assert config_fingerprint(at_a) == config_fingerprint(at_b)
    assert config_fingerprint(at_a) != config_fingerprint(C.TrainConfig(dtype="float32"))  # set or not: another run
    assert "13bf5ee6244deeb0" == config_fingerprint(C.TrainConfig(dtype="float32"))  # runs without one: unchanged
    assert "72f64b7ff221fcd8" in earlier_config_fingerprints(at_a)
    assert "72f64b7ff221fcd8" not in earlier_config_fingerprints(at_b)  # its bytes were not recorded with the path


def _another_value(model: type[BaseModel], name: str, value):
    """A valid value of the field other than `value` (None where none of the candidates validates)."""
    from typing import Literal, get_args, get_origin

    choices = [a for t in _types(model.model_fields[name].annotation) if get_origin(t) is Literal for a in get_args(t)]
    candidates = [*choices, *([not value] if isinstance(value, bool) else []),
                  *([value + 1, value - 1] if isinstance(value, int) and not isinstance(value, bool) else []),
                  *([value / 2, min(value * 1.5, 0.99)] if isinstance(value, float) else []),
                  *([value[:1] + value[:1]] if isinstance(value, (list, tuple)) and value else []),
                  "cuda:1", "x", 1, 0.5, [0.5], [1], None]  # [1]: a seed list (a seed listed twice is refused)
    for c in candidates:
        if c == value:
            continue
        try:
            return getattr(model.model_validate({**model().model_dump(), name: c}), name)
        except Exception:  # noqa: BLE001 - not a valid value of this field: the next candidate
            continue
    return None


def test_every_stage_record_follows_the_declared_roles_in_both_directions():
    """What each stage compares (resize's version fingerprint, the encoders' features hash, the train run
    fingerprint, evaluate's report fingerprint) changes exactly when a hashed setting changes: a field whose role
    enters no hash never recomputes, one that enters always does. A new field is refused until it declares a role
    (`test_every_config_field_declares_its_lineage_role`); this keeps the declaration and the records one."""
    from stages.encode.settings import config_hash
    from stages.train.settings import config_fingerprint

    records = {C.ResizeConfig: lambda s: s.fingerprint(), C.EncodeTextConfig: config_hash,
               C.EncodeVaeConfig: config_hash, C.TrainConfig: config_fingerprint,
               C.EvaluateConfig: lambda s: s.fingerprint()}
    untried = []
    for model, record in records.items():
        base = model()
        for name in model.model_fields:
            other = _another_value(model, name, getattr(base, name))
            if other is None:
                untried.append(f"{model.__name__}.{name}")
                continue
            changed = base.model_copy(update={name: other})
            # as it enters the hash (a value hashed as something else, or as its default while unread, is not)
            hashed = hashed_settings(base).get(name, ...) != hashed_settings(changed).get(name, ...)
            assert (record(changed) != record(base)) == hashed, f"{model.__name__}.{name}"
    # fields whose change needs more than one candidate value (a nested section, a list of sections)
    assert set(untried) <= {"ResizeConfig.columns", "TrainConfig.lora", "TrainConfig.sigma", "TrainConfig.loss",
                            "EvaluateConfig.extra_prompts"}, untried


def test_evaluate_settings_that_change_no_number_keep_the_report_and_its_earlier_records():
    """evaluate.on_damaged (it changes only which samples are read, recorded on their own) and a negative prompt
    no extra prompt reads enter the report's fingerprint as their defaults. Before: either changed it, so `run
    all` recomputed every held-out loss pass and base image for the same numbers. Reports recorded with them as
    set (the hashes below, from the release before) are still current."""
    from stages.evaluate.report_current import earlier_config_fingerprints

    base = C.EvaluateConfig()
    assert C.EvaluateConfig(on_damaged="skip").fingerprint() == base.fingerprint()
    assert C.EvaluateConfig(negative_prompt="blurry").fingerprint() == base.fingerprint()
    assert C.EvaluateConfig(on_damaged="skip", negative_prompt="blurry").fingerprint() == base.fingerprint()
    extra = C.EvaluateConfig(extra_prompts=[C.ExtraPrompt(prompt="p", images=["a.png"])])
    assert extra.model_copy(update={"negative_prompt": "blurry"}).fingerprint() != extra.fingerprint()  # read
    no_cfg = extra.model_copy(update={"true_cfg_scale": 1.0})  # no true CFG: the negative is not encoded
    assert no_cfg.model_copy(update={"negative_prompt": "blurry"}).fingerprint() == no_cfg.fingerprint()

    assert earlier_config_fingerprints(base) == []  # the default: its records were spelled so already
    assert earlier_config_fingerprints(C.EvaluateConfig(on_damaged="skip")) == ["01df48a8de4c7126"]
    assert earlier_config_fingerprints(C.EvaluateConfig(negative_prompt="blurry")) == ["ad6126bc5d0cf3a2"]
    assert earlier_config_fingerprints(C.EvaluateConfig(on_damaged="skip", negative_prompt="blurry")) == \
        ["917ed41fb397a1b9"]
    # on_nonfinite likewise (a report under "stop" has no non-finite sample); its records as set: a5fa66613d1159e0
    assert C.EvaluateConfig(on_nonfinite="skip").fingerprint() == base.fingerprint()
    assert earlier_config_fingerprints(C.EvaluateConfig(on_nonfinite="skip")) == ["a5fa66613d1159e0"]


# train's throughput settings that change how a run trains, not what it writes beside the LoRA while training
_HOW_IT_TRAINS = {"device", "gradient_checkpointing", "uncheckpointed_blocks", "offload", "offload_blocks_on_device",
                  "on_damaged", "max_damaged_fraction", "on_nonfinite", "max_dropped_fraction", "max_open_shards",
                  "prefetch", "compile", "check_ahead", "max_steps"}  # max_steps: features under a decaying LR


def test_every_setting_acting_while_training_declares_it():
    """An up-to-date train skip names the settings it leaves unapplied (`resume.unapplied_settings`) by their
    role, `WHILE_TRAINING`: every throughput setting of train is either that or one listed above, so a new one is
    classified here or this fails (a forgotten one would be passed over in silence). None enters a hash."""
    from schemas.lineage import WHILE_TRAINING, while_training_names

    throughput = {n for n in C.TrainConfig.model_fields if role_of(C.TrainConfig, n).kind == "throughput"}
    assert throughput - _HOW_IT_TRAINS == while_training_names(C.TrainConfig)
    assert while_training_names(C.TrainConfig) == {
        "validate_every", "validate_max_samples", "validate_timesteps", "validate_noise_seeds", "sample_every",
        "sample_count", "sample_steps", "checkpoint_every", "keep_checkpoints", "log_every", "log_with", "profile"}
    assert all(role_of(C.TrainConfig, n) is WHILE_TRAINING for n in while_training_names(C.TrainConfig))
    changed = C.TrainConfig(validate_every=3, sample_every=2, checkpoint_every=7, log_with=[], profile=1)
    assert section_fingerprint(changed) == section_fingerprint(C.TrainConfig())


def test_settings_hashes_keep_their_stored_values_and_lengths():
    """Stored lineage keys hold 16 hex chars, evaluate's loss groups / base images and train's validation curve 64:
    the same settings give the digests stores and reports already hold (another would recompute them all)."""
    from pathlib import Path

    from schemas.lineage import settings_digest, settings_hash

    s = {"b": [1, 2.5, None], "a": {"x": "y"}}
    assert settings_hash(s) == "de1d1916aa08c248"
    assert settings_digest(s) == "de1d1916aa08c248192cb1f1f2749488473c5def104449a608da819fbb9b02f2"
    assert settings_digest({**s, "p": Path("/a")}, default=str) == \
        "df67bafdf02832f716ae305378b1ac61fd13d38fe2c8625b807f84025b708f64"
