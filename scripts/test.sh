#!/usr/bin/env bash
# Quick start 2: install what the tests need and run the whole suite (offline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The report test renders index.html in headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "warning: could not install chromium"
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two test files at a time (pytest-xdist; a file's tests stay in one process, with its module fixtures), in
# xdist's order (tests/conftest.py says why not longest first), one torch thread per process (tests/conftest.py:
# two processes with torch's default threads oversubscribed the 2 cores). Three at a time, measured before: 19.0 min
# against 20.0 for two, not worth the load. Tests that launch ranks take free ports and start them warm
# (tests/warm_start.py); every test writes under its own tmp_path.
python -m pytest tests -n 2 --dist loadfile "$@"
