"""`evaluate` stage: held-out loss and sample images, base model vs LoRA -> a report directory.

Read top to bottom: open the val split of `text` + `vae` (and `images` for the pictures) -> load the
transformer once, install the multi-resolution pieces, attach the LoRA -> held-out flow-matching loss with the
trainer's own `flow_loss` at fixed noise seeds x a fixed σ grid, LoRA off and on -> generate N val samples
(and the configured extra prompts) from the stored features, LoRA off and on, same seed -> PSNR/SSIM against
the targets -> metrics.json, grid.png, index.html (`stages.evaluate.report`).

The text encoder is not loaded for val samples: their prompt embeds are in the store, and the true-CFG
negative is the stored empty-prompt embedding of the same sample (the instruction left empty, the same
controls). Only `evaluate.extra_prompts` (images from files) load the text encoder, through `models.edit` (2.1:
the stock pipeline call of `models.qwen21_predict`, stages/evaluate/qwen21.py).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from features.damaged import read_intact
from features.decode import read_image_file
from features.open import open_configured
from features.pictures import open_png
from models.flow import flow_loss
from models.loading import load_component, parse_dtype
from models.lora import attach_lora, lora_weight_file
from stages.evaluate.ema_curve import unscored_final_ema
from stages.evaluate.lora_bytes import checked_hashes, known_or_checked, read_for_load
from stages.evaluate.report_folder import REPORT_LOCK, check_report_folder  # torch-free: the CLI asks it first
from models.attention import use_attention_backend
from models.collective import together
from models.multires import install_multires
from models.qwen21_flow import is_qwen21
from models.precision import Precision, auto_note, check_loaded_dtype
from models.randomness import eval_noise
from models.sample import TrainSample, from_features
from schemas import up_to_date as current
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from models.generate import Conditioning
from schemas.stage import few
from models.held_out import bucket_of, loss_grid, loss_summary
from stages.evaluate.nonfinite import finite_rows
from stages.evaluate.paired import paired, per_sample, signed
from stages.evaluate.report import SampleRow, psnr, score_means, ssim, write_report
from store import Store, TableReader
from store.join import JoinedTables

PSNR_SSIM_NOTE = (
    "PSNR/SSIM compare each output with the sample's stored target image. They measure pixel fidelity to one "
    "reference edit, not edit quality: a correct edit that differs from the reference in unedited details "
    "scores low. On the tiny random-init demo model both outputs are noise from an untrained decoder, so "
    "there the numbers only show that the plumbing runs; only the held-out loss says whether training helped."
)


@dataclass
class LossRow:
    """One held-out evaluation point: a sample at one noise seed and one σ."""

    sample: TrainSample
    seed: int
    sigma: float


@contextmanager
def lora_enabled(transformer, enabled: bool):
    """Run with the LoRA on or off (peft layers stay in place, only bypassed)."""
    if enabled:
        transformer.enable_lora()
    else:
        transformer.disable_lora()
    try:
        yield
    finally:
        transformer.enable_lora()


@torch.no_grad()
def row_losses(transformer, rows: list[LossRow], batch_size: int, mask_weight=(1.0, 1.0), desc: str = "") -> list[float]:
    """`flow_loss` of every row, in mixed-resolution batches of `batch_size` rows."""
    out: list[float] = []
    for i in tqdm(range(0, len(rows), batch_size), desc=desc, unit="batch", leave=False):
        chunk = rows[i : i + batch_size]
        sigmas = torch.tensor([r.sigma for r in chunk], dtype=torch.float32)
        noises = [eval_noise(r.sample, r.seed) for r in chunk]
        out += flow_loss(transformer, [r.sample for r in chunk], sigmas, noises, mask_weight=mask_weight).tolist()
    return out


def finite_samples(samples: list[TrainSample], grids: dict, cfg: EvaluateConfig) -> tuple[list[int], list[str]]:
    """evaluate.on_nonfinite over `loss_grid` arrays named e.g. "base" / "lora": stop naming the samples whose
    held-out loss is NaN/inf in any of them, or (skip) the indices of the samples to keep and the keys left out."""
    per_k = len(cfg.noise_seeds) * len(cfg.timesteps)
    row_keys = [s.key for s in samples for _ in range(per_k)]
    kept_rows, nonfinite = finite_rows(row_keys, {m: g[..., 0].reshape(-1).tolist() for m, g in grids.items()},
                                       cfg.on_nonfinite)
    return sorted({i // per_k for i in kept_rows}), nonfinite


def held_out_loss(transformer, samples: list[TrainSample], cfg: EvaluateConfig,
                  base_cache: tuple | None = None, load=None, recorded: tuple | None = None) -> dict:
    """Base vs LoRA loss: per sample the mean over noise seeds x σ grid; then overall, per bucket, per σ, mask.
    One forward per row and LoRA state, weighted all / inside / outside the mask (`loss_grid`). `base_cache`:
    (report folder, key of every input of the base losses): the base grid reused from there when recorded under
    the key (`stages.evaluate.base_losses`). `recorded`: (folder, settings, LoRA path): both grids kept there, and
    only the (seed, σ) cells no group there holds computed (`stages.evaluate.lora_losses`). `load`: sample i in
    full where `samples` are outlines (`loss_grid`)."""
    from stages.evaluate import base_losses, lora_losses
    from store.loss_array import Axes

    def compute(name: str, cells=None):
        with lora_enabled(transformer, name == "lora"):
            return loss_grid(transformer, samples, *cfg.loss_axes, cfg.batch_size, desc=f"held-out loss ({name})",
                             load=load, cells=cells)

    def check_base(base):  # a non-finite base loss = bad stored features (on_nonfinite=stop names them): stop
        finite_samples(samples, {"base": base}, cfg)  # before the LoRA pass, as --all-checkpoints does

    if recorded is not None:
        axes = Axes([s.key for s in samples], [bucket_of(s) for s in samples], *cfg.loss_axes)
        grids = lora_losses.grids(*recorded, axes, compute, base_cache, check_base)
    else:
        shape = (len(samples), len(cfg.noise_seeds), len(cfg.timesteps), 3)
        base = base_losses.cached(*base_cache, shape, lambda: compute("base")) if base_cache else compute("base")
        grids = {"base": base}
        check_base(grids["base"])
        grids["lora"] = compute("lora")
    kept, nonfinite = finite_samples(samples, grids, cfg)
    result = loss_summary({m: g[kept] for m, g in grids.items()}, [samples[i] for i in kept], *cfg.loss_axes,
                          protocol(cfg, samples))
    result["nonfinite_samples"] = nonfinite  # left out of every mean (evaluate.on_nonfinite=skip)
    # did training help: paired over the val samples (same noise and σ for both), ± its standard error
    result["lora_minus_base"] = paired(per_sample(grids["lora"][kept]), per_sample(grids["base"][kept]))
    return result


def protocol(cfg: EvaluateConfig, samples: list[TrainSample]) -> str:
    return (
        f"flow-matching loss on {len(samples)} val samples x noise seeds {cfg.loss_axes[0]} x σ "
        f"{cfg.loss_axes[1]}; the trainer's flow_loss, LoRA off (base) and on (scale {cfg.lora_scale}); "
        "per sample averaged over its target tokens, then over samples"
    )


# ------------------------------------------------------------------------------------------------ generation


def pick_samples(samples: list[TrainSample], n: int) -> list[TrainSample]:
    """n samples, round-robin over buckets (so every resolution shows up), keys sorted within a bucket."""
    by_bucket: dict[str, list[TrainSample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.key):
        by_bucket[bucket_of(s)].append(s)
    queues = [by_bucket[b] for b in sorted(by_bucket)]
    picked: list[TrainSample] = []
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def conditioning(sample: TrainSample, device, dtype: torch.dtype) -> Conditioning:
    """Stored features as the denoiser's inputs: batch of one, the stored empty prompt as the CFG negative."""
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)[None]

    return Conditioning(
        prompt_embeds=f(sample.prompt_embeds),
        control_latents=[f(c) for c in sample.controls],
        negative_embeds=f(sample.empty_embeds),
    )


