#!/usr/bin/env bash
# The device check for a lent GPU, in one call of at most 8 minutes (the limits below add up to 480 s with their
# kill grace), offline: nothing is downloaded, the model is random weights in Llama-3.1-8B's shape.
#   0. the wheels in .whl/ (bash scripts/device_wheels.sh makes them; the device call carries them), installed
#      with --no-index and nothing else: what the machine's image lacks;
#   1. the suite's CUDA-marked tests, from the files that hold them, <= 120 s, with pytest's JUnit report;
#   2. python -m bench.device_check (bench/device_check.py says what it checks), <= 300 s, which turns that report
#      into rows (PASS, FAIL, or NOT RUN with its reason: a test skipped on a GPU proved nothing) and runs its
#      checks after them.
# Report: bench/results/device_check.md and .json, copied to $OUT when it is set (the device tool brings back only
# what is there), beside the tests' log and report. Exits 1 when a test or a check fails.
# `--cpu`: the default suite's smoke run (tests/test_device_check.py): the same steps on the CPU with a tiny model,
# where the CUDA tests are NOT RUN and the checks run down to their first CUDA call. Other arguments go to step 2
# (e.g. --only oom_recovery, --out FILE).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
MODE=(--device cuda)
if [ "${1:-}" = "--cpu" ]; then
    MODE=(--device cpu --tiny)
    shift
fi
WORK=${OUT:-$(mktemp -d)}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d)
    timeout 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" .whl/*.whl || { echo "device_check: the wheels in .whl/ did not install"; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
elif [ "${MODE[1]}" = cuda ]; then
    echo "device_check: no .whl/ (bash scripts/device_wheels.sh makes it); going on with what is installed"
fi
timeout 20 "$PY" -c "import torch; print('device_check:', torch.__version__, 'CUDA', torch.version.cuda,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
mapfile -t cuda_tests < <(grep -l "pytest.mark.cuda" tests/test_*.py)
timeout -k 10 120 "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --junitxml "$WORK/cuda_tests.xml" \
    "${cuda_tests[@]}" 2>&1 | tee "$WORK/device_check_cuda_tests.txt"
tests_exit=${PIPESTATUS[0]}
timeout -k 10 300 "$PY" -m bench.device_check "${MODE[@]}" --cuda-tests "$WORK/cuda_tests.xml" \
    --cuda-tests-exit "$tests_exit" "$@"
