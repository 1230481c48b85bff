"""A hashed setting is one the computation reads: a change to a setting the configured run does not read keeps the
run (resumes, stays up to date), a change to one it reads makes another run. Checked on the numbers the setting
feeds (the σ drawn, the optimizer's update), against the run fingerprint train compares on resume and `run all`."""

from __future__ import annotations

import torch

from schemas import config as C
from stages.train.settings import config_fingerprint, earlier_config_fingerprints

_SIGMA_PARAMETERS = ("logit_mean", "logit_std", "shift", "base_shift", "max_shift", "base_image_seq_len",
                     "max_image_seq_len")


def _drawn(sigma: C.SigmaConfig) -> torch.Tensor:
    from models.flow import sample_sigmas

    seq_lens = [64 * (i + 1) for i in range(32)]  # dynamic_shift reads each sample's length: 64 .. 2048 tokens
    return sample_sigmas(32, sigma, torch.Generator().manual_seed(0), seq_lens)


def _changed(value):
    return value * 2 + 1 if isinstance(value, int) else value * 1.5 + 0.1


def test_a_sigma_parameter_enters_the_run_fingerprint_only_under_the_sampling_that_reads_it():
    """Before: every σ parameter was hashed whatever `sigma.sampling`, so `sigma.shift` edited under logit_normal
    (the σ drawn bit for bit the same) refused the resume and `run all` trained the run again from step 0."""
    differ = []
    for sampling in ("uniform", "logit_normal", "shift", "dynamic_shift"):
        base = C.TrainConfig(dtype="float32", sigma=C.SigmaConfig(sampling=sampling))
        for name in _SIGMA_PARAMETERS:
            sigma = base.sigma.model_copy(update={name: _changed(getattr(base.sigma, name))})
            drawn_differ = not torch.equal(_drawn(sigma), _drawn(base.sigma))
            run_differs = config_fingerprint(base.model_copy(update={"sigma": sigma})) != config_fingerprint(base)
            if drawn_differ != run_differs:
                differ.append(f"{sampling}: sigma.{name} changes the σ drawn: {drawn_differ}, the run: {run_differs}")
    assert differ == []


def test_adam_settings_enter_the_run_fingerprint_only_where_the_optimizer_reads_them():
    """Adafactor takes neither adam_betas nor adam_eps: the same updates, the same run."""
    from stages.train.optimizers import build_optimizer

    def updated(cfg: C.TrainConfig) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.linspace(-1, 1, 16))
        optimizer = build_optimizer([weight], cfg)
        for _ in range(3):
            optimizer.zero_grad()
            (weight ** 3).sum().backward()
            optimizer.step()
        return weight.detach()

    for optimizer, read in (("adamw", True), ("adafactor", False)):
        base = C.TrainConfig(dtype="float32", optimizer=optimizer, learning_rate=0.01)
        for update in ({"adam_betas": (0.5, 0.9)}, {"adam_eps": 0.5}):
            changed = base.model_copy(update=update)
            assert (not torch.equal(updated(changed), updated(base))) is read, (optimizer, update)
            assert (config_fingerprint(changed) != config_fingerprint(base)) is read, (optimizer, update)


def test_runs_fingerprinted_with_an_unread_parameter_as_set_still_resume():
    """Fingerprints computed before the unread σ and Adam parameters were hashed as their defaults (commit
    f82bb71f): those runs resume and stay up to date with the same config."""
    shifted = C.TrainConfig(dtype="float32", sigma=C.SigmaConfig(shift=5.0))
    assert "35946069853d6aca" in earlier_config_fingerprints(shifted)
    uniform = C.TrainConfig(dtype="float32", sigma=C.SigmaConfig(sampling="uniform", logit_std=2.0, max_shift=1.2))
    assert "0e3da8aacaa3fd40" in earlier_config_fingerprints(uniform)
    adafactor = C.TrainConfig(dtype="float32", optimizer="adafactor", adam_eps=0.5)
    assert "1a77b1504bf44300" in earlier_config_fingerprints(adafactor)
    assert config_fingerprint(C.TrainConfig(dtype="float32")) == "13bf5ee6244deeb0"  # defaults: unchanged
    # only with the value it was made with: another shift is another spelling
    assert "35946069853d6aca" not in earlier_config_fingerprints(shifted.model_copy(
        update={"sigma": C.SigmaConfig(shift=4.0)}))
