#!/usr/bin/env bash
# Where fan-in's time goes, by stage: py-spy on `lightgate serve` during one mqttbench fan-in run,
# then bench/fanin_stages.py turns the samples into µs per message per stage.
# Usage: bench/fanin_profile.sh NAME QOS [extra serve args]   (py-spy: .venv/bin/pip install py-spy)
# Output: bench/out/NAME.raw (py-spy raw), bench/out/NAME.bench.json (mqttbench's line).
# LIGHTGATE_NO_EXTENSIONS=1 in the environment profiles the pure-Python twins.
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
NAME=$1; QOS=$2; shift 2
PORT=${PORT:-18839}
OUT="$ROOT/bench/out"; mkdir -p "$OUT"
"$ROOT/bench/mqtt_serve.sh" "$PORT" "/tmp/lightgate-profile-$NAME" "$@" > "$OUT/$NAME.serve.log" 2>&1 &
SPID=$!
sleep 4
"$ROOT/.venv/bin/py-spy" record -p "$SPID" -r 200 -f raw -o "$OUT/$NAME.raw" --nonblocking -d 14 \
    > "$OUT/$NAME.pyspy.log" 2>&1 &
PSP=$!
cd "$ROOT/bench/mqttbench"
"$ROOT/.venv/bin/python" mqttbench.py --port "$PORT" --broker-pid "$SPID" --duration 8 --warmup 2 \
    --drain 1 fanin --publishers 10 --qos "$QOS" > "$OUT/$NAME.bench.json"
wait "$PSP"
kill "$SPID"  # our server, by PID
wait "$SPID" || true
"$ROOT/.venv/bin/python" "$ROOT/bench/fanin_stages.py" "$OUT/$NAME"
