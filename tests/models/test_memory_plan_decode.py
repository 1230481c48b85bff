"""`pipeline plan`'s VAE terms. The decode (the training sample grid's float32 decode, evaluate's and predict's)
was not planned, and at 1024² its feature maps (3.4 GiB in bf16, 6.8 GiB in float32 for the Edit VAE) can exceed
a checkpointed step's activations; encode-vae's activations were "a handful of feature maps", 9.0 GiB for a
batch of 8 at 1024² where the pass holds 15.1 GiB. Both are now the pass traced on fake tensors from the VAE
config (`models.memory_plan.vae_pass_bytes`), checked here against the storages a real pass of the tiny models
allocates, counted while they are alive (a dispatch mode independent of the tracer the plan uses)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from typer.testing import CliRunner

from models import memory_plan as mp


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages the ops allocate that are alive at once (one is freed with its last reference)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.owned: dict[int, weakref.finalize] = {}

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.owned.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key in self.owned or key in inputs:  # a view, or an op writing into its input
                    continue
                n = storage.nbytes()
                self.owned[key] = weakref.finalize(storage, self._free, key, n)
                self.live += n
                self.peak = max(self.peak, self.live)
        return out


@pytest.mark.parametrize("fixture", ["tiny_edit_model", "tiny_21_model"])
def test_planned_decode_is_the_live_tensors_of_a_real_decode(fixture, request):
    """The VAE as evaluate loads it, a real decode at two sizes: the planned bytes are the peak of the live
    tensors (Edit: equal to the byte; 2.1: within 0.5 %), and grow with the image (4x the pixels, ~4x)."""
    from models.loading import load_component

    model = request.getfixturevalue(fixture)
    vae = load_component(model, "vae", dtype=torch.float32)
    _, scale = mp.vae_class(model)
    measured = {}
    for h, w in ((64, 48), (128, 96)):
        with torch.no_grad(), LiveBytes() as live:  # the latents counted: on the device through the decode
            latents = torch.randn(1, vae.config.z_dim, 1, h // scale, w // scale,
                                  generator=torch.Generator().manual_seed(0))
            vae.decode(latents, return_dict=False)
        planned = mp.vae_decode_bytes(model, "float32", h, w)
        assert abs(planned - live.peak) <= 0.005 * live.peak, (h, w, planned, live.peak)
        if fixture == "tiny_edit_model":
            assert planned == live.peak
        measured[h] = live.peak
    assert 3.5 < measured[128] / measured[64] < 4.5


def test_plans_count_the_decode_where_it_exceeds_the_activations(tiny_edit_model):
    """Train (sample grids on: the float32 VAE) and evaluate add the decode only above the activations it replaces
    (a sample grid runs between steps; evaluate decodes after the last denoising step)."""
    decode32 = mp.vae_decode_bytes(tiny_edit_model, "float32", 256, 256)
    plan = mp.train_plan(tiny_edit_model, "float32", "none", 1, 64, True, 4, sample_vae=True, sample_size=(256, 256))
    step = plan.parts["activations"] + plan.parts["backward working set"]
    assert decode32 > step and plan.parts["sample-grid VAE decode above the activations"] == decode32 - step
    assert "sample-grid VAE decode above the activations" not in mp.train_plan(
        tiny_edit_model, "float32", "none", 1, 64, True, 4, sample_size=(256, 256)).parts  # no sample grids
    inference = mp.inference_plan(tiny_edit_model, "float32", "none", 64, image_size=(256, 256))
    assert inference.parts["VAE decode above the activations"] == decode32 - inference.parts["activations"]
    assert inference.parts["VAE"] == mp.component_params(tiny_edit_model, "vae") * 4
    big_step = mp.train_plan(tiny_edit_model, "float32", "none", 64, 4096, False, 4, sample_vae=True,
                             sample_size=(256, 256)).parts
    assert not any("decode" in name for name in big_step)  # activations above the decode: it adds nothing


def test_plan_command_shows_the_decode_of_a_1024_sample_grid():
    """The published Edit-2509 at 1024², one control, a checkpointed batch-1 step: its activations (4.6 GiB with
    the backward's working set) are below the float32 decode's 6.8 GiB, so the plan was 2.1 GiB under the peak."""
    from pipeline.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "Qwen/Qwen-Image-Edit-2509", "--set", "train.batch_size=1",
                                      "--set", "train.gradient_checkpointing=true", "--set", "train.sample_every=100",
                                      "--set", "resize.max_controls=1"])
    assert result.exit_code == 0, result.output
    decode = mp.vae_decode_bytes("Qwen/Qwen-Image-Edit-2509", "float32", 1024, 1024)
    assert 6.5 * 2**30 < decode < 7 * 2**30  # (traced: 6.76 GiB)
    train = next(line for line in result.output.splitlines() if line.strip().startswith("train "))
    assert "sample-grid VAE decode above the activations" in train
    evaluate = next(line for line in result.output.splitlines() if line.strip().startswith("evaluate"))
    assert "VAE decode above the activations" in evaluate


@pytest.mark.parametrize("fixture", ["tiny_edit_model", "tiny_21_model"])
def test_planned_vae_encode_is_the_live_tensors_of_a_real_batch_encode(fixture, request):
    """encode-vae's activations: a batch of 2 images encoded as the encode stage does (`vae.encode`), measured."""
    from models.loading import load_component

    model = request.getfixturevalue(fixture)
    vae = load_component(model, "vae", dtype=torch.float32)
    channels = getattr(vae.config, "input_channels", None) or vae.config.in_channels
    with torch.no_grad(), LiveBytes() as live:  # the pixels counted: on the device through the encode
        pixels = torch.rand(2, channels, 1, 64, 64, generator=torch.Generator().manual_seed(0)).mul_(2).sub_(1)
        vae.encode(pixels)
    planned = mp.vae_pass_bytes(model, "float32", 64, 64, encode=True, batch=2)
    assert abs(planned - live.peak) <= 0.005 * live.peak, (planned, live.peak)
    assert mp.encode_plan(model, "vae", "float32", 2, 64 * 64 // 256).parts["activations"] == planned


def _evaluate_line(*args: str) -> str:
    from pipeline.cli import app

    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 0, result.output
    return next(line for line in result.output.splitlines() if line.strip().startswith("evaluate"))


def test_the_evaluate_plan_holds_the_held_out_losss_rows_a_forward(tiny_21_model):
    """evaluate's held-out loss runs evaluate.batch_size rows a forward (8 by default); the plan held two (a
    picture's true CFG): a quarter of the default's activations (2509 at its planned sample: 1.58 GiB for 6.3).
    2.1's block-causal mask (S² a row) is counted as the train plan counts it; it was absent."""
    eight = _evaluate_line("--model", "Qwen/Qwen-Image-Edit-2509", "--set", "evaluate.batch_size=8")
    two = _evaluate_line("--model", "Qwen/Qwen-Image-Edit-2509", "--set", "evaluate.batch_size=2")
    activations = [float(line.split("activations ")[1].split(" GiB")[0]) for line in (eight, two)]
    assert activations[0] == pytest.approx(4 * activations[1], rel=1e-2), (eight, two)
    assert "block-causal mask" not in eight
    plan = mp.inference_plan(tiny_21_model, "float32", "none", 300, cfg_batch=8)
    assert plan.parts["block-causal mask"] == mp.qwen21_mask_bytes(8, 300, 4, 1)
    assert "block-causal mask" in _evaluate_line("--model", tiny_21_model)
