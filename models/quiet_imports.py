"""Known-harmless messages that importing the model libraries logs, dropped at their source loggers.

Both come from importing torchao (pulled in by transformers' and diffusers' quantizer registries on the first
model load), not from anything this project does:
- torch `_pytree` warns once per torchao Enum (`KernelPreference`, `ScaleCalculationMode`) that torchao still
  calls the deprecated `register_constant()` on Enum subclasses;
- diffusers' torchao quantizer cannot import torchao Tensor classes that torchao 0.18 moved; it only needs them
  to unpickle torchao-serialised checkpoints, which this project never loads (safetensors only);
- bitsandbytes (imported by peft, and for `train.optimizer: adamw8bit`) cannot fetch an optional CPU 4-bit gemm
  kernel from a hub on machines with AVX512-BF16; it only serves 4-bit inference, which this project never runs.
  Offline (HF_HUB_OFFLINE), the `kernels` package it asks says instead that it skips that kernel's publisher
  trust check: the same attempt, for the same kernel.
Each filter matches one message and, for the pytree one, only torchao's own classes: any other warning from
these loggers still shows. Installing costs nothing (no import of torch or torchao).
"""

from __future__ import annotations

import logging

_PYTREE_LOGGER = "torch.utils._pytree"
_DIFFUSERS_TORCHAO_LOGGER = "diffusers.quantizers.torchao.torchao_quantizer"
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"
_BNB_CPU_KERNEL = "kernels-community/quantization-bitsandbytes"


class _TorchaoEnumRegistration(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if "is an Enum subclass and is now natively supported" not in str(record.msg):
            return True
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not getattr(cls, "__module__", "").startswith("torchao.")


class _TorchaoTensorImport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to import `torchao` Tensor objects" not in str(record.msg)


class _BnbCpuGemm4bit(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load CPU gemm_4bit_forward from kernels-community" not in str(record.msg)


class _BnbCpuKernelTrust(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not ("Skipping publisher trust check" in msg and f"'{_BNB_CPU_KERNEL}'" in msg)


def install() -> None:
    """Idempotent: attach each filter once to its logger (loggers exist before the libraries create them)."""
    for name, cls in ((_PYTREE_LOGGER, _TorchaoEnumRegistration), (_DIFFUSERS_TORCHAO_LOGGER, _TorchaoTensorImport),
                      (_BNB_CPU_LOGGER, _BnbCpuGemm4bit), (_KERNELS_HUB_LOGGER, _BnbCpuKernelTrust)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


install()
