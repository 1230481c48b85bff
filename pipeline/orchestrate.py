"""`pipeline run all`: resize-bucket -> encode-text -> encode-vae -> train -> evaluate, each skipped when up to
date, every one resumable, so a killed `run all` rerun continues where it stopped.

Every stage decides with the one rule of `schemas/up_to_date.py` (the inputs an output recorded equal the
inputs now), on its own record: resize-bucket and the encode stages find a table version with the
same lineage and reuse it (a killed one resumes from its committed shards); train is up to date when RUN/lora
was written after the last checkpoint and that checkpoint was trained on the same tables, model and train
config up to `train.max_steps` (otherwise train resumes from its last checkpoint); evaluate is up to date when
REPORT/metrics.json records the same tables, model, LoRA bytes and evaluate config.

When paths.run holds a run that cannot be continued (the tables, the model or the train config changed, e.g.
samples were added), train keeps it as RUN.previous/N-TIME (one atomic rename, stages/train/previous.py), with the
report evaluated on it moved inside it first as `evaluate-report/`, and trains afresh into paths.run; that
report's base images and base losses (LoRA off: no input of theirs changed) are linked into paths.report for
evaluate to reuse; evaluate says in one line that it evaluates afresh because the report went with the kept run
(naming RUN.previous/N/evaluate-report).

evaluate covers every kept checkpoint (RUN/checkpoints/step-N): held-out losses appended to REPORT/losses.zarr
(a checkpoint already there is skipped), curves and the best checkpoint in the report.

Under `pipeline launch` (several ranks) each stage runs as it does launched on its own: resize-bucket on rank 0
while the other ranks wait (`pipeline.launched.rank_0_alone`: a failure there stops every rank with its line), the
encode stages, train and evaluate distributed over the ranks, each taking its decisions on all ranks together.
Rank 0 prints the stage lines (the other ranks' stdout goes nowhere; their errors still show) and reads
the report. A store URL is refused there (each rank would pull and push
the same cache): its stages are launched one by one instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from schemas.config import PipelineConfig, lycoris_on_nf4
from schemas.errors import UserError
from schemas.stage import StageSummary

from pipeline.launched import launched, rank_0_alone
from pipeline.rank_output import stdout_of_rank_0


@dataclass
class StageOutcome:
    stage: str
    skipped: bool
    summary: str
    seconds: float
    result: StageSummary | None = None


@dataclass
class AllResult:
    outcomes: list[StageOutcome] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # the evaluate report's metrics.json
    report: Path | None = None

    @property
    def train_losses(self) -> list[float]:
        """Train losses of this invocation (empty when train was up to date)."""
        return next((list(getattr(o.result, "losses", [])) for o in self.outcomes if o.stage == "train"), [])

    @property
    def train_epochs(self) -> list[int]:
        """The epoch each of those steps began in."""
        return next((list(getattr(o.result, "step_epochs", [])) for o in self.outcomes if o.stage == "train"), [])


@dataclass(frozen=True)
class Paths:
    source: str
    store: str
    model: str
    run: Path
    report: Path
    kept: Path | None = None  # where train kept the run RUN held before (this invocation; rank 0's), else None

    @property
    def lora(self) -> Path:
        return self.run / "lora"


def required_paths(cfg: PipelineConfig) -> Paths:
    missing = [k for k in ("source", "store", "model", "run", "report") if getattr(cfg.paths, k) is None]
    if missing:
        raise UserError(
            f"`pipeline run all` needs paths.{', paths.'.join(missing)} in the config file "
            "(see configs/demo.yaml for a complete example)"
        )
    p = cfg.paths
    return Paths(p.source, p.store, p.model, Path(p.run), Path(p.report))  # type: ignore[arg-type]


def check_config(cfg: PipelineConfig) -> Paths:
    """What the config alone refuses (no file read): the paths `run all` needs, and the resize and train
    sections' settings, which each stage checks at its start (train's after resize-bucket and both encoders), by
    the stages' own checks: train.control_dropout against the text table encode-text will make, and the attention
    backends' names. The command asks right after parsing: a usage mistake, exit 2. Every rank reads the same
    config and refuses alike (ranks whose copies differ were stopped before: pipeline/node_settings.py)."""
    from models.attention import check_name as check_backend_name
    from stages.resize.stage import check_config as check_resize
    from stages.train.settings import check_control_dropout, validate_config as check_train

    paths = required_paths(cfg)
    if cfg.resize.val_fraction == 0:  # refused, not evaluate skipped: the report is what `run all` is run for
        raise UserError(
            "`pipeline run all` ends with evaluate, which reads the 'val' split, and resize.val_fraction: 0 puts "
            "every sample in 'train' (evaluate would fail after the training): set resize.val_fraction > 0 (e.g. "
            "0.1; evaluate reads at most evaluate.max_loss_samples of them), or run the stages without evaluate "
            "(`pipeline run resize-bucket`, `encode-text`, `encode-vae`, `train`)")
    check_resize(cfg.resize)
    check_train(cfg.train)
    # the setting decides, not the store: a text table encode-text would reuse may hold them without it, but
    # whether it reuses one depends on what resize-bucket writes (setting it true re-encodes nothing there)
    check_control_dropout(cfg.train, cfg.encode_text.no_control_embeds,
                          "encode-text writes only with encode_text.no_control_embeds: true, and this config runs it")
    check_backend_name(cfg.train.attention_backend, "train.attention_backend")
    check_backend_name(cfg.evaluate.attention_backend, "evaluate.attention_backend")
    return paths


def stages() -> list[tuple[str, Callable[[PipelineConfig, Paths], StageSummary]]]:
    """The stages in order, each as (name, call); every call returns a `StageSummary`."""
    from stages.encode import text as encode_text, vae as encode_vae
    from stages.resize import stage as resize
    from stages.train import recipe as train

    return [
        ("resize-bucket", lambda cfg, p: resize.run(cfg, p.source, p.store)),
        ("encode-text", lambda cfg, p: encode_text.run(cfg, p.store, p.model)),
        ("encode-vae", lambda cfg, p: encode_vae.run(cfg, p.store, p.model)),
        # resume=True: a killed `run all` continues its training; new_run=True: a run on other inputs is kept
        ("train", lambda cfg, p: _report_back(p.report, p.run, train.run(
            cfg, p.store, p.model, p.run, resume=True, skip_if_done=True, new_run=True,
            before_keep=lambda run: _report_into(p.report, run),
            rerun="rerun the same command"))),  # it has no --resume: resumes itself
        ("evaluate", evaluate_run),
    ]


def kept_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """(step, LoRA folder) of every committed checkpoint of RUN, oldest first."""
    from stages.train.state import complete_checkpoints

    if not Path(run).is_dir():
        raise UserError(f"run folder {run} does not exist; pass the folder train wrote (--run or paths.run)")
    return [(step, folder / "lora") for step, folder in complete_checkpoints(Path(run) / "checkpoints")]


def evaluate_run(cfg: PipelineConfig, p: Paths) -> StageSummary:
    """Every kept checkpoint (curves, the best one; `stages.evaluate.checkpoints`); a run without checkpoints:
    its final LoRA alone."""
    from stages.evaluate import checkpoints, stage as evaluate

    kept = kept_checkpoints(p.run)
    if p.kept is not None and launched()[1]:
        say_report_kept(p.report, p.kept, p.run, len(kept))
    # launched: always the checkpoints (one LoRA is evaluated in one process), whose list the ranks agree on: a
    # rank whose view of RUN lags and lists none would otherwise take its own way and stop the others
    if kept or launched()[0] > 1:
        return checkpoints.run(cfg.evaluate, p.store, p.model, kept, p.report, skip_if_done=True,
                               relist=lambda: kept_checkpoints(p.run), whose_report=report_of_kept_run(p.run))
    return evaluate.run(cfg.evaluate, p.store, p.model, p.lora, p.report, skip_if_done=True)


REPORT_IN_KEPT_RUN = "evaluate-report"


def report_of_kept_run(run: Path) -> Callable[[Path], str | None]:
    """For evaluate's line saying why a report is evaluated again (`checkpoints.run(whose_report=)`): REPORT's
    report is of a run train kept in RUN.previous/N (`pipeline run train --new-run`, then `evaluate
    --all-checkpoints` over the new run; `run all` where the report could not go with it), named; else None. The
    report's last checkpoint's sha256 against that step's LoRA in each kept run, newest first: one file hashed
    per kept run, and only when the report is not current (evaluate hashes every checkpoint then anyway)."""
    def whose(report: Path) -> str | None:
        from schemas.file_digest import file_sha256
        from models.lora import WEIGHT_NAME
        from stages.train.previous import kept_runs

        from stages.evaluate.report import read_metrics

        try:  # a report that does not read as one (damaged: None) says nothing here (evaluate names it itself)
            c = read_metrics(report, say=False)["checkpoints"]
            step, sha = max(zip(c["steps"], c["lora_sha256"]))
            for kept in kept_runs(Path(run)):
                weights = kept / "checkpoints" / f"step-{step}" / "lora" / WEIGHT_NAME
                if weights.is_file() and file_sha256(weights) == sha:
                    return f"it is the report of the run kept in {kept}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    return whose


def say_report_kept(report: Path, kept_run: Path, run: Path, checkpoints: int) -> None:
    """One line when evaluate computes a report afresh because REPORT's was the previous run's, which train kept
    (with that report, `_report_into`) in RUN.previous/N: as every stage says why it computes again, not a
    silent evaluation of every checkpoint after the train line."""
    from tqdm.auto import tqdm

    kept_report = Path(kept_run) / REPORT_IN_KEPT_RUN
    if (Path(report) / "metrics.json").is_file() or not (kept_report / "metrics.json").is_file():
        return  # REPORT has a report (evaluate says whether it is current), or the kept run had none
    what = (f"the {checkpoints} checkpoint{'s' if checkpoints != 1 else ''} of {run}" if checkpoints
            else f"its LoRA {Path(run) / 'lora'}")
    tqdm.write(f"evaluate: the report in {report} was the previous run's, kept with that run in {kept_report} "
               f"({run} holds another run now): evaluating {what}")


def _report_into(report: Path, run: Path) -> None:
    """The report of the run about to be kept goes into its folder (a rename; the kept run then holds its own
    evaluation). A kill right after this leaves it in RUN, where the rerun's keep takes it along."""
    import os

    if report.is_dir() and not report.resolve().is_relative_to(run.resolve()):
        try:
            os.rename(report, run / REPORT_IN_KEPT_RUN)
        except OSError:  # another file system: the report stays, and evaluate rewrites it for the new LoRA
            pass


