"""The one place models are loaded: a local folder or a hub id, one component at a time.

Stages load only the component they need (encode-text: text encoder + processor; encode-vae: VAE;
train: transformer), so `load_component` is the entry point and never builds a whole pipeline.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from models.file_hashes import FileHashes
from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.model_files import ModelFile, fingerprint_of

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that make devices and load weights: reading a folder's configs
# (`resolve_model`, `model_variant`: `pipeline plan`, every command's checks of --model) needs none of it, and a
# mistyped model path is told in about a second instead of after torch's import

Component = Literal["transformer", "vae", "text_encoder", "processor", "tokenizer", "scheduler"]

_CLASSES: dict[str, tuple[str, str]] = {
    "transformer": ("diffusers", "QwenImageTransformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
    "processor": ("transformers", "Qwen2VLProcessor"),
    "tokenizer": ("transformers", "Qwen2Tokenizer"),
}

# Qwen-Image-2.1 folders hold other classes under the same component names (models/tiny21.py builds one).
_CLASSES_21: dict[str, tuple[str, str]] = {
    **_CLASSES,
    "transformer": ("diffusers", "QwenImage21Transformer2DModel"),
    "vae": ("diffusers", "AutoencoderKLQwenImage21"),
    "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration"),
    "processor": ("transformers", "Qwen3VLProcessor"),
}
QWEN21_PIPELINE = "QwenImage21Pipeline"
_EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")  # edit; edit-plus and edit-2511

# Every load that happened in this process, as (model, component): tests assert a stage loads only what it needs.
LOAD_LOG: list[tuple[str, str]] = []


class ModelNotFoundError(UserError):
    """No such model folder or hub id (or no network): the CLI prints it as one line, no traceback."""


@lru_cache(maxsize=16)
def resolve_model(model: str) -> Path:
    """Local folder as is; otherwise a hub id resolved through the HF cache (downloads when online)."""
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "model_index.json").is_file():
            raise ModelNotFoundError(
                f"{p} is a folder but has no model_index.json: expected a diffusers Qwen-Image-Edit folder "
                "(e.g. one written by `pipeline make-tiny-model`)."
            )
        _check_complete(p)
        return p.resolve()
    if p.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFoundError(
            f"model {model!r} is neither a model folder nor a hub id (owner/name). "
            "Build a small offline one with `pipeline make-tiny-model DIR`."
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]))
    except Exception as e:  # offline, unknown id, gated repo…
        from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        not_built = f"{p.parent} has no {p.name!r}: build it (`pipeline make-tiny-model {p} --variant ...`) or fix the path"
        # As diffusers' from_pretrained: a name that is no folder is a hub id. Only the hub's own "no such repo"
        # (or a name it cannot hold) makes it a local path not built yet; when the hub could not be asked (offline,
        # no network), `./Qwen` existing says nothing about `Qwen/Qwen-Image-Edit-2509`: both are named.
        if p.parent.is_dir() and (isinstance(e, HFValidationError)
                                  or isinstance(e, RepositoryNotFoundError) and not isinstance(e, GatedRepoError)):
            raise ModelNotFoundError(f"no model folder {p} ({not_built}), and no hub id {model!r} either "
                                     f"({type(e).__name__})") from None
        from huggingface_hub.errors import LocalEntryNotFoundError

        why = (f"it is not in the Hugging Face cache{' and HF_HUB_OFFLINE is set' if offline else ' (no network?)'}"
               if isinstance(e, LocalEntryNotFoundError) else f"{type(e).__name__}: {' '.join(str(e).split())}")
        local = f"; if you meant a local folder: {not_built}" if p.parent.is_dir() else ""
        raise ModelNotFoundError(
            f"cannot load model {model!r} from the hub: {why}. Download it once online, or pass a local folder "
            f"(`pipeline make-tiny-model DIR` builds a tiny offline one){local}"
        ) from None


def model_variant(model: str) -> Literal["edit", "edit-plus", "edit-2511", "qwen-image-2.1"]:
    """edit (Qwen-Image-Edit), edit-plus (2509: several controls), edit-2511 (the Plus pipeline over a
    transformer with `zero_cond_t`: control tokens modulated at t = 0) or qwen-image-2.1 (`QwenImage21Pipeline`:
    0..10 references, block-causal transformer, Qwen3-VL)."""
    root = resolve_model(model)
    index = json.loads((root / "model_index.json").read_text())
    named = index.get("_class_name")
    if named == QWEN21_PIPELINE:
        return "qwen-image-2.1"
    if isinstance(named, str) and named not in _EDIT_PIPELINES:
        # Qwen-Image-Layered, the text-to-image Qwen-Image, ...: the Edit classes load their components, so the
        # model encoded and trained as Qwen-Image-Edit without a word (any class without "Plus" was "edit")
        raise UserError(f"model {model} is a {named} (its model_index.json): this pipeline trains "
                        f"{', '.join(_EDIT_PIPELINES)} and {QWEN21_PIPELINE} models only; pass one of those")
    if named != "QwenImageEditPlusPipeline":  # (a folder whose index names no class: as before, the Edit model)
        return "edit"
    config = root / "transformer" / "config.json"
    zero_cond = config.is_file() and json.loads(config.read_text()).get("zero_cond_t", False)
    return "edit-2511" if zero_cond else "edit-plus"


def check_sampling_steps(steps: int, setting: str, model: str) -> None:
    """Refuse one denoising step where the model's scheduler cannot take it: one that stretches its σs to
    `shift_terminal` (the Edit models': 0.02) divides 0 by 0 at a single step, and every image is NaN (a flat
    black PNG). Qwen-Image-2.1's has no stretch and samples in one step; a 2.1 folder that fixes its sample_sigmas
    samples at those whatever the steps."""
    if steps >= 2:
        return
    root = resolve_model(model)
    config = root / "scheduler" / "scheduler_config.json"
    terminal = json.loads(config.read_text()).get("shift_terminal") if config.is_file() else None
    if not terminal or json.loads((root / "model_index.json").read_text()).get("sample_sigmas"):
        return
    raise UserError(f"{setting} = {steps}: the scheduler of {model} stretches its sigmas to shift_terminal "
                    f"{terminal}, which divides 0 by 0 at one step (every image NaN); set {setting} to 2 or more")


def pipeline_family(variant: str) -> Literal["edit", "edit-plus", "qwen-image-2.1"]:
    """The diffusers pipeline a variant runs with: 2511 uses the Edit-Plus pipeline, prompts and controls."""
    if variant == "qwen-image-2.1":
        return "qwen-image-2.1"
    return "edit" if variant == "edit" else "edit-plus"


def _known_digest(f: Path, hashes: FileHashes) -> str | None:
    """sha256 of a file's bytes when known without reading them: Hub snapshots link to blobs named by that hash;
    other files are remembered by (path, size, mtime, ctime) once read, so a 40 GB model is hashed once, not per
    stage run."""
    real = Path(os.path.realpath(f))
    if "blobs" in real.parts and len(real.name) == 64:
        return real.name
    return hashes.cached(real)


@lru_cache(maxsize=16)
def _check_complete(folder: Path) -> None:
    """Every component model_index.json names has its folder, and every JSON config parses: otherwise the damage
    is named here, not later as a model of a different fingerprint or a loader's traceback."""
    import json

    def parsed(path: Path):
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
            raise ModelNotFoundError(f"model folder {folder} is damaged: {path.relative_to(folder)} is not valid "
                                     f"JSON ({e}); restore it from the original download") from None

    index = parsed(folder / "model_index.json")
    if not isinstance(index, dict):
        raise ModelNotFoundError(f"model folder {folder} is damaged: model_index.json is not a JSON object")
    # a component is [library, class] (strings); other entries are pipeline settings (2.1's sample_sigmas: floats)
    missing = sorted(name for name, spec in index.items() if not name.startswith("_") and isinstance(spec, list)
                     and len(spec) == 2 and isinstance(spec[0], str) and not (folder / name).is_dir())
    if missing:
        raise ModelNotFoundError(f"model folder {folder} is incomplete: component folder(s) {missing} named in "
                                 "model_index.json are missing; restore them from the original download")
    for config in sorted(folder.glob("*/*config*.json")):
        parsed(config)


