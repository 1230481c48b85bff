"""Components load straight onto their target device (device_map, no host copy then .to), cuda:N is honoured,
and predict / lora merge ask for it per component. No GPU here: CUDA is faked and from_pretrained recorded."""

from __future__ import annotations

import pytest
import torch

from models import loading


@pytest.fixture
def fake_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_load_component_streams_onto_the_named_gpu(fake_gpus, monkeypatch, tiny_edit_model):
    from diffusers import QwenImageTransformer2DModel

    seen = {}

    class Loaded(torch.nn.Module):
        def to(self, *a, **k):  # a host copy moved afterwards would show up here
            raise AssertionError("moved after loading")

    def fake(cls, path, **kwargs):
        seen.update(kwargs)
        return Loaded()

    monkeypatch.setattr(QwenImageTransformer2DModel, "from_pretrained", classmethod(fake))
    loading.load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cuda:1")
    assert seen["device_map"] == {"": torch.device("cuda:1")}
    assert seen["torch_dtype"] == torch.bfloat16

    # quantised: filled tensor by tensor straight on the device (models/quantize.py)
    from models import quantize

    got = {}
    monkeypatch.setattr(quantize, "load_quantized_transformer",
                        lambda folder, dtype, device, name: got.update(device=device, name=name, dtype=dtype))
    loading.load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cuda:1", quantize="int8")
    assert got == {"device": torch.device("cuda:1"), "name": "int8", "dtype": torch.bfloat16}


def test_predict_and_merge_load_each_component_on_its_device(fake_gpus, monkeypatch, tiny_edit_model, tmp_path):
    from models import edit as predict, lora
    from pipeline.commands.lora import merge_lora

    calls = []
    real = loading.load_component

    def record(model, component, dtype=None, device=None, quantize="none"):
        calls.append((component, str(device) if device is not None else None, quantize))
        return real(model, component, dtype=torch.float32)  # the real object, on the CPU

    monkeypatch.setattr(predict, "load_component", record)
    predict.load_pipeline(tiny_edit_model, torch.bfloat16,
                          {"transformer": "cuda:1", "text_encoder": "cuda:0", "vae": "cpu"}, quantize="fp8")
    assert ("transformer", "cuda:1", "fp8") in calls
    assert ("text_encoder", "cuda:0", "none") in calls and ("vae", "cpu", "none") in calls

    calls.clear()
    from schemas.config import LoraConfig

    # a real LoRA: the merge reads its bytes before the load (`fused_transformer`); the load is what is shown
    transformer = real(tiny_edit_model, "transformer", dtype=torch.float32)
    lora.add_lora(transformer, LoraConfig(rank=4))
    lora.save_lora(transformer, tmp_path / "lora")
    monkeypatch.setattr(loading, "load_component", record)
    monkeypatch.setattr(lora, "attach_lora", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError, match="stop"):
        merge_lora(tiny_edit_model, tmp_path / "lora", tmp_path / "out", device="cuda:1")
    assert calls == [("transformer", "cuda:1", "none")]


def test_predict_resolves_auto_by_the_transformer_device(fake_gpus, monkeypatch, tiny_edit_model, tmp_path):
    from PIL import Image

    from models import edit
    from pipeline.commands.predict import predict
    from schemas.config import PredictConfig

    got = {}

    def stop(model, dtype, devices, *a, **k):
        got.update(dtype=dtype, devices=devices, quantize=k.get("quantize"))
        raise RuntimeError("stop")

    monkeypatch.setattr(edit, "load_pipeline", stop)
    img = tmp_path / "c.png"
    Image.new("RGB", (64, 64)).save(img)
    cfg = PredictConfig(devices={"transformer": "cuda:1", "text_encoder": "cpu", "vae": "cpu"}, quantize_base="int8")
    with pytest.raises(RuntimeError, match="stop"):
        predict(cfg, tiny_edit_model, [img], "x", tmp_path / "o.png", None, 1.0, None, None)
    assert got == {"dtype": torch.bfloat16, "devices": {"transformer": "cuda:1", "text_encoder": "cpu", "vae": "cpu"},
                   "quantize": "int8"}
    on_cpu = PredictConfig(devices={"transformer": "cpu", "text_encoder": "cpu", "vae": "cpu"})
    with pytest.raises(RuntimeError, match="stop"):
        predict(on_cpu, tiny_edit_model, [img], "x", tmp_path / "o.png", None, 1.0, None, None)
    assert got["dtype"] == torch.float32  # all on the CPU: auto = float32
    with pytest.raises(RuntimeError, match="stop"):  # the default devices, auto: the (mocked) GPU there is
        predict(PredictConfig(), tiny_edit_model, [img], "x", tmp_path / "o.png", None, 1.0, None, None)
    assert (got["dtype"], got["devices"]) == (torch.bfloat16, {"transformer": "cuda", "text_encoder": "cuda", "vae": "cuda"})


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_a_quantized_21_transformer_places_its_buffers_as_the_plain_load_does(quantize, tiny_21_model):
    """Every buffer on the load's device in the plain load's dtype: the quantised loader's empty model made
    time_proj.freqs (non-persistent, in no weight file) on the CPU and left it there (on a GPU, a host copy each
    forward). The meta device stands in for a GPU: neither load can leave a buffer on the CPU by accident."""
    if quantize == "nf4":  # the GPU machine's stack (bench/gpu/rehearse) carries bitsandbytes only on request
        pytest.importorskip("bitsandbytes")
    plain = loading.load_component(tiny_21_model, "transformer", dtype=torch.bfloat16, device="meta")
    quantized = loading.load_component(tiny_21_model, "transformer", dtype=torch.bfloat16, device="meta",
                                       quantize=quantize)
    placed = {name: (b.device.type, b.dtype) for name, b in plain.named_buffers()}
    assert placed == {"time_text_embed.time_proj.freqs": ("meta", torch.float32)}
    assert {name: (b.device.type, b.dtype) for name, b in quantized.named_buffers()} == placed