def _report_back(report: Path, run: Path, result):
    """After train: a run that holds its own report (`_report_into`: kept with it, then taken back, or a kill right
    after the move) gives it back to REPORT when REPORT is free, so evaluate finds it (and checks it is current)
    instead of evaluating every checkpoint again. Rank 0's move (the report is rank 0's). Returns `result`."""
    import os

    inside = Path(run) / REPORT_IN_KEPT_RUN
    if launched()[1] and inside.is_dir() and not Path(report).exists():
        try:
            Path(report).parent.mkdir(parents=True, exist_ok=True)
            os.rename(inside, report)
        except OSError:  # another file system: evaluate writes a report there afresh
            pass
    kept = getattr(result, "kept_previous", None)
    if launched()[1] and kept is not None:
        _base_caches_back(Path(report), Path(kept) / REPORT_IN_KEPT_RUN)
    return result


def _base_caches_back(report: Path, kept_report: Path) -> None:
    """A fresh training changes no input of the base column (LoRA off): the kept report's base images and base
    losses are hard-linked into the new REPORT, where evaluate reuses each whose recorded inputs are this run's
    (`stages.evaluate.base_images`, `base_losses`: keyed by them, and checked against their recorded sha256 on read,
    so a link cut short by a kill is computed afresh). Before, every changed train setting generated the base
    images and computed the base losses again. A cache REPORT holds already is left as it is. Not lora-losses/ nor
    lora-images/: keyed by the LoRA's bytes, which a fresh training changes, they would serve the new LoRA nothing."""
    from stages.evaluate.base_images import FOLDER as BASE_IMAGES
    from stages.evaluate.base_losses import FILE as BASE_LOSSES
    from store.format import link_or_copy

    for name in (BASE_IMAGES, BASE_LOSSES):
        src, dst = kept_report / name, report / name
        if src.exists() and not dst.exists():
            try:
                report.mkdir(parents=True, exist_ok=True)
                link_or_copy(src, dst)
            except OSError:  # a full disk: evaluate computes them afresh (and says so if the disk stays full)
                pass