def model_fingerprint(model: str) -> str:
    """Hash of every file of the model folder (names + full contents; not hidden ones): any changed weight is a
    new model."""
    return fingerprint_of(model_files(model))


def model_files(model: str) -> tuple[ModelFile, ...]:
    """Every file of the model folder with its size and sha256 (schemas/model_files.py): one walk gives both the
    fingerprint (`fingerprint_of`) and the record an encoder stores or a refusal compares, so the folder is not
    walked twice."""
    return _folder_files(resolve_model(model), None)


@lru_cache(maxsize=32)
def component_fingerprint(model: str, components: tuple[str, ...]) -> str:
    """Hash of the files of the named component subfolders only (e.g. ("vae",)): what a stage's features depend
    on, so another model sharing the same VAE files (Edit -> Edit-2509) reuses the stored latents."""
    root = resolve_model(model)
    present = tuple(c for c in components if (root / c).is_dir())  # e.g. a model without a separate tokenizer
    if not present:
        raise ModelNotFoundError(f"model {model!r} has none of the folders {list(components)} in {root}")
    return _files_fingerprint(root, present)


def _files_fingerprint(root: Path, components: tuple[str, ...] | None) -> str:
    return fingerprint_of(_folder_files(root, components))


def _folder_files(root: Path, components: tuple[str, ...] | None) -> tuple[ModelFile, ...]:
    """Hidden files and folders are no part of the model: `hf download --local-dir` keeps its bookkeeping in
    ROOT/.cache/huggingface/ and rewrites it (a fresh timestamp) on every rerun, which changed the fingerprint of
    unchanged weights (every table re-encoded, every run retrained); `.git` likewise. Sorted by path parts."""
    found = root.rglob("*") if components is None else (f for c in components for f in (root / c).rglob("*"))
    # by path parts, explicitly (what Path's own ordering has always been): "a/b" before "a.b/c", on any Python
    files = sorted((f for f in found if not any(part.startswith(".") for part in f.relative_to(root).parts)),
                   key=lambda f: f.relative_to(root).parts)
    out = []
    with FileHashes() as hashes, hashes.alone(str(root)):  # the ranks of a node: one reads, the others find it cached
        known = [(f, _known_digest(f, hashes)) for f in files if f.is_file()]
        todo = sum(f.stat().st_size for f, digest in known if digest is None)
        # bytes read and hashed (rate, ETA): shown by the process that reads them, not by one finding them cached
        with byte_bar(todo, f"hash {root.name}", disable=todo == 0) as bar:
            for f, digest in known:
                size = f.stat().st_size
                if digest is None:
                    digest = hashes.sha256(f)
                    bar.update(size)
                out.append(ModelFile(f.relative_to(root).as_posix(), size, digest))
    return tuple(out)


