"""The Produce path without a task: appends in request order, responses in request order, and the
response written before the light-queue dispatch round that the same commit tick woke."""

from __future__ import annotations

import asyncio
import select
import socket
import struct
from pathlib import Path

import pytest
from aiokafka.protocol.fetch import FetchRequest_v4
from aiokafka.protocol.metadata import MetadataRequest_v4
from aiokafka.protocol.produce import ProduceRequest_v7
from kafka_helpers import RawClient, make_batch, running_gateway

from lightqueue.queues import open_light_queues
from store.kafka.server import KafkaServer
from store.store import Store, StoreConfig

pytestmark = pytest.mark.timeout(60)


def frame(req, cid: int) -> bytes:  # type: ignore[no-untyped-def]
    body = req.build_request_header(cid, "path").encode() + req.encode()
    return struct.pack(">i", len(body)) + body


def read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "connection closed"
            out += chunk
        return out

    (size,) = struct.unpack(">i", exactly(4))
    return exactly(size)


@pytest.mark.parametrize("fsync", ["interval_ms", "never"])
async def test_produce_response_is_written_before_the_dispatch_round(
    tmp_path: Path, fsync: str
) -> None:
    """The dispatcher is woken inside the commit tick, before the tick resolves the appends'
    durability; it yields once, so the produce response (written from the last durability
    callback) is on the socket when its round indexes the records."""
    store = await Store.open(tmp_path, StoreConfig(default_partitions=4, fsync=fsync))
    store.ensure_topic("t", 4)
    readable_in_round: list[bool] = []
    sock: socket.socket | None = None

    def sink(events: list[tuple[str, int]]) -> None:
        assert sock is not None
        readable_in_round.append(bool(select.select([sock], [], [], 0)[0]))

    lq = open_light_queues(tmp_path, store, sink=sink)
    await lq.start()
    server = KafkaServer(store, "127.0.0.1", 0)
    await server.start()
    try:
        await asyncio.sleep(0.05)  # the start-up round (nothing to index) is over
        sock = socket.create_connection(("127.0.0.1", server.port))
        parts = [(p, make_batch([b"v%d" % p] * 3, key=b"t/k")) for p in range(4)]
        sock.sendall(frame(ProduceRequest_v7(None, 1, 5000, [("t", parts)]), 1))
        for _ in range(200):
            if readable_in_round:
                break
            await asyncio.sleep(0.01)
        assert readable_in_round == [True]  # one round, and the response was already out
        sock.setblocking(True)
        resp = ProduceRequest_v7.RESPONSE_TYPE.decode(read_frame(sock)[4:])
        ((_, partitions),) = resp.topics
        assert sorted((p[0], p[1], p[2]) for p in partitions) == [(p, 0, 0) for p in range(4)]
        assert lq.dispatcher.behind() == 0
        res = lq.read("t/k", 0, 100)
        assert len(res.entries) == 12  # every record indexed
    finally:
        if sock is not None:
            sock.close()
        await server.close()
        await lq.close()
        await store.close()


async def test_produce_after_metadata_in_one_chunk_keeps_request_order(tmp_path: Path) -> None:
    """A Metadata that auto-creates a topic and a Produce to it, in one TCP write: the Produce
    must not append before the Metadata task has run (it would find no topic)."""
    async with running_gateway(tmp_path / "data", partitions=2) as gw:
        client = await RawClient.connect(gw.server.port)
        try:
            batch = make_batch([b"first"])
            await client.send_raw(
                frame(MetadataRequest_v4(["fresh"], True), 1)
                + frame(ProduceRequest_v7(None, 1, 5000, [("fresh", [(1, batch)])]), 2)
            )
            meta, produced = await client.read_frame(), await client.read_frame()
            assert struct.unpack_from(">i", meta)[0] == 1
            assert struct.unpack_from(">i", produced)[0] == 2
            resp = ProduceRequest_v7.RESPONSE_TYPE.decode(produced[4:])
            assert resp.topics[0][1][0][1] == 0  # error code: none
            assert gw.store.high_watermark("fresh", 1) == 1
        finally:
            await client.close()


async def test_produce_behind_a_long_poll_fetch_answers_in_order(tmp_path: Path) -> None:
    """A fetch long-polls at the high watermark; a produce on the same connection appends at
    once (the fetch's task has started), wakes the fetch, and the responses come in order."""
    async with running_gateway(tmp_path / "data", partitions=1, fsync="always") as gw:
        gw.store.ensure_topic("lp", 1)
        client = await RawClient.connect(gw.server.port)
        try:
            fetch = FetchRequest_v4(-1, 5000, 1, 1 << 20, 0, [("lp", [(0, 0, 1 << 20)])])
            await client.send_raw(frame(fetch, 1))
            await asyncio.sleep(0.1)  # the fetch is waiting
            batch = make_batch([b"wake-up"])
            await client.send_raw(
                frame(ProduceRequest_v7(None, -1, 5000, [("lp", [(0, batch)])]), 2)
            )
            first = await asyncio.wait_for(client.read_frame(), 5)
            second = await asyncio.wait_for(client.read_frame(), 5)
            assert struct.unpack_from(">i", first)[0] == 1
            assert struct.unpack_from(">i", second)[0] == 2
            fetched = FetchRequest_v4.RESPONSE_TYPE.decode(first[4:])
            records = fetched.topics[0][1][0][-1]
            assert records and records[:8] == bytes(8)  # the produced batch, base offset 0
            produced = ProduceRequest_v7.RESPONSE_TYPE.decode(second[4:])
            assert produced.topics[0][1][0][1:3] == (0, 0)  # no error, base offset 0
        finally:
            await client.close()
