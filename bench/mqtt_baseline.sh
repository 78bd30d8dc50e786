#!/usr/bin/env bash
# MQTT benchmark: the mqttbench suite against Lightgate (one process, and with the MQTT
# proxy in its own process: mqtt_processes=1), Mosquitto and amqtt in one run.
# Usage: bench/mqtt_baseline.sh [extra baseline.py args, e.g. --repeat 3]
set -eu
# the peers: Mosquitto from Debian (scripts/system-deps.sh), amqtt from the venv (a dependency)
bash "$(dirname "$0")/../scripts/system-deps.sh"
command -v mosquitto >/dev/null || { echo "mosquitto is required: apt-get install mosquitto" >&2; exit 2; }
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MB="$ROOT/bench/mqttbench"  # the load generator ships with the repo
PY="$ROOT/.venv/bin/python"
DAY=$(date +%F-%H%M)  # one set of files per run
OUT="$ROOT/bench/results"  # raw lines, git-ignored
mkdir -p "$OUT"
cd "$MB"
# the machine's own latency noise, before and after (bench/machine_jitter.py: slow windows make
# every Python broker's p99 a measure of the machine)
"$PY" "$ROOT/bench/machine_jitter.py" --json >> "$OUT/$DAY-machine.jsonl"
"$PY" baseline.py --label lightgate --port 18832 --out "$OUT/$DAY-lightgate.jsonl" "$@" \
    -- "$ROOT/bench/mqtt_serve.sh" 18832 /tmp/lightgate-mqtt-bench
"$PY" baseline.py --label lightgate-split --port 18834 --out "$OUT/$DAY-lightgate-split.jsonl" "$@" \
    -- "$ROOT/bench/mqtt_serve.sh" 18834 /tmp/lightgate-mqtt-bench-split --set mqtt_processes=1
"$PY" baseline.py --label mosquitto --port 18830 --out "$OUT/$DAY-mosquitto.jsonl" "$@" \
    -- mosquitto -c brokers/mosquitto.conf
"$PY" baseline.py --label amqtt --port 18831 --out "$OUT/$DAY-amqtt.jsonl" "$@" \
    -- "$ROOT/.venv/bin/amqtt" -c brokers/amqtt.yaml
"$PY" "$ROOT/bench/machine_jitter.py" --json >> "$OUT/$DAY-machine.jsonl"
"$PY" baseline.py --table "$OUT/$DAY-lightgate.jsonl" "$OUT/$DAY-lightgate-split.jsonl" \
    "$OUT/$DAY-mosquitto.jsonl" "$OUT/$DAY-amqtt.jsonl"
echo "machine jitter (before, after):"; cat "$OUT/$DAY-machine.jsonl"
