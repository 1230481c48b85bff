"""LoRA handling in one place: add an adapter, save only the adapter (diffusers format), the one loader, fusing.

The saved folder is what `QwenImageEditPipeline.from_pretrained(MODEL).load_lora_weights(DIR)` expects:
`pytorch_lora_weights.safetensors` with `transformer.`-prefixed peft keys, plus the adapter's `LoraConfig` in
the safetensors metadata (`lora_adapter_metadata`, as diffusers writes and reads it) so any reader rebuilds the
same rank/alpha/targets (without it diffusers would assume alpha == rank).

One loader: `read_lora` reads and checks the file; `load_lora` puts it into an existing adapter (resume),
`attach_lora` builds an adapter from the file's own config first (evaluate, predict, merge). diffusers'
`load_lora_weights` is the reference it is tested against, not a second code path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from schemas.errors import UserError
from models.lora_files import WEIGHT_NAME, lora_weight_file, weight_file_name  # noqa: F401  (callers' names)

ADAPTER = "default"  # the trainer's adapter
_PREFIX = "transformer."
_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY (loaders/lora_base.py)
_ADAPTER_TAGS = (".lora_", ".hada_", ".lokr_")  # peft parameter names of LoRA/DoRA, LoHa, LoKr


class LoraSettings(Protocol):
    """What `add_lora` reads (`schemas.config.LoraConfig` has exactly these fields)."""

    rank: int
    alpha: float | None
    dropout: float
    target_modules: list[str]
    init_weights: str


def adapter_config(cfg: LoraSettings):
    """The peft config of `cfg.kind` (default `lora`): LoRA, DoRA (LoRA + a learned magnitude per output),
    LoHa (Hadamard product of two low-rank pairs) or LoKr (Kronecker product) on `cfg.target_modules`."""
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    kind = getattr(cfg, "kind", "lora")
    alpha = cfg.alpha if cfg.alpha is not None else cfg.rank
    if kind in ("lora", "dora"):
        return PeftLoraConfig(
            r=cfg.rank, lora_alpha=alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
            init_lora_weights=True if cfg.init_weights == "default" else cfg.init_weights, use_dora=kind == "dora",
        )
    cls = {"loha": LoHaConfig, "lokr": LoKrConfig}[kind]
    # peft's LoHa/LoKr init (one factor zero): the adapter starts as the identity, like LoRA's B = 0.
    return cls(r=cfg.rank, alpha=alpha, module_dropout=cfg.dropout, target_modules=list(cfg.target_modules))


@contextmanager
def _no_torchao_merge_warning() -> Iterator[None]:
    """peft warns, per adapter built on a torchao-quantised base, that such a base cannot merge/unmerge: nothing
    here merges into a quantised base (training and evaluate keep the adapter apart; `fused_transformer` loads the
    base unquantised), so the warning would only be noise in every quantised run's output."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
        yield


def refuse_lycoris_on_nf4(transformer, config, what: str) -> None:
    """A LoHa / LoKr adapter on an NF4 base (quantize_base nf4), refused in one line: peft's LoHa and LoKr shape
    their delta weight by the base layer's `weight.shape`, and a bitsandbytes `Params4bit`'s is its packed codes
    ([out x in / 2, 1]): LoHa built its factors at that shape and every forward failed on a shape mismatch, as
    did LoKr's (torchao's int8 / fp8 weights report their logical shape and work; LoRA / DoRA never read it)."""
    from models.quantize import is_nf4
    from schemas.config import lycoris_on_nf4

    if config.peft_type not in ("LOHA", "LOKR"):  # a str enum
        return
    if any(is_nf4(p) for p in transformer.parameters()):
        raise UserError(lycoris_on_nf4(what))


def add_lora(transformer, cfg: LoraSettings) -> None:
    """Freeze the base and attach one trainable adapter (peft; `cfg.kind`) to `cfg.target_modules`."""
    transformer.requires_grad_(False)
    from peft.tuners.tuners_utils import NoMatchingPeftModuleError

    names = _linear_names(transformer)  # before peft wraps them (base_layer, lora_A.default, ...)
    config = adapter_config(cfg)
    refuse_lycoris_on_nf4(transformer, config, f"train.lora.kind {getattr(cfg, 'kind', 'lora')}")
    refuse_rank_above_width(transformer, cfg)
    try:
        with _no_torchao_merge_warning():
            transformer.add_adapter(config, adapter_name=ADAPTER)
    except NoMatchingPeftModuleError:
        raise UserError(f"train.lora.target_modules {list(cfg.target_modules)} matches no layer of the model; its "
                        f"linear layers are named {names}") from None
    # peft adapts the names that match and drops the others without a word: the Edit MLP's (net.0.proj) on a
    # Qwen-Image-2.1 model, or 2.1's (gate_layer) on an Edit one, trained the attention alone
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [n for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)]
    unmatched = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in adapted)]
    if unmatched:
        raise UserError(f"train.lora.target_modules {unmatched} match no layer of the model (the others do); its "
                        f"linear layers are named {names}; drop them or name this model's layers")
    # LoRA weights train in float32 even when the frozen base is bf16 (optimizer states stay exact).
    for p in lora_parameters(transformer):
        p.data = p.data.float()