def _scores(target: Image.Image | None, base: Image.Image, lora: Image.Image) -> dict[str, float]:
    if target is None:
        return {}
    return {"psnr_base": psnr(target, base), "psnr_lora": psnr(target, lora),
            "ssim_base": ssim(target, base), "ssim_lora": ssim(target, lora)}


def images_reader(st: Store, tables: JoinedTables, on_damaged: str = "stop",
                  max_open_shards: int = 256) -> TableReader | None:
    """The `images` version the vae table was built from (the pictures of exactly these samples). Gone since (a
    `store repair` replaced it, or a gc collected it): a line naming the encoders whose rerun brings the val tables
    to the current images (the store's "inspect lists the versions" said nothing of that)."""
    from store import format as fmt
    from store.remote_parts import source_url

    version = tables.vae.schema.lineage.upstream.get("images")
    if "images" not in st.tables():
        return None
    if version is not None and not st.version_dir("images", int(version)).is_dir():
        aside = st.version_dir("images", int(version)).with_name(f"v{int(version)}{fmt.SET_ASIDE_SUFFIX}")
        url = source_url(st.root)  # a store URL's cache holds the versions read, not every one
        why = ("replaced by a repair (set aside as " + aside.name + "/)" if aside.is_dir() else
               f"not in this node's copy of {url}" if url else "collected")
        raise UserError(f"the val samples' pictures are in images v{version}, which table 'vae' "
                        f"v{tables.vae.version} was encoded from, but {st.root} does not hold it ({why}): run "
                        "`pipeline run encode-text` and `pipeline run encode-vae` to encode from images "
                        f"v{st.tables()['images']} (samples whose pictures did not change are carried forward, not "
                        "encoded again), then evaluate")
    return st.reader("images", version, on_damaged=on_damaged, max_open_shards=max_open_shards)


#: the `images` meta columns `stored_pictures` reads (with the sample's bytes: the pictures): what names those rows
#: in a report's inputs (`images_rows_id`; not `source`, a path that moves with the source folder)
PICTURE_COLUMNS = ("caption",)


def stored_pictures(images, picked: list[TrainSample], on_damaged: str, damaged: dict | None) -> list[tuple]:
    """Each picked val sample's (caption, control pictures, target) from the `images` table (empty when the table
    or the sample is absent; a damaged sample under on_damaged=skip loses only its pictures, recorded in
    `damaged`). The captions and the pictures' places are read for those rows only, in one pass over the row groups
    holding them (`meta_and_files_of`): `meta` and `files` would keep every meta column of the table parsed, and its
    `files` column (~735 + 95 MB at 1M samples)."""
    held = [s.key for s in picked if images is not None and s.key in images]
    lost: dict[str, str] | None = {} if on_damaged == "skip" and damaged is not None else None
    metas, pictures = images.meta_and_files_of(held, PICTURE_COLUMNS, lost) if held else ({}, {})
    for key, why in (lost or {}).items():
        damaged[f"images:{key}"] = why  # type: ignore[index]
    out = []
    for s in picked:
        files = pictures.get(s.key, {})
        target = open_png(files["target.png"]) if "target.png" in files else None
        controls = [open_png(files[f"control_{i}.png"]) for i in range(len(s.controls))
                    if f"control_{i}.png" in files]
        out.append((str(metas.get(s.key, {}).get("caption", "")), controls, target))
    return out


