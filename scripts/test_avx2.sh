#!/usr/bin/env bash
# The test command as on an AVX2-only CPU, on an x86 CPU that also has AVX-512: Headroom's kernels built without
# AVX-512 and its choices made without it (HEADROOM_CPU_ISA, engine/model/dtype_choice.py), and torch kept off
# its AVX-512 code too (ATen, oneDNN, MKL).
set -euo pipefail
cd "$(dirname "$0")/.."
export HEADROOM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
exec bash scripts/test.sh "$@"