def refuse_rank_above_width(transformer, cfg: LoraSettings) -> None:
    """A rank above the smallest adapted layer's width (min of its in and out features), refused in one line before
    any adapter weight is allocated: B @ A cannot exceed that rank, so the rest is memory and compute that trains
    nothing (the config's static cap, schemas/config.py `Rank`, cannot know the model's widths). Not for LoKr:
    peft's rank there sizes the low-rank pair of a Kronecker factor smaller than the layer, and a rank at or above
    half that factor's larger side makes it a full matrix instead (LyCORIS's full-matrix idiom, a rank of 10000)."""
    if getattr(cfg, "kind", "lora") == "lokr":
        return
    widths = {n: min(m.in_features, m.out_features) for n, m in transformer.named_modules()
              if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in cfg.target_modules)}
    if not widths or cfg.rank <= min(widths.values()):
        return
    name = min(widths, key=widths.get)
    raise UserError(f"train.lora.rank {cfg.rank} is above the width of the adapted layer {name} ({widths[name]}, the "
                    f"smaller of its in and out features): a LoRA's update cannot have a higher rank; set "
                    f"train.lora.rank to at most {widths[name]}, or leave that layer out of train.lora.target_modules")


def _linear_names(transformer) -> list[str]:
    """The last part of each linear layer's name (to_q, net.0.proj's proj), as a target_modules entry matches."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)})


def lora_parameters(transformer) -> list[torch.nn.Parameter]:
    """The trainable adapter parameters, in a stable (module) order: the optimizer's param order."""
    return [p for n, p in transformer.named_parameters() if any(t in n for t in _ADAPTER_TAGS) and p.requires_grad]


