"""Socket fuzzer: random and mutated valid sessions against a running gateway's MQTT, WebSocket
and Kafka ports, with a health check after every batch.

    python tests/socket_fuzzer.py --seconds 120            # starts its own gateway
    python tests/socket_fuzzer.py --seed 1234 --batch 17   # replay one batch of a past run
    python tests/socket_fuzzer.py --target mqtt=127.0.0.1:1883,ws=127.0.0.1:8083,\
kafka=127.0.0.1:9092 --pid 4242 --log gateway.log     # fuzz a gateway you started

A batch is `--conns` concurrent connections, each one session (see fuzz_inputs.py): a valid one
sent as is, a valid one mutated, or random bytes, written in random chunks and then closed,
aborted or left to the gateway. After the batch the gateway must (1) still run, (2) carry an MQTT
publish to a subscriber (paho: v3.1.1, v5 and v5 over WebSocket in turn) and a Kafka record from
producer to consumer (aiokafka), (3) have no "Traceback", "Unhandled" or asyncio "Exception in
callback" / "never retrieved" line in its log, and (4) keep its RSS under the baseline plus
`--rss-growth-mb`. The first failure stops the run, printing the seed and batch that reproduce
it; batch `b` of seed `s` is the same bytes on every run (`--seed s --batch b --conns n`), and
`--dump FILE` writes them as JSON (hex per connection) for a regression test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import fuzz_inputs as fi  # noqa: E402
from gateway_process import GatewayProcess  # noqa: E402

CRASH_MARKERS = ("Traceback", "Unhandled", "Exception in callback", "exception was never retrieved")


class FuzzFailure(AssertionError):
    pass


@dataclass
class Target:
    endpoints: dict[str, tuple[str, int]]
    pid: int
    log_path: Path
    proc: GatewayProcess | None = None
    log_pos: int = 0
    rss_baseline_kb: int = 0
    rss_peak_kb: int = 0
    crash_lines: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        if self.proc is not None and self.proc.proc is not None:
            return self.proc.proc.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def rss_kb(self) -> int:
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def new_log(self) -> str:
        """Log text written since the last call."""
        with open(self.log_path, "rb") as fh:
            fh.seek(self.log_pos)
            data = fh.read()
        self.log_pos += len(data)
        return data.decode(errors="replace")


def batch_sessions(seed: int, batch: int, conns: int) -> list[tuple[str, list[bytes], str]]:
    """(listener, chunks, ending) per connection: a pure function of (seed, batch)."""
    out = []
    for i in range(conns):
        rng = random.Random(f"{seed}/{batch}/{i}")
        listener = rng.choice(["mqtt", "mqtt", "ws", "kafka", "kafka"])
        kind = rng.random()
        if listener == "kafka":
            packets = fi.kafka_session(rng)
        else:
            packets = fi.mqtt_session(rng)
        if kind < 0.3:
            pass  # valid
        elif kind < 0.9:
            packets = fi.mutate(rng, packets, "kafka" if listener == "kafka" else "mqtt")
        else:
            packets = fi.random_bytes(rng) if rng.random() < 0.5 else packets + fi.random_bytes(rng)
        if listener == "ws":
            packets = fi.ws_session(rng, packets)
            if kind > 0.6:  # sometimes break the WebSocket layer itself
                packets = fi.mutate(rng, packets, "ws")
        data = b"".join(packets)
        style = rng.random()
        if style < 0.4:
            chunks = packets
        elif style < 0.6:
            chunks = [data]
        elif style < 0.7 and len(data) < 300:
            chunks = [data[j : j + 1] for j in range(len(data))]
        else:
            cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, 5))) if data else []
            chunks = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)], strict=True)]
        ending = rng.choice(["close", "close", "abort", "linger", "half"])
        out.append((listener, [c for c in chunks if c], ending))
    return out


async def run_connection(addr: tuple[str, int], chunks: list[bytes], ending: str) -> None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*addr), 5)
    except (OSError, TimeoutError):
        return
    try:
        for chunk in chunks:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 2)
            if len(chunks) > 1:
                await asyncio.sleep(0)
        if ending == "half":
            writer.write_eof()
        with contextlib.suppress(TimeoutError):
            # read what the gateway answers until it closes or goes quiet
            while await asyncio.wait_for(reader.read(65536), 0.3 if ending != "linger" else 1.5):
                pass
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        pass
    finally:
        if ending == "abort":
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):  # RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 2)


async def run_batch(target: Target, sessions: list[tuple[str, list[bytes], str]]) -> None:
    await asyncio.gather(
        *(run_connection(target.endpoints[lst], ch, end) for lst, ch, end in sessions)
    )


def mqtt_round_trip(
    host: str, port: int, v5: bool, timeout: float = 10.0, ws: tuple[str, int] | None = None
) -> None:
    """paho: a subscriber (over WebSocket when `ws` is given) gets what a publisher sends
    (QoS 1), within `timeout`."""
    import paho.mqtt.client as mqtt

    proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
    topic = f"health/{uuid.uuid4().hex[:8]}"
    got = threading.Event()
    subscribed = threading.Event()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=proto,
                      transport="websockets" if ws else "tcp")  # fmt: skip
    sub.on_message = lambda c, u, m: got.set() if m.payload == b"ping" else None
    sub.on_subscribe = lambda *a: subscribed.set()
    pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=proto)
    try:
        if ws:
            sub.ws_set_options(path="/mqtt")
            sub.connect(*ws, keepalive=30)
        else:
            sub.connect(host, port, 30)
        sub.loop_start()
        sub.subscribe(topic, 1)
        if not subscribed.wait(timeout):
            raise FuzzFailure("MQTT health check: no SUBACK")
        pub.connect(host, port, 30)
        pub.loop_start()
        pub.publish(topic, b"ping", 1).wait_for_publish(timeout)
        if not got.wait(timeout):
            raise FuzzFailure("MQTT health check: the message was not delivered")
    finally:
        for c in (pub, sub):
            with contextlib.suppress(Exception):
                c.disconnect()
                c.loop_stop()


async def kafka_round_trip(host: str, port: int, timeout: float = 15.0) -> None:
    """aiokafka: produce one record, then fetch it back from its offset."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    bootstrap = f"{host}:{port}"
    value = uuid.uuid4().bytes
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await asyncio.wait_for(producer.start(), timeout)
    try:
        meta = await asyncio.wait_for(producer.send_and_wait("health", value), timeout)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await asyncio.wait_for(consumer.start(), timeout)
    try:
        tp = TopicPartition("health", meta.partition)
        consumer.assign([tp])
        consumer.seek(tp, meta.offset)
        msg = await asyncio.wait_for(consumer.getone(), timeout)
        if msg.value != value:
            raise FuzzFailure("Kafka health check: fetched a different record")
    finally:
        await consumer.stop()