def check_device(device: str | torch.device, what: str) -> torch.device:
    """The device (`auto` resolved: `models.precision.resolve_auto`), or a UserError naming the setting when it
    does not exist on this machine."""
    import torch

    from models.precision import resolve_auto

    device = resolve_auto(device) if isinstance(device, str) else device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"{what}: {device!r} is not a device name (use e.g. cpu, cuda, cuda:1): {e}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index is not None and dev.index >= count):
            raise UserError(f"{what}: {device!r} requested but this machine has {count} CUDA device(s); "
                            "pass cpu or run on a GPU machine")
    return dev


def load_component(
    model: str,
    component: Component,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str = "none",
):
    """Load one pipeline component from its subfolder with the stock class, straight onto `device`.

    `quantize` (transformer only): none | int8 | fp8 | nf4, applied while the weights load (models/quantize.py)."""
    import importlib

    import torch

    root = resolve_model(model)
    lib, name = (_CLASSES_21 if model_variant(model) == "qwen-image-2.1" else _CLASSES)[component]
    cls = getattr(importlib.import_module(lib), name)
    sub = root / component
    if not sub.is_dir():
        raise ModelNotFoundError(f"model {model!r} has no '{component}' folder ({sub})")
    if component in ("processor", "tokenizer"):
        _check_tokenizer_files(root, sub)
    _check_component_class(root, sub, cls)
    LOAD_LOG.append((str(model), component))
    kwargs: dict = {}
    if component in ("transformer", "vae", "text_encoder") and dtype is not None:
        kwargs["torch_dtype"] = dtype
    if device is not None:
        device = check_device(device, f"device of the {component}")
    if component in ("transformer", "vae", "text_encoder") and device is not None and torch.device(device).type != "cpu":
        # Stream the weights straight onto the accelerator: N ranks on one host must not each hold a full copy
        # of a 40 GB transformer in host RAM first. (Unverified on a GPU in this project's CI: none is lent.)
        kwargs["device_map"] = {"": torch.device(device)}
    if quantize not in ("none", None) and component != "transformer":
        raise ValueError(f"quantize is for the transformer, not the {component}")
    try:
        if quantize not in ("none", None):
            from models.quantize import load_quantized_transformer

            # Quantised tensor by tensor as the shards are read, straight on the device (models/quantize.py).
            return load_quantized_transformer(sub, dtype or torch.bfloat16, torch.device(device or "cpu"), quantize)
        obj = cls.from_pretrained(sub, **kwargs)
    except Exception:
        # A weight file cut short (an interrupted download or copy) surfaces as safetensors' header error
        # inside the loader's traceback, naming no fix: name the file and what to do instead.
        problem = _damaged_weight_file(sub)
        if problem is None:
            raise
        raise ModelNotFoundError(f"model folder {root} is damaged: {problem}; restore it from the original download "
                                 "(an interrupted download or copy leaves a file short)") from None
    if device is not None and "device_map" not in kwargs and component in ("transformer", "vae", "text_encoder"):
        obj = obj.to(device)  # the CPU: from_pretrained already put it there, this is a no-op
    if hasattr(obj, "eval"):
        obj.eval()
    return obj


