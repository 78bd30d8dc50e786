"""Kafka listener throughput: aiokafka producer and consumer against the gateway.

The gateway (Store + KafkaServer, uvloop if installed) runs in a child process so client and
server each get a core. Measurements:
  produce      aiokafka producer, `--batch-size` byte batches, values of `--value-size` bytes
  produce raw  the same batches pre-built, 16 requests in flight: the server's ingest alone
               (aiokafka keeps one request in flight per broker, so it measures round trips)
  fetch        raw Fetch requests on one connection, records left undecoded: the server's side
  consume      aiokafka consumer (assign + seek to beginning), decoding every record in Python

    .venv/bin/python bench/kafka_bench.py --records 200000 --value-size 1024 --acks 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def serve(data_dir: str, fsync: str, partitions: int, dispatch: bool) -> None:
    """The gateway side. stdin: "lag" → prints records not yet dispatched; EOF → exit."""
    from store.kafka import KafkaServer
    from store.store import Store, StoreConfig

    config = StoreConfig(default_partitions=partitions, fsync=fsync)
    store = await Store.open(Path(data_dir), config)
    queues = None
    if dispatch:  # light-queue dispatch, as `lightgate serve` wires it
        from lightqueue.queues import open_light_queues

        queues = open_light_queues(Path(data_dir), store)
        await queues.start()
    server = KafkaServer(store, "127.0.0.1", 0)
    await server.start()
    print(server.port, flush=True)
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.strip() == "lag":
                print(queues.dispatcher.behind() if queues else 0, flush=True)
    finally:
        await server.close()
        if queues is not None:
            await queues.close()
        await store.close()


async def dispatch_lag(child: subprocess.Popen, produced: dict) -> dict:
    """After the produce phase: how long light-queue dispatch took to catch up."""
    assert child.stdin is not None and child.stdout is not None
    t0 = time.perf_counter()
    while True:
        child.stdin.write("lag\n")
        child.stdin.flush()
        if int(child.stdout.readline()) == 0:
            break
        await asyncio.sleep(0.05)
    extra = time.perf_counter() - t0
    total = produced["seconds"] + extra
    return {"phase": "dispatch caught up", "records": produced["records"], "MB": produced["MB"],
            "seconds": round(total, 2), "MB/s": round(produced["MB"] / total, 1),
            "records/s": round(produced["records"] / total),
            "after produce s": round(extra, 2)}  # fmt: skip


async def produce(bootstrap: str, args: argparse.Namespace) -> dict:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks=args.acks if args.acks == "all" else int(args.acks),
        max_batch_size=args.batch_size, linger_ms=args.linger_ms,
        compression_type=None if args.compression == "none" else args.compression,
        max_request_size=16 << 20,
    )  # fmt: skip
    await producer.start()
    value = os.urandom(args.value_size // 2).hex().encode()[: args.value_size]
    await producer.send_and_wait("bench", value, partition=0)  # connect, metadata
    t0 = time.perf_counter()
    pending = []
    for i in range(args.records):
        pending.append(await producer.send("bench", value, partition=i % args.partitions))
        if len(pending) >= 20_000:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    elapsed = time.perf_counter() - t0
    await producer.stop()
    return _rate("produce", args.records, args.records * args.value_size, elapsed)


async def raw_produce(port: int, args: argparse.Namespace) -> dict:
    """Produce v7 on one connection, 16 requests in flight, each one `--batch-size` batch per
    partition: the server's ingest capacity without aiokafka's one-request-per-broker limit."""
    from aiokafka.protocol.metadata import MetadataRequest_v1
    from aiokafka.protocol.produce import ProduceRequest_v7

    from store.record_batch import build_batch

    value = os.urandom(args.value_size // 2).hex().encode()[: args.value_size]
    per_batch = max(1, (args.batch_size - 100) // (args.value_size + 20))
    batch = bytes(build_batch([(int(time.time() * 1000), None, value, [])] * per_batch))
    parts = [(p, batch) for p in range(args.partitions)]
    n_req = max(1, args.records // (per_batch * args.partitions))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    def frame(req, cid: int) -> bytes:
        body = req.build_request_header(cid, "bench").encode() + req.encode()
        return struct.pack(">i", len(body)) + body

    async def answer() -> None:
        await reader.readexactly(struct.unpack(">i", await reader.readexactly(4))[0])

    writer.write(frame(MetadataRequest_v1(["bench-raw"]), 0))  # creates the topic
    await answer()
    acks = -1 if args.acks == "all" else int(args.acks) or 1
    data = frame(ProduceRequest_v7(None, acks, 30000, [("bench-raw", parts)]), 1)
    t0 = time.perf_counter()
    sent = done = 0
    while done < n_req:
        while sent < n_req and sent - done < 16:
            writer.write(data)
            sent += 1
        await answer()
        done += 1
    elapsed = time.perf_counter() - t0
    writer.close()
    n = n_req * per_batch * args.partitions
    return _rate("produce (raw, 16 in flight)", n, n * args.value_size, elapsed)


async def consume(bootstrap: str, args: argparse.Namespace) -> dict:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                max_partition_fetch_bytes=4 << 20, fetch_max_bytes=64 << 20)  # fmt: skip
    await consumer.start()
    tps = [TopicPartition("bench", p) for p in range(args.partitions)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    want, n, nbytes = args.records + 1, 0, 0
    t0 = time.perf_counter()
    while n < want:
        for msgs in (await consumer.getmany(timeout_ms=1000, max_records=100_000)).values():
            n += len(msgs)
            nbytes += sum(len(m.value) for m in msgs)
    elapsed = time.perf_counter() - t0
    await consumer.stop()
    return _rate("consume (aiokafka)", n, nbytes, elapsed)


async def raw_fetch(port: int, args: argparse.Namespace, hwms: list[int]) -> dict:
    """Fetch v4 on one connection, pipelined 4 deep; counts record bytes without decoding them."""
    from aiokafka.protocol.fetch import FetchRequest_v4, FetchResponse_v4

    from store.record_batch import iter_batch_headers

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    next_off = [0] * args.partitions
    nbytes = records = cid = 0
    inflight: list[int] = []  # partitions of requests on the wire, in order

    def send(p: int) -> None:
        nonlocal cid
        cid += 1
        req = FetchRequest_v4(-1, 100, 1, 64 << 20, 0, [("bench", [(p, next_off[p], 8 << 20)])])
        body = req.build_request_header(cid, "bench").encode() + req.encode()
        writer.write(struct.pack(">i", len(body)) + body)
        inflight.append(p)

    t0 = time.perf_counter()
    for p in range(args.partitions):
        send(p)
    while inflight:
        size = struct.unpack(">i", await reader.readexactly(4))[0]
        frame = await reader.readexactly(size)
        p = inflight.pop(0)
        resp = FetchResponse_v4.decode(frame[4:])
        data = resp.topics[0][1][0][-1] or b""
        for h in iter_batch_headers(data):
            last = h.base_offset + h.last_offset_delta
            if last >= next_off[p]:
                records += last + 1 - max(h.base_offset, next_off[p])
                next_off[p] = last + 1
        nbytes += len(data)
        if next_off[p] < hwms[p]:
            send(p)
    elapsed = time.perf_counter() - t0
    writer.close()
    return _rate("fetch (raw, undecoded)", records, nbytes, elapsed)


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measured(phase, child_pid: int, *a) -> dict:
    """Run a phase; add the CPU share used by the server and by this (client) process."""
    s0, c0, t0 = _cpu(child_pid), time.process_time(), time.perf_counter()
    result = await phase(*a)
    wall = time.perf_counter() - t0
    result["server CPU %"] = round(100 * (_cpu(child_pid) - s0) / wall)
    result["client CPU %"] = round(100 * (time.process_time() - c0) / wall)
    return result


def _rate(name: str, n: int, nbytes: int, elapsed: float) -> dict:
    return {"phase": name, "records": n, "MB": round(nbytes / 1e6, 1), "seconds": round(elapsed, 2),
            "MB/s": round(nbytes / 1e6 / elapsed, 1), "records/s": round(n / elapsed)}  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", tmp, "--fsync", args.fsync,
             "--partitions", str(args.partitions)] + (["--dispatch"] if args.dispatch else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None and child.stdin is not None
        try:
            port = int(child.stdout.readline())
            bootstrap = f"127.0.0.1:{port}"
            results = [await _measured(produce, child.pid, bootstrap, args)]
            if args.dispatch:
                results.append(await dispatch_lag(child, results[0]))
            results.append(await _measured(raw_produce, child.pid, port, args))
            if args.dispatch:
                results.append(await dispatch_lag(child, results[-1]))
            from aiokafka import AIOKafkaConsumer, TopicPartition

            c = AIOKafkaConsumer(bootstrap_servers=bootstrap)
            await c.start()
            tps = [TopicPartition("bench", p) for p in range(args.partitions)]
            ends = await c.end_offsets(tps)
            await c.stop()
            hwms = [ends[tp] for tp in tps]
            results.append(await _measured(raw_fetch, child.pid, port, args, hwms))
            results.append(await _measured(consume, child.pid, bootstrap, args))
        finally:
            child.stdin.close()
            child.wait(timeout=60)
    print(json.dumps({"config": vars(args), "results": results}, indent=1))
    for r in results:
        if "server CPU %" in r:
            extra = f"; CPU server {r['server CPU %']}%, client {r['client CPU %']}%"
        else:
            extra = f"; caught up {r['after produce s']} s after produce ended"
        print(f"{r['phase']:24} {r['MB/s']:8.1f} MB/s {r['records/s']:>10} records/s "
              f"({r['records']} records, {r['MB']} MB, {r['seconds']} s{extra})")  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--value-size", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16384, help="producer max_batch_size")
    ap.add_argument("--linger-ms", type=int, default=5)
    ap.add_argument("--acks", default="1", choices=["0", "1", "all"])
    ap.add_argument(
        "--compression", default="none", choices=["none", "gzip", "snappy", "lz4", "zstd"]
    )
    ap.add_argument("--partitions", type=int, default=1)
    ap.add_argument("--fsync", default="always", help="store fsync policy (always|interval|never)")
    ap.add_argument("--tmp", default=None, help="directory for the data dir (default: system tmp)")
    ap.add_argument("--dispatch", action="store_true", help="run light-queue dispatch too")
    ap.add_argument("--serve", metavar="DATA_DIR", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not os.environ.get("LIGHTGATE_NO_UVLOOP"):  # compare loops: LIGHTGATE_NO_UVLOOP=1
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
    if a.serve:
        asyncio.run(serve(a.serve, a.fsync, a.partitions, a.dispatch))
    else:
        asyncio.run(main(a))