def extra_prompt_inputs(model: str, transformer, vae, cfg: EvaluateConfig):
    """Each configured extra prompt through predict's stock-equivalent path (text encoder loaded once):
    (title, prompt, controls, target, conditioning, height, width, scheduler config)."""
    from models.edit import load_pipeline, prepare

    pipe = load_pipeline(model, parse_dtype(cfg.dtype), {"text_encoder": cfg.device},
                         transformer=transformer, vae=vae)
    for i, extra in enumerate(cfg.extra_prompts):
        # decoded as resize-bucket decodes the training pictures (EXIF, alpha over white, CMYK, 16-bit)
        controls = [read_image_file(p, what=f"evaluate.extra_prompts[{i}] image") for p in extra.images]
        target = (read_image_file(extra.target, what=f"evaluate.extra_prompts[{i}] target")
                  if extra.target else None)
        cond, height, width = prepare(pipe, controls, extra.prompt, cfg.negative_prompt, cfg.true_cfg_scale,
                                      extra.height, extra.width)
        yield f"extra {i + 1}", extra.prompt, controls, target, cond, height, width, dict(pipe.scheduler.config)


def paired_rows(jobs: list, transformer, vae, cfg: EvaluateConfig, qwen21: bool, samples: list | None = None,
                base_cache: tuple | None = None, lora_cache: tuple | None = None) -> list[SampleRow]:
    """Each job's base image (LoRA bypassed; reused from `base_cache` when every input of it is unchanged: the
    mechanism --all-checkpoints uses, `checkpoint_report.base_column`) and LoRA image (reused alike from
    `lora_cache` = (folder, `base_images.lora_group_key`)), same seed, scored against its target. `samples`: the
    val samples the jobs were picked from (the cache key names them)."""
    from stages.evaluate.checkpoint_report import base_column, kept_column

    base = base_column(jobs, transformer, vae, cfg, qwen21, samples or [], base_cache, lora_off=True)
    lora = kept_column(jobs, transformer, vae, cfg, qwen21, samples or [], lora_cache, "lora")
    return [SampleRow(j.title, j.caption, j.controls, j.target, b, l, _scores(j.target, b, l))
            for j, b, l in zip(jobs, base, lora)]


def steps_made(cfg: EvaluateConfig, model: str | None) -> str:
    """The denoising steps the images were made with: a Qwen-Image-2.1 folder that fixes its sampling sigmas
    (model_index.json `sample_sigmas`) is sampled at those, whatever `num_inference_steps` says (as the stock
    pipeline does), and the report says so rather than the unused setting."""
    from models.loading import model_variant
    from models.qwen21_generate import pipeline_sample_sigmas

    if model is not None and model_variant(model) == "qwen-image-2.1" and (sigmas := pipeline_sample_sigmas(model)):
        return (f"{len(sigmas)} Euler steps at the model's own sample_sigmas {sigmas} (its model_index.json; "
                f"evaluate.num_inference_steps = {cfg.num_inference_steps} unused, as in the stock pipeline)")
    return f"{cfg.num_inference_steps} Euler steps (dynamic shift)"


def generation_summary(rows: list[SampleRow], cfg: EvaluateConfig, model: str | None = None) -> dict:
    scored = [r for r in rows if r.scores]
    return {
        "settings": (
            f"{steps_made(cfg, model)}, true CFG {cfg.true_cfg_scale} (negative: the "
            f"stored empty prompt; extra prompts: {cfg.negative_prompt!r}), seed {cfg.seed} for every sample, "
            f"base and LoRA alike; LoRA scale {cfg.lora_scale}"
        ),
        "note": PSNR_SSIM_NOTE,
        "samples": [{"title": r.title, "caption": r.caption, **r.scores} for r in rows],
        **(score_means(rows) if scored else {"mean": {}}),  # "mean_over": finite and identical (infinite PSNR)
    }


# ------------------------------------------------------------------------------------------------ the stage


def resolved_config(cfg: EvaluateConfig, model: str) -> EvaluateConfig:
    """This rank's device, the concrete dtype (`auto` decided by the device) and the attention backend (unset: the
    device's default): what runs, is hashed and is recorded."""
    return agreed_config(cfg, model)[0]


def agreed_config(cfg: EvaluateConfig, model: str, world: int = 1) -> tuple[EvaluateConfig, Precision]:
    """(`resolved_config`, the precision with its reason). With several ranks (`world`, --all-checkpoints) the
    dtype and the attention backend are each one decision of all (`models.precision.agreed_precision`,
    `models.attention.agreed_choice`: collectives, every rank calls them): their rows of one loss grid are
    computed in one precision and backend, the ones recorded. A rank without its device stops every rank with its
    line there. The backend is set as resolved (its choice kept for `load_transformer`), so that every hash of
    the settings names the backend used, not its spelling: unset on a CPU and `native` are one report."""
    from models.attention import agreed_choice
    from models.loading import model_variant
    from models.precision import agreed_precision, device_for_rank, resolve_precision

    device = ""

    def own():
        nonlocal device
        device = device_for_rank(cfg.device, what="evaluate.device")
        return resolve_precision(cfg.dtype, device, what="evaluate.dtype")

    precision = agreed_precision(own, world, "evaluate.dtype")
    choice = cfg._attention_choice  # resolved already: the choice made then (a resolved name reads "configured")
    if choice is None:
        dtype = parse_dtype(precision.weights)
        # Qwen-Image-2.1 takes native only; its files are read only where the default could be another backend
        qwen21 = cfg.attention_backend is None and torch.device(device).type == "cuda" and \
            dtype in (torch.bfloat16, torch.float16) and model_variant(model) == "qwen-image-2.1"
        choice = agreed_choice(cfg.attention_backend, "evaluate.attention_backend", torch.device(device), dtype,
                               world, qwen21)
    resolved = cfg.model_copy(update={"device": device, "dtype": precision.weights, "attention_backend": choice.backend})
    resolved._attention_choice = choice
    return resolved, precision