def check_weight_files(model: str) -> None:
    """Every weight file of the transformer, VAE and text encoder is there and whole (safetensors headers only):
    `pipeline run all` asks before resize-bucket and the encoders, not when train loads a transformer whose
    file a partial copy left out."""
    root = resolve_model(model)
    for component in ("text_encoder", "vae", "transformer"):
        if (root / component).is_dir() and (problem := _damaged_weight_file(root / component)) is not None:
            raise ModelNotFoundError(f"model folder {root} is damaged: {problem}; restore it from the original "
                                     "download")


def _check_component_class(root: Path, folder: Path, cls: type) -> None:
    """A component folder of another model (a transformer, VAE or text encoder copied in from an Edit folder into a
    2.1 one, or back) is refused by what its config.json names. Before, diffusers failed with a shape traceback,
    and transformers loaded the text encoder with every weight left at random init (a warning table). A
    transformers config is judged by its `model_type` (the architecture family: another head class of the same
    model, e.g. `Qwen2_5_VLModel`, loads the same weights), a diffusers one by its `_class_name`."""
    config = folder / "config.json"
    if not config.is_file():
        return
    record = json.loads(config.read_text(encoding="utf-8"))  # parsed already by _check_complete
    if not isinstance(record, dict):
        return
    expected_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    if "_class_name" not in record and isinstance(expected_type, str) and isinstance(record.get("model_type"), str):
        named, expected = record["model_type"], expected_type
        what = "model_type"
    else:
        named, expected, what = record.get("_class_name"), cls.__name__, "class"
    if isinstance(named, str) and named != expected:
        raise ModelNotFoundError(f"model folder {root} is mixed: {folder.name}/config.json names {what} {named}, but "
                                 f"this model (model_index.json) loads {cls.__name__} ({what} {expected}) there; "
                                 f"restore the {folder.name} folder of this model from its original download")


def _check_tokenizer_files(root: Path, folder: Path) -> None:
    """A processor / tokenizer folder without its vocabulary loads without error as a tokenizer of the special
    tokens alone: every prompt word then encodes to nothing (silently wrong embeddings), or the VLM fails later
    on image tokens it cannot find. Refused here, naming the files."""
    if (folder / "tokenizer.json").is_file() or all((folder / f).is_file() for f in ("vocab.json", "merges.txt")):
        return
    raise ModelNotFoundError(f"model folder {root} is incomplete: {folder.name}/ has no tokenizer.json (nor both "
                             "vocab.json and merges.txt), so its tokenizer would hold only the special tokens; "
                             "restore them from the original download")


def _damaged_weight_file(folder: Path) -> str | None:
    """The first weight file of a component folder that its index names but that is missing, or that is not a
    whole safetensors file (safetensors checks the header and that the file covers every tensor it lists), as
    `path (why)`; None when every file is whole. Only headers are read."""
    from safetensors import safe_open

    names = {f.name for f in folder.glob("*.safetensors")}
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            names |= set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index.relative_to(folder.parent)} is not a weight index ({type(e).__name__}: {e})"
    if not names and not any(folder.glob("*.bin")):  # the loader's OSError lists file names, not the fix
        return f"{folder.name}/ has no weight file (*.safetensors) next to its config.json"
    for name in sorted(names):
        path = folder / name
        if not path.is_file():
            return f"{path.relative_to(folder.parent)} is missing"
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except Exception as e:  # SafetensorError (not an OSError subclass), OSError
            return f"{path.relative_to(folder.parent)} is not a whole safetensors file ({type(e).__name__}: {e})"
    return None


def parse_dtype(name: str) -> torch.dtype:
    """A resolved dtype setting (float32, bfloat16, float16) as a torch dtype. `auto` is refused: it depends on the
    device, and is decided once, before anything loads (models/precision.py `resolve_precision` / `resolve_dtype`);
    looked up here it would be float32 whatever the device."""
    from models.precision import resolve_dtype

    if name == "auto":
        raise ValueError("parse_dtype('auto'): resolve the setting for its device first (models.precision."
                         "resolve_dtype); a name alone cannot say what auto is")
    return resolve_dtype(name, "cpu")  # a concrete name: the device plays no part