def lora_state_dict(transformer, adapter_name: str = ADAPTER) -> dict[str, torch.Tensor]:
    """Adapter weights only, peft key names without the adapter name (`...to_q.lora_A.weight`).

    (diffusers' `load_lora_weights` names its adapter `default_0`: pass that to read a pipeline's LoRA.)
    """
    from peft.utils import get_peft_model_state_dict

    # peft warns of 1-D LoRA tensors as ZeRO-3 shards never gathered; a LoRA bias (`lora_B.bias`, a file written
    # with lora_bias, which `attach_lora` applies as diffusers does) is 1-D by design: that warning alone is dropped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = get_peft_model_state_dict(transformer, adapter_name=adapter_name)
    biases_only = all(k.endswith(".lora_B.bias") for k, v in state.items()
                      if (".lora_A" in k or ".lora_B" in k) and (v.dim() < 2 or 0 in v.shape))
    for w in caught:
        if not (biases_only and "LoRA tensor(s) have invalid shape" in str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return state


def save_lora(transformer, out_dir: str | Path, fold_alpha: bool = False, base_fingerprint: str | None = None,
              adapter_name: str = ADAPTER, values: dict[str, torch.Tensor] | None = None) -> Path:
    """Write only the adapter, in the diffusers LoRA format; returns the weight file.

    `fold_alpha` (the final LoRA): each module's alpha / r is multiplied into its lora_B and the saved config says
    alpha = r, so loaders that ignore the metadata (ComfyUI, musubi-tuner's converter: they take alpha = rank)
    apply the same weights as diffusers. Checkpoints stay unfolded: resume needs the trained values exactly
    (x * s / s is not x in floating point). `base_fingerprint`: the base model's fingerprint
    (`models.loading.model_fingerprint`), recorded so predict / merge can tell a LoRA trained on another model.
    `adapter_name`: the trainer's adapter, or evaluate's ("lora": a checkpoint's EMA written as a LoRA, unfolded).
    `values`: the adapter's state to write instead of the transformer's own (its keys), e.g. a float32 EMA that
    evaluate loaded into a bf16 adapter: written as the file holds it, not rounded to the adapter's dtype."""
    from diffusers import QwenImageEditPipeline

    from models.canonical_safetensors import canonicalize

    out_dir = Path(out_dir)
    if fold_alpha and adapter_name != ADAPTER:
        raise ValueError("fold_alpha folds the trainer's adapter only")
    own = lora_state_dict(transformer, adapter_name)
    if values is not None and values.keys() != own.keys():
        raise ValueError("values: not the adapter's keys")
    state = {k: v.detach().to("cpu").contiguous() for k, v in (own if values is None else values).items()}
    config = _sets_sorted(transformer.peft_config[adapter_name].to_dict())
    extra = {_BASE_KEY: base_fingerprint} if base_fingerprint else {}
    extra[_CLASS_KEY] = _transformer_class(transformer)
    if fold_alpha and _is_plain_lora(config) and _has_scaling(transformer):
        state, config = _folded(transformer, state, config)
        extra[_FOLDED_KEY] = "1"
    QwenImageEditPipeline.save_lora_weights(
        out_dir,
        transformer_lora_layers=state,
        transformer_lora_adapter_metadata=config,
        weight_name=WEIGHT_NAME,
    )
    # diffusers' writer takes only its adapter config: our keys are added as the header is made canonical (the
    # same weights, the same bytes, from any process: what names a checkpoint, `models.canonical_safetensors`)
    canonicalize(out_dir / WEIGHT_NAME, extra)
    return out_dir / WEIGHT_NAME


def _sets_sorted(config: dict) -> dict:
    """peft's config with its sets (`target_modules`, ...) as sorted lists: diffusers writes `list(a_set)`, in
    the str hash order of the process (PYTHONHASHSEED), so the same adapter's metadata differed from run to run."""
    return {k: sorted(v, key=str) if isinstance(v, (set, frozenset)) else v for k, v in config.items()}


_BASE_KEY = "base_model_fingerprint"  # our own metadata keys, beside diffusers' (which its loader ignores)
_FOLDED_KEY = "alpha_folded_into_lora_B"
# The model family: a LoRA of another transformer class (Qwen-Image-2.1 vs the Edit models) is never right, and
# the tiny models of both share module names and shapes, so nothing else would tell.
_CLASS_KEY = "base_model_class"


def provenance(lora: str | Path) -> dict[str, str]:
    """The metadata that says which model a LoRA was trained on (its base fingerprint, its transformer class), for
    a writer of another format to carry over: without them a converted file applied to another model family or
    base without a word."""
    meta = _metadata(lora_weight_file(lora), None)
    return {k: meta[k] for k in (_BASE_KEY, _CLASS_KEY) if isinstance(meta.get(k), str)}


def _transformer_class(transformer) -> str:
    return type(getattr(transformer, "_orig_mod", transformer)).__name__  # torch.compile wraps it


def _metadata(path: Path, data: bytes | None) -> dict:
    """The safetensors metadata of the file, or of its bytes already read (`data`): the format's header is an
    8-byte little-endian length and that many bytes of JSON, whose `__metadata__` holds it."""
    if data is None:
        with safe_open(path, framework="pt") as f:
            return f.metadata() or {}
    size = int.from_bytes(data[:8], "little")
    return json.loads(bytes(data[8 : 8 + size])).get("__metadata__") or {}


def check_lora_family(transformer, lora: str | Path, data: bytes | None = None) -> None:
    """Refuse (one line) a LoRA whose recorded transformer class is not this transformer's. `data`: the file's
    bytes, already read."""
    try:
        recorded = _metadata(lora_weight_file(lora) if data is None else weight_file_name(lora), data).get(_CLASS_KEY)
    except (ValueError, AttributeError):  # bytes that are no safetensors header: read_lora names the file
        return
    _refuse_other_family(lora, recorded, _transformer_class(transformer))


def _refuse_other_family(lora, recorded, now: str | None) -> None:
    if isinstance(recorded, str) and isinstance(now, str) and recorded != now:
        raise UserError(f"LoRA {lora} was trained on a {recorded} and this model's transformer is a {now}: a LoRA "
                        "of another model family does not apply; pass a LoRA trained on this --model")


def check_family_before_loading(lora: str | Path, model: str) -> None:
    """`check_lora_family` from the class the model folder's transformer/config.json names: a LoRA of the other
    family (2.1 vs Edit) is refused before the model is hashed and loaded (minutes for the real one), not after."""
    from models.loading import resolve_model

    path = lora_weight_file(lora)
    try:
        now = json.loads((resolve_model(model) / "transformer" / "config.json").read_text(encoding="utf-8"))
        recorded = _metadata(path, None).get(_CLASS_KEY)
    except Exception:  # no such config: the loader names it; an unreadable LoRA (SafetensorError): its reader does
        return
    _refuse_other_family(lora, recorded, now.get("_class_name") if isinstance(now, dict) else None)


def _is_plain_lora(config: dict) -> bool:
    return str(config.get("peft_type", "LORA")).upper().endswith("LORA") and not config.get("use_dora")


def _has_scaling(transformer) -> bool:
    return any(ADAPTER in getattr(m, "scaling", {}) for m in transformer.modules())


def _folded(transformer, state: dict[str, torch.Tensor], config: dict) -> tuple[dict, dict]:
    """lora_B * the module's peft scaling (alpha / r, alpha_pattern / rank_pattern resolved by peft itself)."""
    state = dict(state)
    done = set()
    for name, module in transformer.named_modules():
        key = f"{name}.lora_B.weight"
        if key in state and ADAPTER in getattr(module, "scaling", {}):
            scale = float(module.scaling[ADAPTER])
            state[key] = (state[key].float() * scale).to(state[key].dtype).contiguous() if scale != 1.0 else state[key]
            done.add(key)
    left = [k for k in state if k.endswith(".lora_B.weight") and k not in done]
    if left:
        raise RuntimeError(f"no peft scaling found for {left[:3]}")  # a peft change: fail loud, never mis-scale
    config = {**config, "lora_alpha": config["r"], "alpha_pattern": dict(config.get("rank_pattern") or {}),
              "use_rslora": False}  # each module's scale is in lora_B now: alpha / r = 1
    return state, config


def lora_base_fingerprint(lora: str | Path) -> str | None:
    """The base model fingerprint a LoRA written by `pipeline run train` records (None: written elsewhere)."""
    path = lora_weight_file(lora)
    try:
        with safe_open(path, framework="pt") as f:
            return (f.metadata() or {}).get(_BASE_KEY)
    except Exception as e:  # SafetensorError: not a safetensors file at all
        raise UserError(f"{path} is not a readable .safetensors file ({type(e).__name__}: {e}); pass the LoRA "
                        "written by `pipeline run train` (RUN/lora) or an intact copy") from None


def check_base_model(lora: str | Path, model: str, strict: bool) -> str | None:
    """None when the LoRA was trained on MODEL (or does not say); else the warning line, or a UserError when
    `strict`. Applying a LoRA to another base runs without error and gives silently wrong images."""
    from models.loading import model_fingerprint

    recorded = lora_base_fingerprint(lora)
    check_family_before_loading(lora, model)
    if recorded is None:
        return None
    now = model_fingerprint(model)
    if recorded == now:
        return None
    msg = (f"LoRA {lora} was trained on a base model with fingerprint {recorded}, but {model} has {now}: "
           "its images will not be what training validated")
    if strict:
        raise UserError(f"{msg}; pass the model it was trained on, or drop --strict-base to apply it anyway")
    return msg + " (pass --strict-base to refuse)"


# ---------------------------------------------------------------------------------------------- the loader


def lora_sha256(lora: str | Path) -> str:
    """sha256 of the LoRA's weight file, remembered by `models.file_hashes` (an unchanged file is read once); the
    ranks of a node take turns, so one reads it and the others find it cached."""
    from models.file_hashes import FileHashes

    path = lora_weight_file(lora)
    with FileHashes() as hashes, hashes.alone(str(path.resolve())):
        return hashes.sha256(path)


def read_lora(lora: str | Path, data: bytes | None = None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(peft-named state dict without the `transformer.` prefix, saved adapter config or None). `data`: the
    file's bytes, already read (evaluate hashes exactly the bytes it loads), parsed instead of reading the file.

    Files in the other formats diffusers' Qwen-Image loader reads (kohya `lora_unet_*`, ComfyUI
    `diffusion_model.*`, per-module `.alpha` tensors) go through diffusers' own converter
    (`QwenImagePipeline.lora_state_dict`), which bakes each alpha / rank into the weights: config None, alpha = rank.
    """
    path = lora_weight_file(lora) if data is None else weight_file_name(lora)
    try:
        state = load_file(path) if data is None else load_bytes(data)
        meta = _metadata(path, data).get(_METADATA_KEY)
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a file it cannot parse
        raise UserError(f"{path} is not a readable .safetensors file ({type(e).__name__}: {e}); pass the LoRA "
                        "written by `pipeline run train` (RUN/lora) or an intact copy") from None
    _check_finite(path, state)
    state = _comfy_transformer_named(state)
    if any(not k.startswith(_PREFIX) or k.endswith(".alpha") for k in state):
        state, meta = _converted(path, state), None  # the tensors read above: `data`'s, not the file again
    bad = [k for k in state if not k.startswith(_PREFIX)]
    if bad:
        raise UserError(f"{path}: keys without the '{_PREFIX}' prefix (not a diffusers transformer LoRA): {bad[:5]}")
    config = _adapter_config(path, meta) if meta else None
    return {k[len(_PREFIX) :]: v for k, v in state.items()}, config or None


def _is_rank(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: the saved config's fields that size (a rank) or scale (an alpha) a module, one value or a pattern of module name
#: -> value: what peft builds the adapter from
_SIZE_AND_SCALE = {"r": _is_rank, "rank_pattern": _is_rank, "lora_alpha": _is_number, "alpha": _is_number,
                   "alpha_pattern": _is_number}


def _adapter_config(path: Path, meta: str) -> dict:
    """The transformer's adapter config from the file's `lora_adapter_metadata` JSON (diffusers writes each key
    prefixed by the component: `transformer.r`, ...), its ranks and alphas checked: JSON that does not parse, or a
    rank / alpha of another type, was a traceback from json, peft or torch in every loader and the export."""
    def bad(why: str) -> UserError:
        return UserError(f"{path}: its adapter config (safetensors metadata '{_METADATA_KEY}') {why}: the file is "
                         "damaged or was edited; pass the LoRA written by `pipeline run train` (RUN/lora) or an "
                         "intact copy")

    try:
        saved = json.loads(meta)
    except ValueError as e:
        raise bad(f"is not JSON ({e})") from None
    if not isinstance(saved, dict):
        raise bad(f"is a JSON {type(saved).__name__}, not an object")
    config = {k[len(_PREFIX) :]: v for k, v in saved.items() if k.startswith(_PREFIX)}
    for field, fits in _SIZE_AND_SCALE.items():
        value = config.get(field)
        if value is None:
            continue
        pattern = field.endswith("_pattern")
        values = list(value.values()) if pattern and isinstance(value, dict) else [value]
        if (pattern and not isinstance(value, dict)) or not all(fits(v) for v in values):
            kind = "rank (a positive whole number)" if fits is _is_rank else "number"
            raise bad(f"gives {field} {value!r}, not " + (f"a mapping of module names to a {kind} each" if pattern
                                                          else f"a {kind}"))
    return config


def _check_finite(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A NaN / inf weight gives NaN images and losses without any error: refuse the file instead."""
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in state.items() if v.is_floating_point()}
    bad = {k: n for k, n in bad.items() if n}
    if bad:
        total = sum(v.numel() for v in state.values())
        raise UserError(f"{path}: {sum(bad.values())} of {total} LoRA values are NaN or infinite (e.g. in "
                        f"{next(iter(bad))}): the file is damaged or training diverged; use an intact copy or an "
                        "earlier checkpoint's LoRA (RUN/checkpoints/step-N/lora)")


