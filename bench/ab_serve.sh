#!/usr/bin/env bash
# A refactor's cost on the CPU: the server at two revisions, alternated (A, B, A, B, ...), the same venv and
# client (python -m bench.bench_serve loadgen: 128-token prompts, 128 streamed tokens, concurrency 1 and 16).
# The server runs on one OpenMP thread, and its own CPU seconds per run are read from /proc: beside other work on
# a shared machine, wall tok/s measures the neighbours as much as the server, its CPU time much less so.
#   bash bench/ab_serve.sh REV_A REV_B [ROUNDS] > bench/results/NAME.md
set -euo pipefail
cd "$(dirname "$0")/.."
A=$1 B=$2 ROUNDS=${3:-3}
PY=$PWD/.venv/bin/python
WORK=$(mktemp -d)
trap 'pkill -f "serve --port 8011" || true; git worktree remove --force "$WORK/A"; git worktree remove --force "$WORK/B"' EXIT
git worktree add -q "$WORK/A" "$A"
git worktree add -q "$WORK/B" "$B"
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
echo "# Server CPU cost, $A against $B, alternated"
echo
echo "Command: \`bash bench/ab_serve.sh $A $B $ROUNDS\`. $("$PY" -c 'from bench.harness.machine import machine_line; print(machine_line())')"
echo
echo "| rev | round | concurrency | server CPU s | output tok/s (wall) |"
echo "|---|---|---|---|---|"
for round in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        tree=$WORK/$side
        module=engine.cli
        [ -f "$tree/headroom/cli.py" ] && module=headroom.cli
        (cd "$tree" && OMP_NUM_THREADS=1 exec "$PY" -m $module serve --port 8011 > "$WORK/serve_$side.log" 2>&1) &
        for _ in $(seq 1 180); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
        pid=$(pgrep -f "serve --port 8011" | head -1)
        for c in 1 16; do
            n=$([ "$c" = 1 ] && echo 8 || echo 48)
            before=$(cpu_ticks "$pid")
            row=$("$PY" -m bench.bench_serve loadgen --url http://127.0.0.1:8011 --concurrency "$c" --requests "$n" \
                --input-tokens 128 --output-tokens 128 --warmup 2 | tail -1)
            ticks=$(( $(cpu_ticks "$pid") - before ))
            rev=$([ $side = A ] && echo "$A" || echo "$B")
            echo "| $rev | $round | $c | $(awk "BEGIN {print $ticks / 100}") | $(echo "$row" | awk -F'|' '{gsub(/ /, "", $9); print $9}') |"
        done
        pkill -f "serve --port 8011" || true
        sleep 2
    done
done
echo
echo "Load average at the end: $("$PY" -c 'from bench.harness.machine import load_average; print(load_average())')."
