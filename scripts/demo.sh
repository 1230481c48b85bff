#!/usr/bin/env bash
# Quick start 1: install everything and run the end-to-end demo on a tiny offline model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
pipeline demo --workdir "${1:-demo-workdir}"