def check_sampling(cfg: EvaluateConfig, model: str) -> None:
    """`evaluate.num_inference_steps` against the model's scheduler, where images are made (else the steps are
    unused; `models.loading.check_sampling_steps`; `pipeline run all` asks before its first stage)."""
    if cfg.num_samples or cfg.extra_prompts:
        from models.loading import check_sampling_steps

        check_sampling_steps(cfg.num_inference_steps, "evaluate.num_inference_steps", model)


def for_model(cfg: EvaluateConfig, model: str, check: bool = True) -> EvaluateConfig:
    """`evaluate.true_cfg_scale` left unset: the model family's own default, as predict and the training sample
    grid take it (Qwen-Image-2.1: no guidance, its pipeline's default; the Edit models: 4.0). Resolved before
    anything is fingerprinted, so a report records the scale its images were made with; then every setting
    checked (`check_settings`; `check` False: not on this rank, which makes no images)."""
    from models.loading import model_variant
    from models.qwen21_predict import TRUE_CFG_21

    if model_variant(model) == "qwen-image-2.1" and "true_cfg_scale" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"true_cfg_scale": TRUE_CFG_21})
    if check:
        check_settings(cfg, model)
    return cfg


def say_unused_negative(cfg: EvaluateConfig, model: str) -> None:
    """One line where `evaluate.negative_prompt` is set but the extra prompts run without true CFG (a scale of 1 or
    less: on Qwen-Image-2.1 the default, its pipeline's 1.0): it is then dropped, as the stock call warns."""
    if cfg.extra_prompts and cfg.true_cfg_scale <= 1 and cfg.negative_prompt.strip():
        tqdm.write(f"note: evaluate.negative_prompt is unused: the extra prompts' images on {model} are made without "
                   f"guidance (evaluate.true_cfg_scale {cfg.true_cfg_scale}); set it above 1 for true CFG")


def check_settings(cfg: EvaluateConfig, model: str) -> None:
    """Every evaluate setting that the config and the model decide, refused before anything is read or loaded,
    and by `pipeline run all` before its first stage (not hours later, after training): the denoising steps
    (`check_sampling`) and each extra prompt: as many images as the model takes, each image and target a file
    that decodes (before, a missing one stopped evaluate when its picture was made, after the held-out loss
    passes) and that the stock resize can size (`models.control_shapes`: a too elongated one was a traceback
    there), its height / width a size the pipeline does not round down (predict's rule), and on a 2.1 model
    the prompt within the RoPE table. `cfg` as `for_model` resolves it (the 2.1 guidance decides whether the
    negative prompt is encoded)."""
    check_sampling(cfg, model)
    if not cfg.extra_prompts:
        return
    from models.control_shapes import check_control_shapes, check_output_size
    from models.loading import model_variant
    from models.qwen21_predict import check_reference_count

    qwen21 = model_variant(model) == "qwen-image-2.1"
    for i, extra in enumerate(cfg.extra_prompts):
        if qwen21:  # none: text-to-image, the stock pipeline's image=None call (`edit_21`)
            check_reference_count(len(extra.images), model, f"evaluate.extra_prompts[{i}].images",
                                  "list at most 10 images in that extra prompt")
        elif not extra.images:
            raise UserError(f"evaluate.extra_prompts[{i}].images: none listed, but {model} "
                            f"({model_variant(model)}) edits control images; list at least one (a Qwen-Image-2.1 "
                            "model also takes none: text-to-image)")
        elif model_variant(model) == "edit" and len(extra.images) != 1:
            raise UserError(f"evaluate.extra_prompts[{i}].images: {len(extra.images)} control images, but "
                            f"Qwen-Image-Edit ({model}) takes exactly one; list one image in that extra prompt")
        check_output_size(model, extra.height, extra.width,  # as predict's --height / --width
                          (f"evaluate.extra_prompts[{i}].height", f"evaluate.extra_prompts[{i}].width"))
        if extra.target:
            read_image_file(extra.target, what=f"evaluate.extra_prompts[{i}] target")
        if not qwen21:  # a 2.1 model's are read by check_extra_prompts_21, as its generation reads them
            what = f"evaluate.extra_prompts[{i}] image"
            check_control_shapes(extra.images, [read_image_file(p, what=what) for p in extra.images],
                                 model_variant(model), extra.height, extra.width, what)
    if qwen21:
        from stages.evaluate.qwen21 import check_extra_prompts_21

        check_extra_prompts_21(cfg, model)  # the tokenizer only, before the transformer loads
    else:  # the processor alone: its ValueError came when the images were made, after the held-out loss passes
        from models.qwen21_predict import check_placeholders_before_loading

        check_placeholders_before_loading(model, [(f"evaluate.extra_prompts[{i}]: ", extra.prompt) for i, extra in
                                                  enumerate(cfg.extra_prompts)],
                                          cfg.negative_prompt if cfg.true_cfg_scale > 1 else None)


