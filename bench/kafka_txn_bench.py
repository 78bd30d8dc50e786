"""Transactional vs non-transactional produce throughput, confluent-kafka (librdkafka), one run.

The gateway (`bench/kafka_bench.py --serve`: Store + KafkaServer, uvloop) runs in a child process.
Phases, alternating so load drifts hit each alike (`--rounds` times each, medians reported):
  plain          acks=all, no idempotence
  idempotent     enable.idempotence (acks=all)
  transactional  transactional.id, one transaction per `--per-txn` records (begin, produce,
                 commit_transaction, which flushes and writes one marker per partition)

    .venv/bin/python bench/kafka_txn_bench.py --records 50000 --value-size 1024 --partitions 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import confluent_kafka as ck

ROOT = Path(__file__).resolve().parent.parent


def run_phase(bootstrap: str, kind: str, topic: str, args: argparse.Namespace) -> float:
    """Records per second of one phase."""
    conf: dict[str, object] = {"bootstrap.servers": bootstrap, "linger.ms": args.linger_ms,
                               "acks": "all", "queue.buffering.max.messages": 1_000_000}  # fmt: skip
    if kind == "idempotent":
        conf["enable.idempotence"] = True
    if kind == "transactional":
        conf["transactional.id"] = f"bench-{topic}"
    p = ck.Producer(conf)
    value = b"x" * args.value_size
    if kind == "transactional":
        p.init_transactions(30)
    parts = args.partitions
    t0 = time.perf_counter()
    if kind == "transactional":
        for start in range(0, args.records, args.per_txn):
            p.begin_transaction()
            for i in range(start, min(args.records, start + args.per_txn)):
                p.produce(topic, value, partition=i % parts)
                p.poll(0)
            p.commit_transaction(60)
    else:
        for i in range(args.records):
            while True:
                try:
                    p.produce(topic, value, partition=i % parts)
                    break
                except BufferError:
                    p.poll(0.01)
            p.poll(0)
        p.flush(60)
    return args.records / (time.perf_counter() - t0)


def main(args: argparse.Namespace) -> None:
    results: dict[str, list[float]] = {"plain": [], "idempotent": [], "transactional": []}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        child = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "kafka_bench.py"), "--serve", tmp,
             "--fsync", args.fsync, "--partitions", str(args.partitions)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None and child.stdin is not None
        try:
            bootstrap = f"127.0.0.1:{int(child.stdout.readline())}"
            for r in range(args.rounds):
                for kind in results:
                    rate = run_phase(bootstrap, kind, f"{kind}-{r}", args)
                    results[kind].append(rate)
                    print(f"round {r} {kind:14} {rate:10.0f} records/s", flush=True)
        finally:
            child.stdin.close()
            child.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in results.items()}
    mb = {k: v * args.value_size / 1e6 for k, v in med.items()}
    print(json.dumps({"config": vars(args), "median records/s": med, "median MB/s": mb}, indent=1))
    ratio = med["transactional"] / med["plain"]
    print(f"transactional / plain = {ratio:.2f}; "
          f"transactional / idempotent = {med['transactional'] / med['idempotent']:.2f}")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--value-size", type=int, default=1024)
    ap.add_argument("--per-txn", type=int, default=1000, help="records per transaction")
    ap.add_argument("--linger-ms", type=int, default=5)
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fsync", default="always", help="store fsync policy (always|interval_ms)")
    ap.add_argument("--tmp", default=None, help="directory for the data dir (default: system tmp)")
    main(ap.parse_args())
