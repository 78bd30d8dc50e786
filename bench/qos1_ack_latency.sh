#!/usr/bin/env bash
# QoS 1 fan-in with the gateway's own histograms: PUBACK latency (parsed -> PUBACK sent) and the
# fsync round as the event loop sees it, next to mqttbench's rates (what bounds QoS 1 fan-in).
# Usage: bench/qos1_ack_latency.sh [TREE] [extra serve args]   (TREE: a work tree, default this one)
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TREE=$(cd "${1:-$ROOT}" && pwd); shift || true
PORT=${PORT:-18851} HTTP=${HTTP:-18852} DATA=/tmp/lightgate-qos1-ack
rm -rf "$DATA"
cd "$TREE"
PYTHONPATH="$TREE" "$ROOT/.venv/bin/python" -m lightgate serve --data-dir "$DATA" --mqtt-port "$PORT" \
    --mqtts-port -1 --ws-port -1 --kafka-port -1 --http-port "$HTTP" --set log_level=warning "$@" \
    > "$DATA.log" 2>&1 &
SPID=$!
sleep 4
R=$(cd "$ROOT/bench/mqttbench" && "$ROOT/.venv/bin/python" mqttbench.py --port "$PORT" \
    --broker-pid "$SPID" --duration 5 --warmup 2 --drain 1 fanin --publishers 10 --qos 1 | tail -1)
M=$(curl -s "localhost:$HTTP/metrics")
kill "$SPID"  # our server, by PID
wait "$SPID" || true
"$ROOT/.venv/bin/python" - "$R" "$M" "$TREE" <<'PY'
import json
import sys

r, metrics, tree = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]


def mean_ms(name: str) -> float:
    vals = {}
    for line in metrics.splitlines():
        if line.startswith(name + "_sum ") or line.startswith(name + "_count "):
            k, v = line.split()
            vals[k.rsplit("_", 1)[1]] = float(v)
    return vals.get("sum", 0.0) / max(1.0, vals.get("count", 0.0)) * 1e3


print(f"{tree}: PUBACKed {r['pub_msgs_per_s']:,}/s, delivered {r['recv_msgs_per_s']:,}/s, "
      f"broker CPU {r['broker_cpu_pct']} %, PUBACK mean "
      f"{mean_ms('lightgate_puback_latency_seconds'):.2f} ms, fsync round mean "
      f"{mean_ms('lightgate_fsync_latency_seconds'):.2f} ms")
PY