def evaluate_inputs(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path,
                    lora_sha256: str | None = None, tables: JoinedTables | None = None,
                    table_ids: dict | None = None) -> dict:
    """Everything a report depends on; equal inputs = the report is up to date (`pipeline run all` skips it).
    `lora_sha256`: the LoRA file's hash when the caller has it (`run` hashes it once, with its CRC check).
    The tables are named by what evaluate reads from them (`read_table_ids`; `tables`: the val split's join when
    open, else opened here), or `table_ids` when the caller has them (without `tables`: the split is not opened,
    and `max_loss_samples` is hashed as set, `config_fingerprint`)."""
    from models.file_hashes import file_sha256
    from models.loading import model_files, model_fingerprint
    from stages.evaluate.base_images import extra_prompt_bytes
    from stages.evaluate.loss_fingerprint import EVALUATION_REVISION

    if tables is None and table_ids is None:
        with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as opened:
            return evaluate_inputs(cfg, store, model, lora, lora_sha256, opened)
    cfg = resolved_config(cfg, model)
    h = lora_sha256 or file_sha256(lora_weight_file(lora))  # chunked: a GB-sized LoRA is not read into memory
    inputs = {  # not the store's path: the tables' identities name the data (a moved store is the same report)
        "tables": table_ids if table_ids is not None else read_table_ids(cfg, store, model, tables),
        "model_fingerprint": model_fingerprint(model),
        "lora_sha256": h,
        "config_fingerprint": config_fingerprint(cfg, len(tables) if tables is not None else None),
        "evaluation_revision": EVALUATION_REVISION,
    }
    if cfg.extra_prompts:  # only then: a report without extra prompts keeps the inputs it recorded before
        inputs["extra_prompts_sha256"] = extra_prompt_bytes(cfg)
    return inputs


def config_fingerprint(cfg: EvaluateConfig, n: int | None) -> str:
    """A single-LoRA report's `config_fingerprint`: `cfg.fingerprint()` with `max_loss_samples` at or above the val
    split's `n` samples spelled null, as the loss array's settings spell it (`loss_fingerprint.samples_read`): it reads
    every sample, the same numbers. Hashed as set, 256 (the default) then null on a split 256 covered made the
    report out of date, and its rerun ran the LoRA's loss pass again. `n` None: as set (the split not opened)."""
    return _cap_spelled(cfg, None).fingerprint() if _reads_all(cfg.max_loss_samples, n) else cfg.fingerprint()


def _reads_all(cap, n: int | None) -> bool:
    return n is not None and (cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= n))


def _cap_spelled(cfg: EvaluateConfig, cap) -> EvaluateConfig:
    return cfg.model_copy(update={"max_loss_samples": cap})


def cap_spellings(cfg: EvaluateConfig, n: int | None, recorded_cap) -> list[EvaluateConfig]:
    """`cfg` and the configs with another cap that reads the same val samples (every one of the split's `n`):
    null, and the cap `recorded_cap` a report's config records (256 then null: the same numbers, the same
    report); only `cfg` when its cap reads fewer."""
    if not _reads_all(cfg.max_loss_samples, n):
        return [cfg]
    return [cfg] + [_cap_spelled(cfg, c) for c in dict.fromkeys((None, recorded_cap))
                    if c != cfg.max_loss_samples and _reads_all(c, n)]


def same_config(recorded: str | None, cfg: EvaluateConfig, n: int | None, metrics: dict) -> bool:
    """Is a report's recorded `config_fingerprint` these settings (`cfg`, resolved) under another spelling: as set
    (`earlier_config_fingerprints`; the attention backend recorded unset, where the report's own run record says
    which it used), or with another cap that reads every one of the val split's `n` samples too (256, then null:
    `cap_spellings`)? One rule for a single-LoRA report and an --all-checkpoints one (that one compared only the
    spellings as set: 256 then null rewrote its report, the same figures)."""
    from stages.evaluate.backend import unset_backend
    from stages.evaluate.report_current import earlier_config_fingerprints

    if not isinstance(metrics, dict):
        return False
    unset_used = unset_backend(cfg.dtype, metrics)
    recorded_cap = ((metrics.get("run") or {}).get("config") or {}).get("max_loss_samples")
    spellings = cap_spellings(cfg, n, recorded_cap)
    return recorded in [c.fingerprint() for c in spellings] + \
        [h for c in spellings for h in earlier_config_fingerprints(c, unset_used)]


def version_table_ids(store: str | Path) -> dict:
    """The store's current images / text / vae version ids: how a report named its tables before they were named
    by content (`read_table_ids`), and what they fall back to."""
    st = Store(store, create=False)
    return {t: st.version_id(t, v) for t, v in sorted(st.tables().items()) if t in ("images", "text", "vae")}


def read_table_ids(cfg: EvaluateConfig, store: str | Path, model: str, tables: JoinedTables | None = None) -> dict:
    """The tables a report reads, named by content where they have one: text / vae by the val split's content
    ids (`loss_fingerprint.read_tables`), `images` by the rows the pictures and captions come from (`images_rows_id`),
    so an `images` rerun that changed no sample keeps the report. A table without one: its version id."""
    from models.loading import model_files
    from stages.evaluate.loss_fingerprint import read_tables
    from features.damaged import rows_read

    if tables is None:
        with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as opened:
            return read_table_ids(cfg, store, model, opened)
    ids = read_tables(tables, cfg.max_loss_samples)
    st = Store(store, create=False)
    if "images" in st.tables():
        rows = images_rows_id(st, tables, rows_read(tables, cfg.max_loss_samples))
        ids["images"] = f"content:{rows}" if rows else st.version_id("images", st.tables()["images"])
    return dict(sorted(ids.items()))


def images_rows_id(st: Store, tables: JoinedTables, first: int | None = None) -> str | None:
    """`store.join.rows_content_id` of the `images` rows evaluate shows (`images_reader`: the version the vae table
    was built from) for the val keys scored (the first `first`, `features.damaged.rows_read`; None: every one), which
    the pictures are taken from: their bytes (pictures) and `PICTURE_COLUMNS`. None: no such id."""
    from store.join import rows_content_id

    try:
        images = images_reader(st, tables)
    except UserError:  # that version is gone (collected): named by the current version id, as before
        return None
    if images is None:
        return None
    with images:
        keys = tables.keys.array
        return rows_content_id(images, keys if first is None else keys.slice(0, first), PICTURE_COLUMNS)