async def health_check(
    target: Target, n: int, rss_growth_kb: int, keep_going: bool = False
) -> None:
    if not target.alive():
        raise FuzzFailure("the gateway process died")
    text = target.new_log()
    crashes = [ln for ln in text.splitlines() if any(m in ln for m in CRASH_MARKERS)]
    if crashes:
        target.crash_lines += crashes
        if not keep_going:
            raise FuzzFailure("crash in the gateway log: " + crashes[0])
        print(f"batch {n - 1}: {len(crashes)} crash lines:\n{text}", file=sys.stderr)
    host, port = target.endpoints["mqtt"]
    ws = target.endpoints.get("ws") if n % 3 == 2 else None  # TCP v3.1.1, TCP v5, WebSocket
    await asyncio.get_running_loop().run_in_executor(
        None, mqtt_round_trip, host, port, n % 3 != 0, 10.0, ws
    )
    await kafka_round_trip(*target.endpoints["kafka"])
    rss = target.rss_kb()
    target.rss_peak_kb = max(target.rss_peak_kb, rss)
    if not target.rss_baseline_kb:
        target.rss_baseline_kb = rss
    elif rss > target.rss_baseline_kb + rss_growth_kb:
        raise FuzzFailure(f"RSS grew from {target.rss_baseline_kb} kB to {rss} kB")


