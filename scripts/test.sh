#!/usr/bin/env bash
# Set up with the test extras, install Prometheus (promtool) when we can, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
if ! command -v promtool >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
        || echo "warning: could not install prometheus; promtool tests will be skipped"
fi
exec .venv/bin/python -m pytest "$@"