def report_up_to_date(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: str | Path,
                      lora_sha256: str | None = None, why: list[str] | None = None) -> bool:
    """Is OUT's report this run's (`schemas.up_to_date`)? `why`: filled, when it holds one that is not, with what
    differs (`report_current.differences`)."""
    from stages.evaluate.report_current import damaged_current, differences, nonfinite_current
    from stages.evaluate.loss_fingerprint import damaged_read

    metrics = Path(out) / "metrics.json"
    if not metrics.is_file() or not (Path(out) / "index.html").is_file():
        return False
    from stages.evaluate.report import read_metrics

    try:
        metrics_of = read_metrics(out)
        recorded = metrics_of.get("run", {}).get("inputs")
    except AttributeError:  # None (damaged, unreadable) or other JSON than a report's
        return False
    if not isinstance(recorded, dict):
        return False
    # recorded before the path left the inputs, or before the evaluation revision was recorded
    recorded = {"evaluation_revision": current.UNRECORDED_REVISION,
                **{k: v for k, v in recorded.items() if k != "store"}}
    # recorded before the tables were named by content: the store's version ids then, compared as they were; else
    # the present content ids (`read_table_ids`). The val split is opened either way: its size says which caps
    # read every sample (`cap_spellings`)
    versions = version_table_ids(store)
    table_ids = versions if recorded.get("tables") == versions else None
    from models.loading import model_files

    with open_configured(cfg, "evaluate", store, model, model_files(model), "val") as tables:  # its size: the cap
        tables.damaged.update(damaged_read(Path(out)))  # its read went as many rows further (`rows_read`)
        present = evaluate_inputs(cfg, store, model, lora, lora_sha256, tables, table_ids)
        n = len(tables)
    resolved = resolved_config(cfg, model)
    if same_config(recorded.get("config_fingerprint"), resolved, n, metrics_of):
        present["config_fingerprint"] = recorded["config_fingerprint"]
    if current.is_current(recorded, present) and damaged_current(metrics_of, cfg) \
            and nonfinite_current(metrics_of, cfg):
        return True
    if why is not None:
        why += differences(recorded, present, metrics_of, resolved, None)
    return False


@dataclass
class EvaluateResult:
    metrics: dict  # what metrics.json holds
    report: Path  # index.html
    up_to_date: bool = False
    stage: str = "evaluate"
    seconds: float = 0.0
    damaged: dict[str, str] | None = None  # evaluate.on_damaged=skip: samples left out, key -> problem

    def to_json(self) -> dict:
        from schemas.stage import absolute, summary_record

        loss = self.metrics.get("loss", {}).get("overall", {})
        return summary_record(self.stage, seconds=self.seconds, up_to_date=self.up_to_date, report=absolute(self.report),
                              val_samples=loss.get("n"), loss_base=loss.get("base"), loss_lora=loss.get("lora"),
                              damaged_samples=sorted(self.damaged or {}))

    def __str__(self) -> str:
        overall = self.metrics["loss"]["overall"]
        diff = self.metrics["loss"].get("lora_minus_base")
        sure = f" ({signed(diff)}, paired ± s.e.)" if diff else ""
        # up to date: its numbers too (a rerun of `pipeline run evaluate` said only that)
        line = (f"report {self.report.parent} is up to date; " if self.up_to_date else "") + (
            f"held-out loss on {overall['n']} val samples: base {overall['base']:.4f} -> LoRA {overall['lora']:.4f}"
            f"{sure}; report: {self.report}")
        nonfinite = self.metrics["loss"].get("nonfinite_samples")
        if nonfinite:
            line += (f"\nleft out {len(nonfinite)} val sample(s) with a non-finite loss (evaluate.on_nonfinite=skip; "
                     f"listed in metrics.json loss.nonfinite_samples): {few(nonfinite)}")
        if self.damaged:
            line += (f"\nskipped {len(self.damaged)} damaged val sample(s) (evaluate.on_damaged=skip; listed in "
                     f"metrics.json run.damaged_samples): {few(self.damaged)}")
        return line


def read_val_samples(cfg: EvaluateConfig, store: str | Path, model: str):
    """(the val split's joined tables, `val_share.Share` of its first `max_loss_samples` intact samples, all when
    unset). Each is read once to find the intact ones and kept as an outline (key, img_shapes, mask): the loss
    passes read the features again batch by batch (`val_share.reader`), so what is held does not grow with the
    count (10k val samples x several MB each, held in full before)."""
    from models.loading import model_files
    from stages.evaluate.val_share import Share, loss_sample_count, outline

    tables = open_configured(cfg, "evaluate", store, model, model_files(model), "val")
    n = loss_sample_count(cfg, tables)
    tables.check_ahead(lambda: iter(range(len(tables))))  # the bytes checked by a thread just ahead of the reads
    try:  # evaluate.on_damaged=skip: a damaged one left out where it is read, the next one read instead
        read = read_intact(tables, n, lambda i: (i, outline(from_features(*tables.features_at(i)))),
                           "read val samples")
    finally:
        tables.stop_check_ahead()
    return tables, Share([s for _, s in read], list(range(len(read))), [i for i, _ in read])


