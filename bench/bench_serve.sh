#!/usr/bin/env bash
# Benchmark `headroom serve` over HTTP with aiperf: concurrency 1, 4 and 16, 128 input and 128 output tokens
# (ignore_eos, streaming completions), default model on CPU. Writes the artifacts under $OUT and prints
# markdown rows for bench/results/serve_aiperf.md.
#
#   AIPERF=/tmp/aiperf-venv/bin/aiperf bash bench/bench_serve.sh
#
# aiperf lives in its own venv (python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf):
# installed into .venv it would downgrade prometheus_client and add uvloop/httptools, which uvicorn would
# then pick up, changing the server under test. Offline: aiperf counts tokens with a local tokenizer dir
# (tokenizer.json written from our GGUF by bench_serve.py export-tokenizer). Do not set HF_HUB_OFFLINE:
# aiperf then resolves every tokenizer name through the hub cache and rejects a local path.
# Without aiperf (AIPERF=none) the same points run through our httpx load generator (bench_serve.py loadgen).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
AIPERF=${AIPERF:-aiperf}
OUT=${OUT:-/tmp/headroom-serve-bench}
CONCURRENCIES=${CONCURRENCIES:-"1 4 16"}
ISL=${ISL:-128}
OSL=${OSL:-128}
REQUESTS_PER_CLIENT=${REQUESTS_PER_CLIENT:-2}
SERVE_FLAGS=${SERVE_FLAGS:-"--device cpu"}

mkdir -p "$OUT"
cd "$ROOT"
"$PY" -m bench.bench_serve export-tokenizer "$OUT/tokenizer" >/dev/null

# shellcheck disable=SC2086
"$PY" -m engine.serving.cli --port 0 --served-model-name smollm2 $SERVE_FLAGS >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q "Headroom ready at" "$OUT/server.log" && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done
URL=$(grep -o "Headroom ready at http://[^ ]*" "$OUT/server.log" | awk '{print $4}')
echo "server: $URL ($SERVE_FLAGS); $(nproc) CPUs; load before: $(cut -d' ' -f1-3 /proc/loadavg)"

echo "| concurrency | requests | TTFT avg ms | TTFT p90 ms | ITL (TPOT) avg ms | ITL p90 ms | chunk gap avg ms | output tok/s | run s |"
echo "|---|---|---|---|---|---|---|---|---|"
for C in $CONCURRENCIES; do
  N=$((C * REQUESTS_PER_CLIENT))
  if [ "$AIPERF" != none ]; then
    DIR="$OUT/c$C"
    "$AIPERF" profile --model smollm2 --url "$URL" --endpoint-type completions --streaming \
      --tokenizer "$OUT/tokenizer" --concurrency "$C" --request-count "$N" --warmup-request-count 1 \
      --prompt-input-tokens-mean "$ISL" --prompt-input-tokens-stddev 0 \
      --prompt-output-tokens-mean "$OSL" --prompt-output-tokens-stddev 0 \
      --extra-inputs ignore_eos:true --random-seed 0 --output-artifact-dir "$DIR" --no-auto-plot \
      >"$DIR.log" 2>&1 || { tail -30 "$DIR.log"; exit 1; }
    "$PY" -m bench.bench_serve aiperf-row "$DIR/profile_export_aiperf.json"
  else
    "$PY" -m bench.bench_serve loadgen --url "$URL" --concurrency "$C" --requests "$N" \
      --input-tokens "$ISL" --output-tokens "$OSL" --json "$OUT/loadgen.jsonl"
  fi
  echo "  (load after c=$C: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
done
