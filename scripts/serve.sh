#!/usr/bin/env bash
# Set up and start the OpenAI-compatible server on the default model (extra flags go to `headroom serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/headroom serve --model default "$@"
