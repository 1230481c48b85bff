"""The run's checkpoints as files, for `evaluate --all-checkpoints`: the list every rank agrees on
(`agreed_checkpoints`), each LoRA file checked against its sealed record and hashed (`check_and_hash`), and the
lines for one deleted meanwhile (`checkpoint_gone`, a training beside evaluate prunes them) or unusable."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from models.lora_files import KEEPS_NEWEST
from schemas.errors import UserError


def agreed_checkpoints(checkpoints: list[tuple[int, Path]], ranks) -> list[tuple[int, Path]]:
    """The checkpoints rank 0 lists, on every rank, less those some rank does not see. Each rank lists the run
    folder itself, and every later exchange pairs the checkpoints by their place in the list: a training beside
    evaluate that commits or prunes one between the ranks' listings, or a node whose view of the folder lags
    (right after train in `run all`), would pair one rank's step 400 with another's step 600, or leave lists of
    different lengths waiting in different collectives. A step some rank does not see is left out with a line
    (the next evaluate takes it); one only other ranks list waits for rank 0 to see it."""
    if ranks.world <= 1:
        return checkpoints
    (n,) = ranks.from_main([len(checkpoints)])
    if n == 0:
        return []
    steps = ranks.from_main([step for step, _ in checkpoints] if ranks.main else [0] * n)
    mine = dict(checkpoints)
    unseen = ranks.any([int(step not in mine) for step in steps])
    if ranks.main and any(unseen):
        left = [str(step) for step, u in zip(steps, unseen) if u]
        tqdm.write(f"checkpoint step(s) {', '.join(left)} not seen by every rank yet (committed during the start, "
                   "or a node's view of the run folder lags): left out; the next evaluate takes them")
    return [(step, mine[step]) for step, u in zip(steps, unseen) if not u]


def check_and_hash(checkpoints: list[tuple[int, Path]], ranks=None) -> tuple[list[tuple[int, Path]], dict[int, str]]:
    """Each checkpoint's LoRA file against the CRC32C its sealed resume.json records (as single-LoRA evaluate
    checks RUN/lora's checksums.json): a flipped bit is refused naming the file, not evaluated as trained
    weights, nor taken (its hash changed) for another run's checkpoint. The same pass gives its bytes' sha256
    (the up-to-date check and the appends both compare them). Each file is read once, not on every run: its
    sha256 is remembered by `models.file_hashes` (a checkpoint unchanged since is not read again; one rewritten
    is), and under a launcher checkpoint i is looked at by rank i % world, the hashes then shared, every rank
    deciding alike. A checkpoint removed
    meanwhile (pruned by a training running beside evaluate) is left out with a line, not taken for a damaged
    one. Returns (kept, step -> sha256), the same on every rank."""
    from models.collective import together
    from models.lora import lora_base_fingerprint
    from stages.evaluate.lora_bytes import checked_hashes
    from stages.evaluate.ranks import Ranks

    ranks = ranks or Ranks()
    hashes: list[str | None] = [None] * len(checkpoints)
    gone = [0] * len(checkpoints)
    with together(ranks.world, "check the checkpoints"), checked_hashes() as remembered:
        for i in tqdm(ranks.share(len(checkpoints)), desc="check and hash checkpoints", unit="ckpt",
                      disable=not ranks.main):
            step, path = checkpoints[i]
            try:
                hashes[i] = lora_digest(path, remembered)
                lora_base_fingerprint(path)  # its header parses: a truncated file unsealed (older runs) is named here
            except (UserError, OSError) as e:
                if checkpoint_gone(path):
                    gone[i] = 1
                    continue
                raise unloadable(step, path, e) from None
    gone = ranks.any(gone)  # left out on every rank when the rank that read it found it gone
    hashes = ranks.from_owners(hashes)
    kept, shas = [], {}
    for (step, path), g, sha in zip(checkpoints, gone, hashes):
        if g:
            if ranks.main:
                tqdm.write(deleted_line(step, path))
            continue
        kept.append((step, path))
        shas[step] = sha
    return kept, shas


def lora_digest(checkpoint: Path, hashes) -> str:
    """The sha256 of the checkpoint's LoRA file, checked against its sealed record and hashed in one read, or as
    `hashes` remembers it unchanged since such a read (`stages.evaluate.lora_bytes.known_or_checked`)."""
    from models.lora import lora_weight_file
    from stages.evaluate.lora_bytes import known_or_checked

    return known_or_checked(lora_weight_file(checkpoint), hashes)


def checkpoint_gone(checkpoint: Path) -> bool:
    """Was the checkpoint removed since it was listed? A training running beside evaluate prunes its oldest kept
    checkpoints (train.keep_checkpoints) while the others are evaluated."""
    from models.lora import WEIGHT_NAME

    return not (Path(checkpoint) / WEIGHT_NAME).is_file() and not Path(checkpoint).is_file()


def deleted_line(step: int, path) -> str:
    """What a checkpoint gone before its turn is told as, in the user's terms (it said "pruned")."""
    return f"checkpoint step {step} was deleted before it was evaluated ({path}): {KEEPS_NEWEST}; skipped"


def unloadable(step: int, path: Path, e: UserError | OSError) -> UserError:
    """One line for a checkpoint still there that cannot be used, at its check (`check_and_hash`) or its load (one
    that passed its check, but of tensors of other sizes: a LoRA of another base model copied into the run): its
    step, and for a refusal how to evaluate the others; a read error is the disk's, not the file's to move."""
    if isinstance(e, OSError):
        return UserError(f"checkpoint step {step}: cannot read {path} ({e})")
    return UserError(f"checkpoint step {step}: {e}; or move {Path(path).parent} out of the run's checkpoints/ to "
                     "evaluate the others")
