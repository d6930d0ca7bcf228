#!/usr/bin/env bash
# The wheels bench/device_check.sh installs on a lent GPU machine, which has no network: what its image lacks of
# what the check imports (the device tool's KINDS.md lists the image's packages; gguf is the one missing: the
# tests' tiny-model fixture writes GGUF files). For its Python (3.12, x86-64 manylinux), into .whl/ (ignored by
# git; carried with `carry: [".whl"]`). Pure-Python wheels only, so this runs on any machine with pip and a
# registry. The check installs these with --no-index and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=(gguf==0.19.0)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl && ls .whl
