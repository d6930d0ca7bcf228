#!/usr/bin/env bash
# The device check for a lent GPU under 10 minutes, no model download:
#   1. the CUDA-marked tests (tests marked `cuda`, skipped everywhere else);
#   2. python -m bench.device_check: a random-weight Llama-3.1-8B-shaped model in bf16, TPOT at batch 1, 16
#      and 64 (CUDA graphs and eager), the allocator peak of a 4096-token prefill, one KV pool resize (grow
#      and shrink), each beside the twin's prediction (the twin models an RTX 4090; this is another card).
# Output goes to $OUT when set (the device tool collects it), else bench/results/device_check/.
# Setup: the project's test extras are installed only if missing (pip's registry must then be reachable);
# flash-attn is used if it is already installed and never installed here (it builds for an hour).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT_DIR=${OUT:-bench/results/device_check}
mkdir -p "$OUT_DIR"
if ! "$PY" -c "import engine, pytest, transformers" 2>/dev/null; then
    "$PY" -m pip install -q -e '.[test]' || echo "device_check: could not install the test extras; going on"
fi
"$PY" -c "import torch, importlib.util as u; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
  torch.cuda.get_device_name() if torch.cuda.is_available() else '-', 'flash_attn', u.find_spec('flash_attn') is not None)"
status=0
timeout 240 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/cuda_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
OUT="$OUT_DIR" timeout 300 "$PY" -m bench.device_check --device cuda "$@" || status=1
exit $status