def load_transformer(cfg: EvaluateConfig, model: str, world: int = 1):
    """The transformer in the resolved dtype and device, multi-resolution installed, no adapter yet. With several
    ranks (`world`) every rank calls it: the load is agreed on, the attention backend one decision of all ranks."""
    dtype = parse_dtype(cfg.dtype)
    # agreed on: a rank that fails to load stops every rank here, not one left in the backend's agreement below;
    # uneven: a node reading the model from a slower disk comes minutes later (stages/train/build.py)
    with together(world, "load the transformer", uneven=True):
        transformer = load_component(model, "transformer", dtype=dtype, device=cfg.device, quantize=cfg.quantize_base)
        check_loaded_dtype(transformer, cfg.dtype, "evaluate.dtype")
        if not is_qwen21(transformer):  # 2.1: its own mixed-layout forward (models/qwen21_multires.py), images by stages/evaluate/qwen21.py
            install_multires(transformer)
    # the backend the settings were hashed with (`agreed_config`), as decided then: nothing decided again
    used = use_attention_backend(transformer, cfg.attention_backend, "evaluate.attention_backend",
                                 torch.device(cfg.device), dtype, world, cfg._attention_choice)
    if cfg._attention_choice is not None and used != cfg.attention_backend:  # the same on every rank: all stop
        raise UserError(f"evaluate.attention_backend: the model uses {used}, but the report is hashed with "
                        f"{cfg.attention_backend}; report this")
    return transformer


def warn_other_base(loras: list, model: str, steps: list[int] | None = None) -> None:
    """One warning line when the LoRA(s) record another base model than MODEL (as predict and merge warn): the
    store may be shared with that model (same VAE and text encoder), so nothing else stops the run, and the
    numbers would say nothing about the LoRA."""
    from models.loading import model_fingerprint
    from models.lora import check_family_before_loading, lora_base_fingerprint

    for lora in loras:  # the other family refused before the transformer loads, not after
        check_family_before_loading(lora, model)
    now = model_fingerprint(model)
    other = [(i, fp) for i, lora in enumerate(loras) if (fp := lora_base_fingerprint(lora)) not in (None, now)]
    if other:
        shown = [str(steps[i]) for i, _ in other][:10] if steps else []
        which = f" (checkpoints {', '.join(shown)}{' …' if len(other) > 10 else ''})" if steps else ""
        tqdm.write(f"warning: LoRA {loras[other[0][0]]} was trained on a base model with fingerprint {other[0][1]}, "
                   f"but {model} has {now}{which}: its held-out loss and images do not show what training did")


def single_process() -> None:
    """evaluate runs in one process. Under torchrun / accelerate launch every rank would evaluate everything into
    one report folder: the first took its lock, the others stopped naming it, and the launcher then ended the
    first too. Every rank sees the same launcher environment, so every rank refuses alike with this line."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise UserError(f"evaluate of one LoRA runs in one process, but it was launched as {world} (WORLD_SIZE="
                        f"{world}, torchrun / accelerate launch): run `pipeline run evaluate` directly, on the "
                        "device evaluate.device names (only --all-checkpoints shares its work between ranks)")


def one_evaluate_per_report(run):
    """Runs `run(cfg, store, model, what, out, ...)` holding `out`'s lock: two evaluates writing one report folder
    (its loss array, index.html, metrics.json) would interleave their files; the second stops at once, naming the
    first's pid. A flock: the kernel drops it with a killed process."""
    import functools

    from store.format import flock

    @functools.wraps(run)
    def locked(cfg, store, model, what, out, *args, **kwargs):
        single_process()
        out = Path(out)
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            with flock(out / REPORT_LOCK, blocking=False, holder=f"the report folder {out}"):
                return run(cfg, store, model, what, out, *args, **kwargs)
        except BaseException:
            if made:
                _remove_if_only_the_lock(out)
            raise

    return locked


def _remove_if_only_the_lock(out: Path) -> None:
    """The report folder this evaluate made, when it stopped before writing anything (a store without its `text`
    table, a Ctrl-C while loading): removed, as train leaves no --out behind then; a folder holding only
    `.evaluate.lock` was left for every such mistake."""
    try:
        if [p.name for p in out.iterdir()] == [REPORT_LOCK]:
            (out / REPORT_LOCK).unlink()
            out.rmdir()
    except OSError:  # another evaluate's, or something written meanwhile: left as it is
        pass


@one_evaluate_per_report
def run(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: str | Path,
        skip_if_done: bool = False) -> EvaluateResult:
    """Evaluate base vs LoRA on the store's val split and write the report into `out`. `skip_if_done`: reuse a
    report of the same inputs (`pipeline run all`)."""
    out = Path(out)
    started = time.perf_counter()
    cfg = for_model(cfg, model)
    say_unused_negative(cfg, model)
    # the file train sealed, checked and hashed in one read (none when unchanged since such a read: the up-to-date
    # check read it whole on every run): a flipped bit is refused, not evaluated; the bytes loaded are compared
    with checked_hashes() as remembered:
        lora_sha256 = known_or_checked(lora_weight_file(lora), remembered)
    if (line := unscored_final_ema(lora)) is not None:  # said whether the report is current or not
        tqdm.write(line)
    recorded = _recorded_report(cfg, store, model, lora, out, lora_sha256, skip_if_done)
    if recorded is not None:
        return recorded
    check_report_folder(out)
    device_note = auto_note(cfg.device)
    cfg, precision = agreed_config(cfg, model)
    tqdm.write(precision.describe("evaluate", cfg.device, device_note
                                  + (f", quantize_base {cfg.quantize_base}" if cfg.quantize_base != "none" else "")))
    warn_other_base([lora], model)
    from stages.evaluate import trained_val
    from stages.evaluate.val_share import complete

    tables, share = read_val_samples(cfg, store, model)
    # closed on every path (readers, read lease): a process that goes on (`run all`) holds nothing of them, and a
    # lease left held after a failure kept `store gc` from removing the version
    with tables:
        inputs = evaluate_inputs(cfg, store, model, lora, lora_sha256, tables)  # of the tables read
        samples, damaged = share.samples, dict(tables.damaged)
        trained = trained_val.check(Store(store, create=False), lora, [s.key for s in samples],
                                    trained_val.val_images_version(tables))  # said before the long passes

        transformer = load_transformer(cfg, model)
        attach_checked(transformer, lora, cfg.lora_scale, lora_sha256)
        loss = _held_out(cfg, store, model, lora, out, tables, share, transformer, lora_sha256)

        rows: list[SampleRow] = []
        if cfg.num_samples > 0 or cfg.extra_prompts:  # the pictured samples read in full
            rows = sample_rows(cfg, store, model, transformer, tables,
                               complete(tables, share, pick_samples(samples, cfg.num_samples)), damaged, out,
                               lora_sha256)

        metrics = {
            "loss": loss,
            "generation": generation_summary(rows, cfg, model),
            "run": {**_run_record(cfg, store, model, lora, tables, len(samples), damaged, inputs),
                    "trained_val": trained},
        }
    return EvaluateResult(metrics, write_report(out, metrics, rows), seconds=time.perf_counter() - started,
                          damaged=damaged)


