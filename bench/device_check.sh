#!/usr/bin/env bash
# The device check for a lent GPU: at most 8 minutes (the timeouts below add up to 475 s with their kill grace),
# nothing downloaded (the model is random weights in Llama-3.1-8B's shape):
#   1. the CUDA-marked tests, from the files that hold them (the others need the server's packages), <= 110 s;
#   2. python -m bench.device_check (bench/device_check.py says what it checks), <= 300 s.
# Report: bench/results/device_check.md and .json, copied to $OUT when it is set (the device tool brings back only
# what is there), beside the CUDA tests' log. Exits 1 when a test or a check fails; extra arguments go to step 2
# (e.g. --only oom_recovery).
# Setup: the repo's .venv where there is one, else python3. Missing packages are installed only if pip's registry
# answers within 30 s (a lent machine may have no network); flash-attn never is (it builds for an hour), and
# without it the CUDA-graph and flash checks report themselves skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
LOG=${OUT:-${TMPDIR:-/tmp}}/device_check_cuda_tests.txt
mkdir -p "$(dirname "$LOG")"
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import pytest, gguf, pynvml" 2>/dev/null; then
    timeout 30 "$PY" -m pip install -q --retries 0 --timeout 5 pytest gguf nvidia-ml-py \
        || echo "device_check: could not install pytest, gguf and nvidia-ml-py; going on without"
fi
timeout 15 "$PY" -c "import torch, importlib.util as u; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
  torch.cuda.get_device_name() if torch.cuda.is_available() else '-', 'flash_attn', u.find_spec('flash_attn') is not None)"
status=0
mapfile -t cuda_tests < <(grep -l "pytest.mark.cuda" tests/test_*.py)
timeout -k 10 110 "$PY" -m pytest -m cuda -q -p no:cacheprovider "${cuda_tests[@]}" 2>&1 | tee "$LOG"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    status=1
    echo "device_check: the CUDA-marked tests failed or could not run; log: $LOG"
fi
timeout -k 10 300 "$PY" -m bench.device_check --device cuda "$@" || status=1
exit $status
