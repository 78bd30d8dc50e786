"""Run the MQTT side of the gateway alone for mqttbench: store + light queues + notify + proxy.

Until `lightgate serve` wires the MQTT server, this is the broker command the benchmark starts:

    .venv/bin/python bench/mqtt_gateway.py --port 1883 --data-dir /tmp/lg-bench [--fsync always]

It wires the components exactly as the tests' in-process broker does (tests/mqtt_broker.py), on
uvloop, and removes the data dir first so every run starts empty. SIGTERM/SIGINT close gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def main(ns: argparse.Namespace) -> None:
    from lightqueue.queues import open_light_queues
    from mqtt_proxy.server import MqttServer
    from mqtt_proxy.settings import ProxySettings
    from notify import InProcessNotifier
    from store import Store, StoreConfig

    data = Path(ns.data_dir)
    if ns.fresh:
        shutil.rmtree(data, ignore_errors=True)
    store = await Store.open(data, StoreConfig(fsync=ns.fsync))
    queues = open_light_queues(data, store)
    notifier = InProcessNotifier(last_seq_of=queues.last_seq)
    queues.set_sink(notifier.publish)
    await queues.start()
    notifier.start()
    server = MqttServer(store, queues, notifier, ProxySettings(max_keepalive=65535))
    host, port = await server.start_tcp(ns.host, ns.port)
    print(f"lightgate-mqtt ready mqtt={host}:{port}", flush=True)
    if ns.stats:
        loop0 = asyncio.get_running_loop()

        def report() -> None:
            st = server.stats()
            d = server.delivery
            qinfo = {
                name: (
                    qs.last_seq,
                    qs.read_end,
                    len(qs.cache),
                    [s.pos for s in qs.subs][:3],
                    [s.session.conn is not None and s.session.conn.writable for s in qs.subs][:3],
                )
                for name, qs in list(d.queues.items())[:3]
            }
            qinfo["sched"] = (d._scheduled, len(d._dirty))
            print(
                f"behind={queues.dispatcher.behind()} indexed={queues.dispatcher.records} recv={st['messages_received']} "
                f"sent={st['messages_sent']} pauses={st['write_pauses']} q={qinfo}",
                file=sys.stderr,
                flush=True,
            )
            loop0.call_later(1.0, report)

        loop0.call_later(1.0, report)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    await queues.close()
    await notifier.close()
    await store.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1883)
    ap.add_argument("--data-dir", default="/tmp/lightgate-mqtt-bench")
    ap.add_argument("--fsync", default="always", choices=("always", "interval_ms", "never"))
    ap.add_argument("--stats", action="store_true", help="print progress every second")
    ap.add_argument("--keep", dest="fresh", action="store_false", help="keep the data dir")
    ns = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(main(ns))