def start_gateway(data_dir: Path, extra: list[str]) -> Target:
    gw = GatewayProcess(data_dir, extra).start()
    assert gw.proc is not None and gw.log_path is not None
    return Target(gw.endpoints, gw.proc.pid, gw.log_path, gw)


async def fuzz(
    target: Target,
    seed: int,
    seconds: float,
    conns: int = 24,
    only_batch: int | None = None,
    rss_growth_mb: int = 200,
    keep_going: bool = False,
    say=print,  # noqa: ANN001 - print or a logger
) -> int:
    """Run batches until `seconds` pass (or only `only_batch`); returns the batches run.
    Raises FuzzFailure naming the seed and batch."""
    await health_check(target, 0, rss_growth_mb * 1024)  # baseline, and a gateway that works
    deadline = time.monotonic() + seconds
    batch = 0 if only_batch is None else only_batch
    done = 0
    while True:
        sessions = batch_sessions(seed, batch, conns)
        try:
            await asyncio.wait_for(run_batch(target, sessions), 60)
            await health_check(target, batch + 1, rss_growth_mb * 1024, keep_going)
        except Exception as exc:  # a failed check, a client that timed out, ...
            raise FuzzFailure(
                f"seed {seed} batch {batch}: {exc!r}\n"
                f"reproduce: python tests/socket_fuzzer.py --seed {seed} --batch {batch} --conns {conns}"
            ) from exc
        done += 1
        if only_batch is not None or time.monotonic() >= deadline:
            break
        batch += 1
    say(f"fuzz: seed {seed}: {done} batches x {conns} connections, gateway fine "
        f"(RSS {target.rss_baseline_kb} kB at start, peak {target.rss_peak_kb} kB)")  # fmt: skip
    return done


def dump(path: Path, seed: int, batch: int, conns: int) -> None:
    rows = [
        {"listener": lst, "ending": end, "chunks": [c.hex() for c in chunks]}
        for lst, chunks, end in batch_sessions(seed, batch, conns)
    ]
    path.write_text(json.dumps({"seed": seed, "batch": batch, "connections": rows}, indent=1))


def parse_target(spec: str) -> dict[str, tuple[str, int]]:
    out = {}
    for part in spec.split(","):
        name, _, addr = part.partition("=")
        host, _, port = addr.rpartition(":")
        out[name] = (host, int(port))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="run only this batch of the seed")
    ap.add_argument("--conns", type=int, default=24, help="connections per batch")
    ap.add_argument("--rss-growth-mb", type=int, default=200)
    ap.add_argument("--dump", type=Path, help="write the batch's bytes (--seed, --batch) as JSON")
    ap.add_argument("--target", help="mqtt=H:P,ws=H:P,kafka=H:P of a running gateway")
    ap.add_argument("--pid", type=int, help="its process id (RSS, liveness)")
    ap.add_argument("--log", type=Path, help="its log file (crash lines)")
    ap.add_argument("--keep-going", action="store_true", help="report log crashes, go on")
    ap.add_argument("--gateway-arg", action="append", default=[], help="extra `serve` argument")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    if args.dump:
        dump(args.dump, seed, args.batch or 0, args.conns)
        return 0
    print(f"fuzz: seed {seed}", flush=True)
    tmp = None
    if args.target:
        if not (args.pid and args.log):
            ap.error("--target needs --pid and --log")
        target = Target(parse_target(args.target), args.pid, args.log)
        target.log_pos = args.log.stat().st_size
    else:
        tmp = tempfile.TemporaryDirectory(prefix="lightgate-fuzz-")
        target = start_gateway(Path(tmp.name) / "data", args.gateway_arg)
    try:
        asyncio.run(
            fuzz(
                target,
                seed,
                args.seconds,
                args.conns,
                args.batch,
                args.rss_growth_mb,
                args.keep_going,
            )
        )
        return 0
    except FuzzFailure as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        if target.proc is not None:  # our own gateway: its log goes with the temporary dir
            print(target.log_path.read_text(errors="replace")[-6000:], file=sys.stderr)
        return 1
    finally:
        if target.proc is not None:
            try:
                target.proc.stop()
            except Exception:
                target.proc.kill()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
