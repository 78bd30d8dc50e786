#!/usr/bin/env bash
# Delivery latency at 1k msg/s against the fsync timer for unacknowledged writes: one
# `mqttbench latency --rate 1000` run per timer value, alternating, a fresh broker each.
# Usage: bench/fsync_timer_latency.sh [QOS] [REPS] [TIMERS...]   (default: 0 2 10 50 200 1000)
# Prints one line per run: timer, p50 / p99 / p999 / max ms, broker CPU %.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
QOS=${1:-0}; REPS=${2:-2}; shift 2 || shift $#
TIMERS=${*:-10 50 200 1000}
PORT=${PORT:-18861}
for rep in $(seq "$REPS"); do
  for ms in $TIMERS; do
    bash "$ROOT/bench/mqtt_serve.sh" "$PORT" /tmp/lightgate-fsync-timer \
        --set fsync_interval_ms="$ms" > /tmp/lightgate-fsync-timer.log 2>&1 &
    SPID=$!
    sleep 3
    (cd "$ROOT/bench/mqttbench" && "$ROOT/.venv/bin/python" mqttbench.py --port "$PORT" \
        --broker-pid "$SPID" --duration 10 --warmup 2 --drain 1 latency --rate 1000 --qos "$QOS") \
        | tail -1 | "$ROOT/.venv/bin/python" -c "import json, sys; d = json.load(sys.stdin); \
print('$ms ms', d['lat_p50_ms'], d['lat_p99_ms'], d['lat_p999_ms'], d['lat_max_ms'], \
d['broker_cpu_pct'], sep='\t')"
    kill "$SPID"  # our server, by PID
    wait "$SPID" 2>/dev/null || true
  done
done