def check_output_folders(paths: Paths) -> None:
    """The folders `run all` writes, refused before resize-bucket's minutes (not at train or evaluate): a store,
    source or model inside paths.run, a paths.run or paths.store holding other files, a paths.report that is not
    a report's. Each rank reads its own node's folders; one outcome for every rank (a rank that stopped alone here
    left the others waiting for it). The command asks right after `check_config`: a usage mistake, exit 2."""
    from pipeline.run_folder import (refuse_a_folder_of_other_files, refuse_a_store_among_other_files,
                                     refuse_inputs_inside)

    from models.collective import together_before_group
    from stages.evaluate.report_folder import check_report_folder

    with together_before_group(launched()[0], "run all: the output folders"):
        refuse_inputs_inside(paths.run, {"paths.store": paths.store, "paths.source": paths.source,
                                         "paths.model": paths.model})
        refuse_a_folder_of_other_files(paths.run, "paths.run")
        refuse_a_store_among_other_files(paths.store, "paths.store")
        check_report_folder(paths.report, "paths.report")  # evaluate's check at its start, here before resize


def run_all(cfg: PipelineConfig, log: Callable[[str], None] = print, cache_dir: Path | None = None,
            cache_gb: float | None = None, folders_checked: bool = False) -> AllResult:
    """Every stage in order; `log` gets a header per stage and its one-line summary. A store URL is worked on
    through its local cache in `cache_dir` (pipeline/store_url.py). `folders_checked`: the caller has run
    `check_output_folders` (the command, for its exit 2); otherwise they are checked here."""
    from pipeline.store_url import StoreAccess

    from models.collective import together_before_group
    from models.loading import model_variant

    paths = check_config(cfg)
    world, main = launched()
    if world > 1:  # the config alone decides it, alike on every rank: before any file is read
        _refuse_url_under_launch(paths.store, world)
    if not folders_checked:
        check_output_folders(paths)
    # what the model folder and the node hold, read by each rank (a node may lack one): one outcome for every rank,
    # before rank 0 goes into resize-bucket and the others wait for it (a rank that stopped alone left them waiting)
    with together_before_group(world, "run all: the paths and settings"):
        model_variant(paths.model)  # every rank encodes, trains and evaluates on this node's model folder
        _check_node(cfg)  # every rank: its node's devices, packages and init LoRA
        if main:  # the sample grid and evaluate's images are rank 0's: only its node needs the extra prompts' files
            _check_settings(cfg, paths.model)
    if world > 1:
        log = log if main else (lambda message: None)  # one console: rank 0's lines
    access = StoreAccess(paths.store, cache_dir, cache_gb)
    result = AllResult(report=paths.report / "index.html")
    with stdout_of_rank_0(main):  # pipeline/rank_output.py
        _run_stages(cfg, paths, access, log, result)
    if main:  # rank 0 wrote the report (the others may finish first); its closing line prints these numbers
        from stages.evaluate.report import checked_metrics

        result.metrics = checked_metrics(paths.report, "rerun the same command")
    return result


