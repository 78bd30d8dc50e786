#!/usr/bin/env bash
# The broker command mqttbench's baseline.py starts for Lightgate: a fresh data dir, then
# `lightgate serve` with only the MQTT listener (exec, so the PID baseline.py measures is ours).
# Usage: bench/mqtt_serve.sh PORT [DATA_DIR] [extra serve args...]
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${1:-18832}
DATA=${2:-/tmp/lightgate-mqtt-bench}
shift 2 || shift $#
rm -rf "$DATA"
exec "$ROOT/.venv/bin/lightgate" serve --data-dir "$DATA" --mqtt-port "$PORT" \
    --mqtts-port -1 --ws-port -1 --kafka-port -1 --http-port -1 --set log_level=warning "$@"
