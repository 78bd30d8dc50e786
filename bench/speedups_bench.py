"""The compiled hot loops against their pure-Python twins, µs per message, same run.

    .venv/bin/python bench/speedups_bench.py [--n 5000] [--repeat 15]

Fan-in's shape: 64-byte QoS 0 PUBLISHes from 10 clients on 10 topics, MQTT 3.1.1. Stages:
parse (`Parser.feed` on 64 KiB chunks: `_walk` vs `_cparser.walk`), record building (one batch:
`_build_records_py`, i.e. aiokafka's Cython builder, vs `store/_cmqtt_batches.build_records`), dispatch
(one batch into an exact and a filter queue: `_index_batch_py`, i.e. aiokafka's Cython reader +
the Python loop, vs `lightqueue/_cindex.index_batch`). Best of `--repeat`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightqueue.dispatcher as dispatcher  # noqa: E402
import mqtt_proxy.codec.parser as parser  # noqa: E402
import store.mqtt_batches as mqtt_batches  # noqa: E402
from lightqueue.db import Queue  # noqa: E402
from lightqueue.keys import entry_head  # noqa: E402
from mqtt_proxy.codec import Parser, encode_publish  # noqa: E402
from store.mapping import MqttMessage  # noqa: E402
from store.speedups import load  # noqa: E402


def best(fn: Any, n: int, repeat: int) -> float:
    b = 1e9
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    sp, cp = load("store._cmqtt_batches"), load("mqtt_proxy.codec._cparser")
    ci = load("lightqueue._cindex")
    if sp is None or cp is None or ci is None:
        sys.exit("compiled modules not built (pip install -e . / setup.py build_ext --inplace)")
    n = a.n
    msgs = [
        MqttMessage(f"bench/fanin/{i % 10}", b"x" * 64, 0, f"pub-{i % 10}", False, None, 1 + i)
        for i in range(n)
    ]
    keys = [m.topic.encode() for m in msgs]
    idxs = list(range(n))

    stream = b"".join(encode_publish(m.topic, m.payload) for m in msgs)
    chunks = [stream[i : i + 65536] for i in range(0, len(stream), 65536)]

    def parse(walk: Any) -> None:
        parser._walk = walk
        p = Parser(version=4)
        for c in chunks:
            p.feed(c)

    def build(fn: Any) -> None:
        fn(msgs, idxs, 0, keys, 0, {}, 1 << 30)

    data = bytes(mqtt_batches._build_records_py(msgs, idxs, 0, keys, 0, {}, 1 << 30)[0])
    filt = Queue("bench/fanin/#", 1, 1, 0, 0)
    qs = {k: Queue(k.decode(), 2 + i, 0, 0, 0) for i, k in enumerate(sorted(set(keys)))}
    ehead = entry_head(3, 0)

    def index(fn: Any) -> None:
        for q in (filt, *qs.values()):
            q.buf = None  # (the dispatcher writes and clears them at the end of a round)
        fn(data, 0, len(data), 0, 0, 1 << 40, 0, 1 << 30, {}, lambda k: (qs[k], filt), ehead,
           1, [], None, "t", 0)  # fmt: skip

    rows = [
        ("parse (Parser.feed, 64 KiB chunks)", lambda: parse(Parser._walk), lambda: parse(cp.walk)),
        ("record building (one batch)", lambda: build(mqtt_batches._build_records_py),
         lambda: build(sp.build_records)),
        ("dispatch (one batch, 2 queues)", lambda: index(dispatcher._index_batch_py),
         lambda: index(ci.index_batch)),
    ]  # fmt: skip
    print(f"n={n}, best of {a.repeat}, µs per message")
    print("| stage | pure-Python twin | compiled | ratio |")
    print("|---|---:|---:|---:|")
    for name, py, cy in rows:
        tp, tc = best(py, n, a.repeat), best(cy, n, a.repeat)
        print(f"| {name} | {tp:.3f} | {tc:.3f} | {tp / tc:.1f}x |")


if __name__ == "__main__":
    main()