def _recorded_report(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: Path,
                     lora_sha256: str, skip_if_done: bool) -> EvaluateResult | None:
    """With `skip_if_done`, OUT's report when it is current for these inputs (its line said again); else None,
    having said why a report there is not current (`report_current.say_recomputed`)."""
    from stages.evaluate.report_current import say_recomputed

    why: list[str] = []
    if skip_if_done and report_up_to_date(cfg, store, model, lora, out, lora_sha256, why):
        from stages.evaluate.trained_val import say_recorded

        metrics = json.loads((out / "metrics.json").read_text())
        say_recorded(metrics)  # the figures are the same, and so is what makes them not held out
        return EvaluateResult(metrics, out / "index.html", up_to_date=True)
    say_recomputed(out, why)
    return None


def _held_out(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, out: Path, tables, share,
              transformer, lora_sha256: str) -> dict:
    """The held-out loss section, base vs LoRA: the grids kept in OUT/lora-losses (`lora_losses`) and
    OUT/base-losses.safetensors (`base_losses`) reused, only what they lack computed."""
    from stages.evaluate.base_images import losses_key, machine
    from stages.evaluate.lora_losses import FOLDER, settings_of
    from stages.evaluate.val_share import reader

    samples = share.samples
    features = read_inputs(cfg, store, model, tables)
    settings = settings_of(features, lora_sha256, machine(cfg))
    return held_out_loss(transformer, samples, cfg, (out, losses_key(cfg, features, [s.key for s in samples])),
                         load=reader(tables, share), recorded=(out / FOLDER, settings, lora_weight_file(lora)))


def read_inputs(cfg: EvaluateConfig, store: str | Path, model: str, tables) -> dict:
    """`loss_fingerprint`'s settings with the text / vae tables the val samples were read from, named by content
    (`loss_fingerprint.read_fingerprint`): the store's current ones may have changed since (an encode beside evaluate),
    and a cache keyed by those would name numbers the new version never gave."""
    from stages.evaluate.loss_fingerprint import loss_fingerprint, read_fingerprint

    return read_fingerprint(loss_fingerprint(cfg, store, model)[1], tables)[1]


def attach_checked(transformer, lora: str | Path, scale: float, sha256: str) -> None:
    """`attach_lora` from the file's bytes read once, refused when they are not the bytes checked and recorded
    (the LoRA rewritten while evaluate ran): the report's recorded hash is that of the weights evaluated."""
    data, now = read_for_load(lora_weight_file(lora))
    if now != sha256:
        raise UserError(f"{lora_weight_file(lora)} changed while evaluate ran (its bytes are not the ones checked "
                        "at the start): rerun evaluate once whatever writes it has finished")
    attach_lora(transformer, lora, scale, data=data)


def sample_rows(cfg: EvaluateConfig, store: str | Path, model: str, transformer, tables, samples: list,
                damaged: dict, out: Path | None = None, lora_sha256: str | None = None) -> list[SampleRow]:
    """Base and LoRA images of `num_samples` val samples (with their stored target and controls) and of the
    extra prompts: the VAE and the scheduler are loaded only here. The base column is kept in OUT/base-images/
    and reused by a rerun whose every input of it is unchanged (`stages.evaluate.base_images`), and the LoRA's
    (of `lora_sha256`) in OUT/lora-images/ alike: a rerun for the loss grid alone generates no image."""
    from stages.evaluate.base_images import FOLDER, LORA_FOLDER, lora_group_key
    from stages.evaluate.checkpoint_report import _jobs

    vae = load_component(model, "vae", dtype=parse_dtype(cfg.dtype), device=cfg.device)
    check_loaded_dtype(vae, cfg.dtype, "evaluate.dtype")
    qwen21 = is_qwen21(transformer)
    jobs = _jobs(cfg, model, store, tables, transformer, vae, samples, damaged, qwen21)
    features = read_inputs(cfg, store, model, tables) if out is not None else None
    cache = (Path(out) / FOLDER, features) if out is not None else None
    lora_cache = (Path(out) / LORA_FOLDER, lora_group_key(cfg, features, lora_sha256)) \
        if out is not None and lora_sha256 is not None else None
    return paired_rows(jobs, transformer, vae, cfg, qwen21, samples, cache, lora_cache)


def _run_record(cfg: EvaluateConfig, store: str | Path, model: str, lora: str | Path, tables, val_samples: int,
                damaged: dict, inputs: dict) -> dict:
    """metrics.json `run`: what was evaluated (`inputs`: what `skip_if_done` compares)."""
    return {
        "store": str(Path(store).resolve()),
        "tables": tables.versions(),
        "model": str(model),
        "lora": str(Path(lora).resolve()),
        "lora_scale": cfg.lora_scale,
        "val_samples": val_samples,
        "val_split": tables.report,
        "damaged_samples": damaged,
        "config": cfg.model_dump(mode="json"),
        "inputs": inputs,
    }