def _check_node(cfg: PipelineConfig) -> None:
    """What this rank's node must have for the settings, refused before resize-bucket by the checks each stage
    makes at its start (train's after both encoders, evaluate's after the training): each section's device
    (`check_devices` of this rank alone: the block around it agrees for all ranks), the packages train.optimizer
    and each quantize_base need, and train.init_lora's file (hashed as train hashes it first; remembered, so train
    does not read it again)."""
    from models.launch_devices import check_devices
    from models.quantize import check_installed as check_quantize
    from stages.train.optimizers import check_installed as check_optimizer
    from stages.train.settings import init_lora_sha256

    for what, spec in (("encode_text.device", cfg.encode_text.device), ("encode_vae.device", cfg.encode_vae.device),
                       ("train.device", cfg.train.device), ("evaluate.device", cfg.evaluate.device)):
        if spec is not None:  # train.device unset: accelerate's choice
            check_devices(spec, what, 1)
    check_optimizer(cfg.train)
    check_quantize(cfg.train.quantize_base, "train.quantize_base")
    check_quantize(cfg.evaluate.quantize_base, "evaluate.quantize_base")
    init_lora_sha256(cfg.train)


def _check_settings(cfg: PipelineConfig, model: str) -> None:
    """What the config and the model decide, refused before resize-bucket and the encoders (hours at a million
    samples), not when train, or evaluate after training, reaches it: one denoising step where the model's
    scheduler cannot take it, dynamic_shift's settings read from that scheduler's config (`sigma_for_model`, as train
    resolves them), train.log_with's trackers (installed on rank 0's node), an attention backend a 2.1
    model does not take, a LoHa / LoKr adapter for an NF4 evaluate, and evaluate's extra prompts (their image
    counts and files; evaluate's own check at its start, `for_model`)."""
    from stages.evaluate.settings import check_sampling as evaluate_steps, for_model as evaluate_settings
    from stages.train.recipe import check_sampling as train_steps
    from stages.train.settings import sigma_for_model

    from models.attention import check_qwen21_name
    from models.loading import check_weight_files, model_variant
    from stages.train.trackers import tracker_classes

    if cfg.evaluate.quantize_base == "nf4" and cfg.train.lora.kind in ("loha", "lokr"):
        # evaluate would refuse the trained file on its NF4 base only after the whole training (models/lora.py);
        # not a config rule: `pipeline evaluate --lora FILE` on nf4 takes a plain LoRA file under this config
        raise UserError(lycoris_on_nf4(f"evaluate.quantize_base nf4 with train.lora.kind {cfg.train.lora.kind}"))
    check_weight_files(model)  # train loads the transformer only after resize-bucket and both encoders
    tracker_classes(cfg.train.log_with)  # rank 0's trackers (train checks them there too)
    train_steps(cfg.train, model)
    sigma_for_model(cfg, model)  # dynamic_shift's unset settings read from the model's scheduler, checked as train does
    if model_variant(model) == "qwen-image-2.1":  # refused by train and evaluate once the transformer loaded
        check_qwen21_name(cfg.train.attention_backend, "train.attention_backend")
        check_qwen21_name(cfg.evaluate.attention_backend, "evaluate.attention_backend")
    _check_resize(cfg, model)
    if cfg.evaluate.extra_prompts:  # they need the model's variant: a hub id is resolved now, not at encode-text
        evaluate_settings(cfg.evaluate, model)
    else:
        evaluate_steps(cfg.evaluate, model)