def _comfy_transformer_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Modules in ComfyUI's `transformer.<module>.lora_down/lora_up/alpha` form (the 2.1 MLP halves of `lora
    export`, which ComfyUI maps only from that name; any module of a file ComfyUI reads) named
    `diffusion_model.<module>` as the rest of such a file: diffusers' converter strips `diffusion_model.` and adds
    `transformer.`, so it named these `transformer.transformer.<module>` (its loader drops them with a logged
    "unexpected keys"; ours refused the file the export wrote)."""
    down = ".lora_down.weight"
    modules = {k[len(_PREFIX) : -len(down)] for k in state if k.startswith(_PREFIX) and k.endswith(down)}
    if not modules:
        return state
    named = {f"{_PREFIX}{m}{s}": f"diffusion_model.{m}{s}" for m in modules for s in (down, ".lora_up.weight", ".alpha")}
    return {named.get(k, k): v for k, v in state.items()}


def _converted(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' conversion of the tensors read from `path` (it takes a state dict as well as a file)."""
    from diffusers import QwenImagePipeline

    try:
        return QwenImagePipeline.lora_state_dict(dict(state))
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: not a Qwen-Image LoRA diffusers can convert ({e})") from None


def load_lora(transformer, lora: str | Path, adapter_name: str = ADAPTER, state: dict | None = None,
              data: bytes | None = None) -> None:
    """Copy saved adapter weights into the transformer's existing adapter; any key mismatch is an error.

    The transformer must already carry an adapter built from the same settings (`add_lora`, `attach_lora`).
    `state`: already read (and possibly rescaled) weights of `lora`, instead of reading the file; `data`: its
    bytes, already read.
    """
    from peft.utils import set_peft_model_state_dict

    config = None
    if state is None:
        state, config = read_lora(lora, data)
    expected = lora_state_dict(transformer, adapter_name)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(
            f"LoRA at {lora} does not match the adapter built from the config: "
            f"missing {missing[:5]}{'…' if len(missing) > 5 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''} ({len(unexpected)}). "
            "Use the same train.lora settings (rank, target_modules) that wrote it."
        )
    wrong_shape = [k for k in state if state[k].shape != expected[k].shape]
    if wrong_shape:
        first = wrong_shape[0]  # its sizes say which: the rank (r), or the module's own (another base model)
        raise UserError(f"LoRA at {lora}: shapes differ from the adapter for {wrong_shape[:5]} ({first}: saved "
                        f"{list(state[first].shape)}, the model's {list(expected[first].shape)}): trained on a base "
                        "model of other sizes, or with another rank; use the base model and train.lora settings "
                        "that wrote it")
    differs = _scaling_differs(config, transformer.peft_config.get(adapter_name))
    if differs:
        # e.g. a final LoRA (alpha folded in, alpha = r) loaded into a training adapter of alpha != r, or a LoHa /
        # LoKr checkpoint of another alpha (their config names it `alpha`: it went unchecked, and evaluate
        # --all-checkpoints scored such a checkpoint at the alpha of the one loaded before it)
        field, saved, have = differs
        raise UserError(f"LoRA at {lora} was saved with {field} {saved}, the adapter has {field} {have}: loading "
                        "it as is would scale it wrongly (use train.init_lora to start from it)")
    result = set_peft_model_state_dict(transformer, state, adapter_name=adapter_name)
    unexpected_after = [k for k in getattr(result, "unexpected_keys", []) if any(t in k for t in _ADAPTER_TAGS)]
    if unexpected_after:
        raise UserError(f"LoRA at {lora}: peft did not place keys {unexpected_after[:5]}")


#: the adapter-config fields that set a module's scale (LoRA / DoRA: lora_alpha, LoHa / LoKr: alpha): the same
#: weights under another value are another delta
_SCALING_FIELDS = ("lora_alpha", "alpha", "use_rslora", "alpha_pattern", "rank_pattern")


def _scaling_differs(saved: dict | None, adapter) -> tuple[str, object, object] | None:
    """(field, saved value, adapter's value) of the first scaling field the saved config holds otherwise than the
    adapter; None when they agree (or there is no saved config: a converted file, its alpha baked in)."""
    if not saved or adapter is None:
        return None
    for field in _SCALING_FIELDS:
        have = getattr(adapter, field, None)
        if field not in saved or have is None:
            continue
        value = saved[field]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, have))
        if (float(value) != float(have)) if numbers else (value or None) != (have or None):
            return field, value, have
    return None


def init_from_lora(transformer, lora: str | Path, adapter_name: str = ADAPTER) -> None:
    """Start the trainer's adapter from an existing LoRA (`train.init_lora`): same targets and rank as the
    config (checked, one-line error naming the setting), and the same weight delta as the file: lora_B is
    rescaled by (file alpha / r) / (config alpha / r) when the alphas differ."""
    check_lora_family(transformer, lora)
    state, config = read_lora(lora)
    peft_cfg = transformer.peft_config[adapter_name]  # a `lora` adapter: train refuses another kind at its start
    ranks = {k[: -len(".lora_A.weight")]: v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}
    if set(ranks.values()) - {peft_cfg.r}:
        raise UserError(f"train.init_lora {lora}: LoRA rank {sorted(set(ranks.values()))}, config "
                        f"train.lora.rank {peft_cfg.r}; set train.lora.rank to the file's rank")
    mine = {k[: -len(".lora_A.weight")] for k in lora_state_dict(transformer, adapter_name) if k.endswith(".lora_A.weight")}
    if set(ranks) != mine:
        raise UserError(f"train.init_lora {lora}: the file adapts {len(ranks)} modules, train.lora.target_modules "
                        f"{len(mine)} (e.g. only in the file: {sorted(set(ranks) - mine)[:3]}, only in the config: "
                        f"{sorted(mine - set(ranks))[:3]}); set the file's modules: --set "
                        f"'train.lora.target_modules={_target_list(transformer, set(ranks))}'")
    # per module: the file's scale (its alpha_pattern, use_rslora) over the adapter's own (peft's `scaling`)
    factors = {m: module_scale(m, r, config) / float(transformer.get_submodule(m).scaling[adapter_name])
               for m, r in ranks.items()}
    # in float32, as the adapter holds them: a bf16 file's lora_B scaled in bf16 was rounded once more (up to 2^-9)
    state = {k: v.float() * factors[k[: -len(".lora_B.weight")]] if k.endswith(".lora_B.weight") else v.float()
             for k, v in state.items()}
    load_lora(transformer, lora, adapter_name, state=state)


def module_scale(module: str, rank: int, config: dict | None) -> float:
    """The scale peft applies to one module of a saved adapter (what diffusers' loader rebuilds from the file's
    config): alpha (its `alpha_pattern` matched by peft's own rule, else `lora_alpha`) / rank, or / sqrt(rank)
    with `use_rslora`. A file without a config (converted, alpha baked into the weights): 1."""
    import math

    if not config:
        return 1.0
    from peft.utils.other import get_pattern_key

    alpha = float(config.get("lora_alpha", rank))
    patterns = config.get("alpha_pattern") or {}
    if patterns:
        alpha = float(patterns.get(get_pattern_key(list(patterns), module), alpha))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _target_list(transformer, modules: set[str]) -> str:
    """`modules` as a target_modules value to paste (YAML flow list): the short names (peft matches a name's
    suffix; `to_out.0`, not `0`) when they select exactly these modules of the model, else the full names."""
    def short(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]

    linear = set()
    for name, m in transformer.named_modules():
        parts = name.split(".")
        if isinstance(m, torch.nn.Linear) and not any(p.startswith(("lora_", "hada_", "lokr_")) for p in parts):
            linear.add(name.removesuffix(".base_layer"))
    names = sorted({short(m) for m in modules})
    selected = {n for n in linear if any(n == s or n.endswith("." + s) for s in names)}
    return "[" + ", ".join(names if selected == modules else sorted(modules)) + "]"


def attach_lora(transformer, lora: str | Path, scale: float = 1.0, adapter_name: str = "lora",
                data: bytes | None = None) -> None:
    """Build an adapter from the LoRA file's own config (rank, alpha, targets), load its weights, activate it at
    `scale`. A file without the config (written elsewhere) gets rank and targets from its shapes, alpha = rank
    (what diffusers assumes too). `data`: the file's bytes, already read."""
    from peft.utils.error import NoMatchingPeftModuleError

    check_lora_family(transformer, lora, data)
    state, config = read_lora(lora, data)
    peft_config = _peft_config(state, config)
    refuse_lycoris_on_nf4(transformer, peft_config, f"LoRA {lora} (a {peft_config.peft_type.value} adapter)")
    try:
        with _no_torchao_merge_warning():
            transformer.add_adapter(peft_config, adapter_name=adapter_name)
    except NoMatchingPeftModuleError as e:  # e.g. a LoRA of another model family: one line, not peft's traceback
        raise UserError(f"LoRA {lora} adapts modules this model does not have ({e}): it was made for another "
                        "model; pass a LoRA trained on this --model") from None
    if not transformer.training:  # peft builds the new layers (their lora/module dropout too) in training mode:
        transformer.eval()  # a model loaded for inference would draw dropout masks from the global RNG
    _check_layers_match(lora, state, lora_state_dict(transformer, adapter_name))
    # peft builds adapter weights in the layers' dtype: load the saved values into exactly those (the state read
    # above: the adapter was built from its config, so the alpha check has nothing to compare; no second read)
    load_lora(transformer, lora, adapter_name, state=state)
    transformer.set_adapters([adapter_name], weights=[scale])


def _adapted_modules(state: dict[str, torch.Tensor]) -> set[str]:
    """The modules a peft state dict adapts (its keys up to `.lora_A`, `.hada_w1_a`, ...)."""
    out = set()
    for key in state:
        at = min((key.find(t) for t in _ADAPTER_TAGS if t in key), default=-1)
        if at > 0:
            out.add(key[:at])
    return out


def _check_layers_match(lora, state: dict[str, torch.Tensor], built: dict[str, torch.Tensor]) -> None:
    """The layers the file's own adapter config adapts (`built`: the adapter made from it) are those it holds
    weights for. A file that holds fewer (or more) is refused in one line: every writer found (diffusers' training
    scripts and this trainer save `get_peft_model_state_dict` with that model's own config; kohya, musubi-tuner,
    ComfyUI, ai-toolkit write no config, and their targets come from the keys) writes them alike, so it was edited.
    diffusers applies the layers present with one warning; the refusal said to use 'the same train.lora
    settings', which predict / merge / evaluate have none of."""
    have, adapted = _adapted_modules(state), _adapted_modules(built)
    absent, unnamed = sorted(adapted - have), sorted(have - adapted)
    if not absent and not unnamed:
        return
    config = f"its adapter config (safetensors metadata '{_METADATA_KEY}')"
    if absent:
        what = (f"{config} adapts {len(adapted)} layers and the file holds weights for {len(adapted & have)} of them "
                f"({len(absent)} absent, e.g. {absent[0]})")
    else:
        what = (f"the file holds weights for {len(unnamed)} layer(s) {config} does not adapt (e.g. {unnamed[0]})")
    raise UserError(f"LoRA {lora}: {what}: the file was edited after it was written (layers pruned, or another "
                    "file's config put in its metadata); pass the LoRA as its trainer wrote it (RUN/lora, a "
                    "checkpoint's lora) or an intact copy")


def _peft_config(state: dict[str, torch.Tensor], saved: dict | None):
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    if saved:
        cls = {"LOHA": LoHaConfig, "LOKR": LoKrConfig}.get(saved.get("peft_type"), PeftLoraConfig)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in saved.items() if k in known})
    ranks = {k[: -len(".lora_A.weight")]: v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}
    if not ranks:
        raise UserError("the LoRA file holds no lora_A weights")
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    # DoRA and a LoRA bias are told by their keys, as diffusers' loader tells them (`get_peft_kwargs`)
    return PeftLoraConfig(
        r=rank, lora_alpha=rank, target_modules=sorted(ranks),
        rank_pattern={m: r for m, r in ranks.items() if r != rank}, alpha_pattern={m: r for m, r in ranks.items() if r != rank},
        use_dora=any(k.endswith(".lora_magnitude_vector") for k in state),
        lora_bias=any(k.endswith(".lora_B.bias") for k in state),
    )


# ---------------------------------------------------------------------------------------------- merging


def saved_dtype(model: str) -> torch.dtype:
    """Dtype of the model's stored transformer weights (merge writes back what it read): the floating dtype that
    holds the most weights, read from the headers. Not the first tensor's: safetensors writes the widest dtype
    first, so one float32 norm or embedding in a bf16 checkpoint made a 20B merge write float32 (2x the bytes)."""
    from collections import Counter

    from models.loading import resolve_model

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    held: Counter = Counter()
    for f in sorted((resolve_model(model) / "transformer").glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                tensor = st.get_slice(key)
                if tensor.get_dtype() in names:
                    held[names[tensor.get_dtype()]] += math.prod(tensor.get_shape())
    return held.most_common(1)[0][0] if held else torch.float32


def check_mergeable(model: str, lora: str | Path, data: bytes | None = None) -> None:
    """A UserError when the LoRA adds a bias (`lora_B.bias`, applied as diffusers applies it) to a layer that has
    none in MODEL's transformer (Qwen-Image-2.1's linears have none): peft cannot fuse such a bias into the weights,
    and its RuntimeError was a traceback after the transformer had loaded. From the LoRA and the weight files'
    headers alone. `data`: the LoRA file's bytes, already read."""
    from models.loading import resolve_model

    state, _ = read_lora(lora, data)
    biased = sorted(k[: -len(".lora_B.bias")] for k in state if k.endswith(".lora_B.bias"))
    if not biased:
        return
    files = sorted((resolve_model(model) / "transformer").glob("*.safetensors"))
    if not files:  # weights in another format (.bin): no header to read, peft says what it meets at the merge
        return
    held: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt") as st:
            held.update(st.keys())
    lacking = [m for m in biased if f"{m}.bias" not in held]
    if lacking:
        raise UserError(f"LoRA {lora} adds a bias (lora_B.bias) to {len(lacking)} layer(s) that have none in {model} "
                        f"(e.g. {lacking[0]}): it cannot be merged into the weights; apply it with --lora (predict, "
                        "evaluate) instead")


def fused_transformer(model: str, lora: str | Path, scale: float = 1.0, dtype: torch.dtype | None = None,
                      device: str | torch.device = "cpu"):
    """MODEL's transformer with W + scale·(B·A)·alpha/r fused into its weights and the LoRA layers removed."""
    from models.loading import load_component

    # read once, parsed by both: the check and the attach each read the whole file (hundreds of MB) before
    data = lora_weight_file(lora).read_bytes()
    check_mergeable(model, lora, data)  # before the transformer loads (minutes for a 20B one)
    transformer = load_component(model, "transformer", dtype=dtype or saved_dtype(model), device=device)
    attach_lora(transformer, lora, scale=1.0, adapter_name="lora", data=data)
    del data
    transformer.fuse_lora(lora_scale=scale, adapter_names=["lora"])
    transformer.unload_lora()  # drops the peft layers, keeps the fused base weights
    return transformer
