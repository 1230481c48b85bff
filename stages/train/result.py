"""`TrainResult`: what the train stage returns (its summary record and its one line)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path

from schemas.units import count_text
from stages.train.summary import train_line


@dataclass
class TrainResult:
    run_dir: Path
    lora_dir: Path
    start_step: int  # 0, or the checkpoint step it resumed from
    steps: int  # optimizer steps done in all
    # Per-step figures of this start as typed arrays (8 bytes a step each, where a list of floats held ~32: the
    # five were ~137 MB per rank at 1M steps, measured; now ~42 MB). They index, slice and sum as lists do and
    # compare with each other; `.tolist()` for JSON or a comparison with a list.
    losses: array = field(default_factory=lambda: array("d"))  # mean per-sample loss of each step of this start
    step_epochs: array = field(default_factory=lambda: array("q"))  # the epoch each of those steps began in
    step_times: array = field(default_factory=lambda: array("d"))  # s per step: data + logging, no checkpoint
    step_cpu_times: array = field(default_factory=lambda: array("d"))  # the same in process CPU time (robust to load)
    step_data_times: array = field(default_factory=lambda: array("d"))  # s of each step spent waiting for micro-batches
    epoch_padding: dict[int, float] = field(default_factory=dict)  # epoch -> valid / computed tokens
    skipped_steps: list[int] = field(default_factory=list)  # train.on_nonfinite=skip_step: steps not applied
    damaged_steps: list[int] = field(default_factory=list)  # train.on_damaged=skip: steps of damaged samples only
    main_process: bool = True
    up_to_date: bool = False  # `skip_if_done` found the final LoRA of this very run: nothing trained
    stage: str = "train"
    seconds: float = 0.0
    data: dict = field(default_factory=dict)  # the join's report: samples, dropped, reasons (store.join)
    kept_previous: Path | None = None  # where the run the folder held before this fresh start was kept
    init_lora: str | None = None  # train.init_lora this run started from (not a resume)
    # up to date: the settings acting only while training that differ from the run's (`resume.unapplied_settings`)
    unapplied: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        from schemas.stage import absolute, summary_record

        return summary_record(self.stage, seconds=self.seconds, up_to_date=self.up_to_date, steps=self.steps,
                              start_step=self.start_step, lora=absolute(self.lora_dir),
                              loss_first=self.losses[0] if self.losses else None,
                              loss_last=self.losses[-1] if self.losses else None, data=self.data,
                              kept_previous=absolute(self.kept_previous))

    def __str__(self) -> str:
        if self.up_to_date:
            line = f"LoRA {self.lora_dir} is up to date ({count_text(self.steps, 'step')} on the current tables)"
            if self.unapplied:
                line += (f"; not applied, nothing was trained: {', '.join(self.unapplied)} (they act while training: "
                         f"`pipeline run train --new-run` trains again with them)")
            return line
        return train_line(self.start_step, self.steps, self.losses, self.step_epochs, self.lora_dir,
                          init_lora=self.init_lora, skipped=len(self.skipped_steps),
                          all_damaged=len(self.damaged_steps))
