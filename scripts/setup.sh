#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs the package with its test extras.
# torch/torchvision are pinned first: on this kind of machine both lie on disk (DESIGN §7) and an unpinned
# torch would pull a multi-GB CUDA build. On a GPU machine, install the torch you want first and set
# PIPELINE_SKIP_TORCH_PIN=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
if [ -z "${PIPELINE_SKIP_TORCH_PIN:-}" ]; then
  python -m pip install -q torch==2.14.1 torchvision==0.29.1 2>&1 | grep -v '^WARNING: Location' || true
fi
python -m pip install -q -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
python -c "import torch, diffusers, transformers, peft, accelerate, webdataset; print('installed: torch', torch.__version__, '| diffusers', diffusers.__version__, '| transformers', transformers.__version__)"
