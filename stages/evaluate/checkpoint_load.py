"""One checkpoint's weights into the transformer, for `evaluate --all-checkpoints`: swapped into the one adapter
(`use_checkpoint`), for its loss pass only while its bytes are the ones hashed (`load_checkpoint`, every rank
deciding alike), for its pictures only while they are the ones its losses are of (`use_recorded`, `held_bytes`)."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from schemas.errors import UserError
from stages.evaluate.checkpoint_files import checkpoint_gone, deleted_line, unloadable


REWRITTEN, PRUNED = 1, 2  # `load_checkpoint`: why a checkpoint is left out (0: loaded)


def load_checkpoint(ranks, transformer, step: int, path: Path, sha: str, lora_scale: float,
                    attached: bool) -> tuple[int, bool]:
    """(0, True) once checkpoint `step` is loaded into `transformer` on every rank; (REWRITTEN or PRUNED,
    attached) - said once - when any rank found it changed or gone: left out on every rank."""
    from models.collective import together

    changed = 0
    with together(ranks.world, f"load checkpoint step {step}"):
        try:
            # A training running beside evaluate may prune or rewrite a checkpoint after it was hashed: the
            # numbers are recorded under the hash only when the loaded bytes are still the hashed ones.
            if _load_if_unchanged(transformer, path, sha, lora_scale, attached):
                attached = True
            else:
                changed = REWRITTEN
        except (UserError, OSError) as e:
            if not checkpoint_gone(path):
                raise unloadable(step, path, e) from None
            changed = PRUNED
    changed = ranks.any([changed])[0]  # left out on every rank when any rank saw it change
    if changed and ranks.main:
        tqdm.write(deleted_line(step, path) if changed == PRUNED else
                   f"checkpoint step {step} was rewritten while evaluating ({path}; by a running training?): "
                   "left out; rerun evaluate to evaluate what is there now")
    return changed, attached


def _load_if_unchanged(transformer, path: Path, sha: str, scale: float, attached: bool) -> bool:
    """Load the checkpoint when its bytes are still the ones hashed (one read: the loader parses the bytes
    hashed here); False when they changed (rewritten since by a training running beside evaluate)."""
    from models.lora import lora_weight_file
    from stages.evaluate.lora_bytes import read_for_load

    data, now = read_for_load(lora_weight_file(path))
    if now != sha:
        return False
    use_checkpoint(transformer, path, scale, attached, data)
    return True  # `data` is freed here, before the checkpoint's loss pass


def use_checkpoint(transformer, path: Path, scale: float, attached: bool, data: bytes | None = None) -> None:
    """The checkpoint's weights in the one adapter "lora": copied into it when they fit (no new modules per
    checkpoint); a checkpoint of another rank, alpha or target modules (a run folder holding checkpoints of two
    trainings) gets the adapter rebuilt from its own saved config, so it is evaluated as saved, not refused. A
    checkpoint's EMA file (`models.ema_file`, `ema_checkpoints`): its step's LoRA loaded, then the EMA's values."""
    from models.ema_file import ema_state, is_ema_file
    from models.lora import attach_lora, load_lora

    if is_ema_file(path):  # a checkpoint's EMA: the adapter its step's lora/ builds, holding the EMA's values
        use_checkpoint(transformer, Path(path).parent / "lora", scale, attached)
        data = data if data is not None else Path(path).read_bytes()
        load_lora(transformer, path, adapter_name="lora", state=ema_state(transformer, "lora", data, Path(path)))
        return
    if attached:
        try:
            load_lora(transformer, path, adapter_name="lora", data=data)
            return
        except UserError:
            if checkpoint_gone(path):
                raise
            transformer.delete_adapters("lora")
    attach_lora(transformer, path, scale, data=data)


def use_recorded(transformer, path: Path, step: int, sha: str | None, scale: float, attached: bool,
                 data: bytes | None = None) -> None:
    """The checkpoint's weights for its pictures, when they are the bytes its losses were recorded under (`sha`;
    None: not hashed this run); else one line: the images of a rewritten checkpoint (a training restarted into
    the run beside evaluate) would sit under numbers of other weights. `data`: its bytes, read and compared with
    `sha` when the summary named it (`held_bytes`): a training pruning it since does not take its pictures."""
    if data is not None:
        use_checkpoint(transformer, path, scale, attached, data)
    elif sha is None:
        use_checkpoint(transformer, path, scale, attached)
    elif not _load_if_unchanged(transformer, path, sha, scale, attached):
        raise rewritten(step, path)


def held_bytes(points: list[dict], shas: dict[int, str],
               ema_shas: dict[int, str] | None = None) -> dict[str, bytes] | None:
    """The LoRA bytes of the checkpoints the summary names for pictures (best, last: `points`), read now and
    held until their images are made: a training beside evaluate that prunes one meanwhile (while the base
    images are made) does not stop evaluate. None when one is gone already (the summary is taken again without
    it); a file whose bytes are not the ones evaluated is refused (`rewritten`). Keyed by path: a step's raw LoRA
    and its EMA (`ema_shas`, a point whose `weights` is "ema") are two files."""
    from models.lora import lora_weight_file
    from stages.evaluate.lora_bytes import read_for_load

    held = {}
    for p in points:
        if p["path"] in held:
            continue
        try:
            data, sha = read_for_load(lora_weight_file(p["path"]))
        except (UserError, OSError):
            if checkpoint_gone(p["path"]):
                return None
            raise
        recorded = (ema_shas or {}) if p.get("weights") == "ema" else shas
        if p["step"] in recorded and sha != recorded[p["step"]]:
            raise rewritten(p["step"], p["path"])
        held[p["path"]] = data
    return held


def rewritten(step: int, path: Path) -> UserError:
    return UserError(f"checkpoint step {step} was rewritten after its held-out loss was computed ({path}; by a "
                     "running training?): its images would not show the weights evaluated; rerun evaluate "
                     "once the training has stopped writing it")