def _check_resize(cfg: PipelineConfig, model: str) -> None:
    """Resize settings the model's encoders cannot use, refused before resize-bucket renders the whole source:
    an Edit-Plus encode-text refuses a table without the VL views (after resize-bucket ran), and a 2.1
    encode-text quarantines every reference whose side is not a multiple of its 32 px VLM slot, or whose area
    (resize.control_vae_area) its VLM processor resizes (for a run with references: `pipeline.reference_area`);
    and a 2.1 model's resize.keep_alpha or max_controls left
    unset, or max_controls above the references it takes."""
    from models.loading import model_variant, pipeline_family
    # the rules encode-text quarantines by (`_side_rejection`, `reference_rejection`)
    from stages.encode.qwen21 import MAX_REFERENCES as _MAX_REFERENCES_21, PIXELS_PER_SIDE

    variant = model_variant(model)
    if pipeline_family(variant) == "edit-plus" and not cfg.resize.vl_views:
        raise UserError(f"resize.vl_views: false writes no control_{{i}}_vl.png, which {model} ({variant})'s text "
                        "encoder reads (false is for Qwen-Image-2.1 models); set resize.vl_views: true")
    if variant == "qwen-image-2.1" and cfg.resize.multiple % PIXELS_PER_SIDE:
        raise UserError(f"resize.multiple = {cfg.resize.multiple}: {model} (Qwen-Image-2.1) reads references in "
                        f"{PIXELS_PER_SIDE}x{PIXELS_PER_SIDE} px VLM slots, so encode-text would quarantine every "
                        f"reference with a side that is not a multiple of {PIXELS_PER_SIDE}; set resize.multiple to a "
                        f"multiple of {PIXELS_PER_SIDE} (configs/qwen-image-2.1.yaml: 32)")
    # unset, keep_alpha is false: the cut-outs would be flattened over white for a VAE that reads their alpha, with
    # nothing said but resize's `converted:` line. Set either way it is the user's choice (false and unset hash
    # alike, so a store rendered without it stays up to date).
    if variant == "qwen-image-2.1" and "keep_alpha" not in cfg.resize.model_fields_set:
        raise UserError(f"resize.keep_alpha is unset (false: pictures with transparency are composited over white), "
                        f"but {model} (Qwen-Image-2.1) reads RGBA: set resize.keep_alpha: true to train them with "
                        "their alpha (configs/qwen-image-2.1.yaml), or resize.keep_alpha: false to flatten them on "
                        "purpose (a store made without it stays up to date)")
    # unset, max_controls is Edit-Plus's 3: a 2.1 run quarantined every sample with 4..10 references as
    # control-count, said only in resize's summary; refused alike (3 and unset hash alike)
    if variant == "qwen-image-2.1" and "max_controls" not in cfg.resize.model_fields_set:
        raise UserError(f"resize.max_controls is unset ({cfg.resize.max_controls}: Edit-Plus's limit, more "
                        f"references are quarantined), but {model} (Qwen-Image-2.1) takes up to {_MAX_REFERENCES_21}: "
                        f"set resize.max_controls: {_MAX_REFERENCES_21} to train them (configs/qwen-image-2.1.yaml), or "
                        f"resize.max_controls: {cfg.resize.max_controls} to keep the limit on purpose")
    # above it, encode-text quarantined every sample with more references (stages/encode/qwen21.py
    # `reference_rejection`) after resize-bucket had rendered them
    if variant == "qwen-image-2.1" and cfg.resize.max_controls > _MAX_REFERENCES_21:
        raise UserError(f"resize.max_controls = {cfg.resize.max_controls}: {model} (Qwen-Image-2.1) takes at most "
                        f"{_MAX_REFERENCES_21} references, so encode-text would quarantine every sample with more; set "
                        f"resize.max_controls: {_MAX_REFERENCES_21} or less")
    if variant == "qwen-image-2.1":  # where the run has references; else after resize-bucket, or not at all
        from pipeline.reference_area import check_before_resize

        check_before_resize(cfg, model, cfg.paths.source)


