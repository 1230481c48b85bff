#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs the package (editable) with its test extras.
# torch/torchvision are pinned to the versions this project is tested with. From PyPI they are CUDA builds:
# on a CPU-only machine too, ~4 GB of CUDA libraries come with them (.venv ~6 GB, ~5 min on a fast link).
# On a GPU machine with its own torch, install that first and set PIPELINE_SKIP_TORCH_PIN=1.
# pip runs only when something it installs from changed: a stamp in .venv holds the hash of pyproject.toml,
# this script (the pins) and PIPELINE_SKIP_TORCH_PIN; code edits need no reinstall (editable install).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP=.venv/.pipeline-setup-stamp
KEY=$(cat pyproject.toml scripts/setup.sh <(echo "skip-torch-pin=${PIPELINE_SKIP_TORCH_PIN:-}") | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -x .venv/bin/pipeline ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$KEY" ]; then
  echo "setup: .venv is up to date (pyproject.toml and pins unchanged); pip skipped"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv and installing torch 2.14.1 + CUDA libraries from PyPI (~6 GB, ~5 min the first time)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# pip without its harmless 'WARNING: Location' lines; a failed install stops here (pipefail), no stamp written
# (`grep ... || true` alone made the whole line succeed, and a later run skipped pip on a broken .venv)
pip_quiet() { python -m pip "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
pip_quiet install -q --upgrade pip
if [ -z "${PIPELINE_SKIP_TORCH_PIN:-}" ]; then
  pip_quiet install -q torch==2.14.1 torchvision==0.29.1
fi
pip_quiet install -q -e '.[test]'
python -c "import models.quiet_imports, torch, diffusers, transformers, peft, accelerate, webdataset; print('installed: torch', torch.__version__, '| diffusers', diffusers.__version__, '| transformers', transformers.__version__)"
echo "$KEY" > "$STAMP"
echo "setup: done. In a new shell, run \`. .venv/bin/activate\` (from $(pwd)) to get the \`pipeline\` command."
