#!/usr/bin/env bash
# Lightgate at several commits (checked-out work trees) and Mosquitto, alternating, in one run:
# the before/after check of a change, with the peer measured in the same window.
# Usage: bench/mqtt_compare.sh REPS SUITE_INDEXES LABEL=TREE[,serve args...] ...
#   e.g. bench/mqtt_compare.sh 2 0,1,4,6 main=/tmp/main new=. new-split=.,--set,mqtt_processes=1
# DURATION=10 (seconds of each measurement window; default 5)
# Each TREE needs no venv of its own: this repo's .venv runs it with PYTHONPATH=TREE; a TREE with
# a .venv of its own (another interpreter: `make PY=... .venv/.installed` there) runs on that one.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPS=$1 ONLY=$2; shift 2
OUT="$ROOT/bench/results/compare-$(date +%F-%H%M)"; mkdir -p "$OUT"  # raw lines, git-ignored
PY="$ROOT/.venv/bin/python"
BA="--duration ${DURATION:-5} --warmup 2 --drain 1 --wait-idle 5"
cd "$ROOT/bench/mqttbench"
specs=("$@" mosquitto)
n=${#specs[@]}
labels=()
for spec in "${specs[@]}"; do labels+=("$OUT/${spec%%=*}.jsonl"); done
for rep in $(seq "$REPS"); do
  # Each round starts with the next broker: whoever runs first in a round did ~10 % better at
  # 1k msg/s on this machine (docs/performance-history.md), so a fixed order biases a compare.
  for k in $(seq 0 $((n - 1))); do
    spec=${specs[$(( (k + rep - 1) % n ))]}
    label=${spec%%=*}
    if [ "$label" = mosquitto ]; then
      cmd=(mosquitto -c brokers/mosquitto.conf); port=18830
    else
      IFS=, read -r -a parts <<< "${spec#*=}"
      tree=$(cd "${parts[0]}" && pwd)
      # that tree's code (PYTHONPATH comes first) on this repo's venv, or on the tree's own
      serve="$ROOT/bench/mqtt_serve.sh"
      if [ -x "$tree/.venv/bin/lightgate" ]; then serve="$tree/bench/mqtt_serve.sh"; fi
      cmd=(env PYTHONPATH="$tree" bash "$serve" 18840
           "/tmp/lightgate-compare-$label" "${parts[@]:1}"); port=18840
    fi
    "$PY" baseline.py --label "$label" --port "$port" --only "$ONLY" --repeat 1 --bench-args "$BA" \
        --out "$OUT/$label.jsonl" -- "${cmd[@]}" > "$OUT/$label-$rep.log" 2>&1
  done
done
"$PY" baseline.py --table "${labels[@]}" | tee "$OUT/table.md"