def _run_stages(cfg: PipelineConfig, paths: Paths, access, log: Callable[[str], None],
                result: AllResult) -> None:
    from dataclasses import replace

    from pipeline.reference_area import check_after_resize
    from pipeline.store_url import named_by_url
    from pipeline.val_split import check_val_split

    for name, call in stages():
        log(f"== {name}")
        t0 = time.perf_counter()
        with access.for_stage(name, log) as local:
            if name == "resize-bucket":  # one writer of the images table; the others wait for it
                summary = rank_0_alone(name, lambda: call(cfg, replace(paths, store=local)))
            else:
                summary = call(cfg, replace(paths, store=local))
            summary = named_by_url(summary, paths.store)
        if name == "train":  # evaluate says so when the report it replaces went with a kept run
            paths = replace(paths, kept=getattr(summary, "kept_previous", None))
        if summary is not None:  # None: a rank other than 0 under a launcher (resize-bucket, evaluate report rank 0)
            outcome = StageOutcome(name, summary.up_to_date, str(summary), time.perf_counter() - t0, summary)
            result.outcomes.append(outcome)
            log(f"{outcome.summary}  [{'skipped, up to date' if outcome.skipped else f'{outcome.seconds:.1f} s'}]")
        check_after_resize(name, cfg, paths.model, local)  # a 2.1 reference area, where the table has references
        check_val_split(name, cfg, local)  # evaluate's val sample, before train's hours (every rank, together)


def _refuse_url_under_launch(store: str, world: int) -> None:
    from store.remote import is_url

    if is_url(store):  # every rank sees the same store and environment: every rank refuses alike
        raise UserError(
            f"`pipeline run all` on a store URL ({store}) runs in one process, but it was launched as {world}: run "
            "`pipeline run all` without the launcher, or the stages one by one (`pipeline run resize-bucket`, then "
            "`pipeline launch ... run encode-text`, `encode-vae`, `train`, `evaluate --all-checkpoints`)")
