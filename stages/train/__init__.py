"""The `train` stage: `text` + `vae` tables -> a LoRA run folder.

`recipe.run` is the entry (setup -> step -> log -> checkpoint -> finish -> cleanup; the phases besides the step
in `settings`, `start`, `build`, `schedule`, `saving`, `result`, `current`); `data` opens the joined inputs and
draws per-sample randomness, `sampler` batches by length, `state` is the checkpoint / resume record.
"""
