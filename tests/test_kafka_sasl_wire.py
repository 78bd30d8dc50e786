"""SASL and ACLs on the Kafka listener, byte for byte: frames encoded with aiokafka's structs (an
implementation independent of ours) against a KafkaServer with a real `store.auth.Security`."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.protocol.admin import (
    ApiVersionRequest_v0,
    SaslAuthenticateRequest_v0,
    SaslHandShakeRequest_v0,
    SaslHandShakeRequest_v1,
)
from aiokafka.protocol.metadata import MetadataRequest_v1
from aiokafka.protocol.produce import ProduceRequest_v3

from store.auth import PasswordFile, Security
from tests.kafka_helpers import Gateway, RawClient, make_batch, running_gateway

pytestmark = pytest.mark.asyncio

ACL = """\
user alice
topic readwrite t/#
user bob
topic read t/#
"""


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[tuple[Gateway, Security]]:
    pw = PasswordFile()
    pw.set("alice", "secret", iterations=64)
    pw.set("bob", "builder", iterations=64)
    pw.save(tmp_path / "passwd")
    (tmp_path / "acl").write_text(ACL)
    security = Security.load(
        password_file=str(tmp_path / "passwd"), acl_file=str(tmp_path / "acl"),
        allow_anonymous=False,
    )  # fmt: skip
    async with running_gateway(tmp_path / "data", security=security) as g:
        g.store.ensure_topic("t", 1)
        g.store.ensure_topic("other", 1)
        yield g, security


def frame(req: Any, cid: int) -> bytes:
    body = req.build_request_header(cid, "wire").encode() + req.encode()
    return struct.pack(">i", len(body)) + body


async def login(c: RawClient, user: str, password: str) -> Any:
    hs = await c.request(SaslHandShakeRequest_v1("PLAIN"))
    assert hs.error_code == 0 and "SCRAM-SHA-512" in hs.enabled_mechanisms
    return await c.request(SaslAuthenticateRequest_v0(f"\0{user}\0{password}".encode()))


def produce(topic: str) -> Any:
    return ProduceRequest_v3(None, -1, 5000, [(topic, [(0, make_batch([b"v"]))])])


async def test_only_api_versions_and_sasl_before_authentication(
    gw: tuple[Gateway, Security],
) -> None:
    g, _ = gw
    c = await RawClient.connect(g.server.port)
    versions = await c.request(ApiVersionRequest_v0())
    keys = {k: (lo, hi) for k, lo, hi in versions.api_versions}
    assert keys[17] == (0, 1) and keys[36] == (0, 2)
    await c.send_raw(frame(MetadataRequest_v1(["t"]), 7))
    assert await c.closed_by_peer()  # no response, as Kafka's authenticator
    await c.close()
    # SaslAuthenticate before SaslHandshake closes too
    c = await RawClient.connect(g.server.port)
    await c.send_raw(frame(SaslAuthenticateRequest_v0(b"\0alice\0secret"), 1))
    assert await c.closed_by_peer()
    await c.close()


async def test_bad_password_unknown_user_and_mechanism(gw: tuple[Gateway, Security]) -> None:
    g, _ = gw
    for user, password in (("alice", "wrong"), ("mallory", "secret")):
        c = await RawClient.connect(g.server.port)
        resp = await login(c, user, password)
        assert resp.error_code == 58  # SASL_AUTHENTICATION_FAILED
        assert "Authentication failed" in resp.error_message
        assert await c.closed_by_peer()
        await c.close()
    c = await RawClient.connect(g.server.port)
    hs = await c.request(SaslHandShakeRequest_v1("GSSAPI"))
    assert hs.error_code == 33 and set(hs.enabled_mechanisms) == {"PLAIN", "SCRAM-SHA-512"}
    assert await c.closed_by_peer()
    await c.close()


async def test_pipelined_login_and_requests_keep_order(gw: tuple[Gateway, Security]) -> None:
    """Frames sent behind a SaslAuthenticate wait for it (its check runs in a thread)."""
    g, _ = gw
    c = await RawClient.connect(g.server.port)
    await c.send_raw(
        frame(SaslHandShakeRequest_v1("PLAIN"), 1)
        + frame(SaslAuthenticateRequest_v0(b"\0alice\0secret"), 2)
        + frame(MetadataRequest_v1(["t"]), 3)
        + frame(produce("t"), 4)
    )
    cids = []
    for _ in range(4):
        (cid,) = struct.unpack_from(">i", await asyncio.wait_for(c.read_frame(), 10))
        cids.append(cid)
    assert cids == [1, 2, 3, 4]
    assert g.store.high_watermark("t", 0) == 1
    await c.close()


async def test_handshake_v0_raw_tokens(gw: tuple[Gateway, Security]) -> None:
    """kafka-python before 2.1: after SaslHandshake v0 the tokens are bare length-prefixed frames."""
    g, _ = gw
    c = await RawClient.connect(g.server.port)
    hs = await c.request(SaslHandShakeRequest_v0("PLAIN"))
    assert hs.error_code == 0
    token = b"\0alice\0secret"
    await c.send_raw(struct.pack(">i", len(token)) + token)
    assert await asyncio.wait_for(c.read_frame(), 10) == b""
    md = await c.request(MetadataRequest_v1(["t"]))
    assert md.topics[0][0] == 0
    await c.close()
    c = await RawClient.connect(g.server.port)
    await c.request(SaslHandShakeRequest_v0("PLAIN"))
    token = b"\0alice\0nope"
    await c.send_raw(struct.pack(">i", len(token)) + token)
    assert await c.closed_by_peer()  # Kafka answers a failed raw token by closing
    await c.close()


async def test_acl_per_log_topic_and_reload_on_open_connection(
    gw: tuple[Gateway, Security], tmp_path: Path
) -> None:
    g, security = gw
    alice = await RawClient.connect(g.server.port)
    assert (await login(alice, "alice", "secret")).error_code == 0
    bob = await RawClient.connect(g.server.port)
    assert (await login(bob, "bob", "builder")).error_code == 0

    def errors(resp: Any) -> list[int]:
        return [p[1] for _, parts in resp.topics for p in parts]

    assert errors(await alice.request(produce("t"))) == [0]
    assert errors(await alice.request(produce("other"))) == [29]  # TOPIC_AUTHORIZATION_FAILED
    assert errors(await bob.request(produce("t"))) == [29]  # read only
    md = await bob.request(MetadataRequest_v1(["t", "other"]))
    assert {name: err for err, name, _, _ in md.topics} == {"t": 0, "other": 29}
    md = await bob.request(MetadataRequest_v1(None))  # all topics: only those it may see
    assert [name for _, name, _, _ in md.topics] == ["t"]
    # a reload (SIGHUP) applies to the open connections from their next request on
    (tmp_path / "acl").write_text("user alice\ntopic read t/#\nuser bob\ntopic readwrite t/#\n")
    assert security.reload() == []
    assert errors(await alice.request(produce("t"))) == [29]
    assert errors(await bob.request(produce("t"))) == [0]
    stats = g.server.stats()
    assert stats["kafka_authorization_failures_total"] >= 4
    await alice.close()
    await bob.close()


async def test_a_deny_under_the_log_topic_refuses_the_whole_topic(
    gw: tuple[Gateway, Security], tmp_path: Path
) -> None:
    """Log topic t is every MQTT topic under it: a deny on one of them refuses producing to t."""
    g, security = gw
    (tmp_path / "acl").write_text("user alice\ntopic readwrite t/#\ntopic deny t/secret/#\n")
    assert security.reload() == []
    c = await RawClient.connect(g.server.port)
    assert (await login(c, "alice", "secret")).error_code == 0
    resp = await c.request(produce("t"))
    assert resp.topics[0][1][0][1] == 29
    await c.close()


async def test_without_security_a_handshake_is_illegal_state(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as g:
        c = await RawClient.connect(g.server.port)
        hs = await c.request(SaslHandShakeRequest_v1("PLAIN"))
        assert hs.error_code == 34  # ILLEGAL_SASL_STATE, as on a Kafka PLAINTEXT listener
        md = await c.request(MetadataRequest_v1(["x"]))
        assert md.topics[0][0] == 0
        await c.close()


async def test_transaction_apis_check_the_log_topic(gw: tuple[Gateway, Security]) -> None:
    """AddPartitionsToTxn needs write on the log topic (as Produce), TxnOffsetCommit read (as
    OffsetCommit): TOPIC_AUTHORIZATION_FAILED, the other partitions not attempted."""
    from aiokafka.protocol.transaction import (
        AddPartitionsToTxnRequest_v0,
        InitProducerIdRequest_v0,
        TxnOffsetCommitRequest_v0,
    )

    g, _ = gw
    bob = await RawClient.connect(g.server.port)
    assert (await login(bob, "bob", "builder")).error_code == 0
    init = await bob.request(InitProducerIdRequest_v0("w-bob", 60_000))
    assert init.error_code == 0
    add = await bob.request(
        AddPartitionsToTxnRequest_v0("w-bob", init.producer_id, init.producer_epoch, [("t", [0])])
    )
    assert add.errors == [("t", [(0, 29)])]  # bob may only read t
    alice = await RawClient.connect(g.server.port)
    assert (await login(alice, "alice", "secret")).error_code == 0
    init = await alice.request(InitProducerIdRequest_v0("w-alice", 60_000))
    add = await alice.request(
        AddPartitionsToTxnRequest_v0(
            "w-alice", init.producer_id, init.producer_epoch, [("t", [0]), ("other", [0])]
        )
    )
    assert sorted(add.errors) == [("other", [(0, 29)]), ("t", [(0, 55)])]  # 55: not attempted
    commit = await alice.request(
        TxnOffsetCommitRequest_v0(
            "w-alice", "g", init.producer_id, init.producer_epoch, [("other", [(0, 1, "")])]
        )
    )
    assert commit.errors == [("other", [(0, 29)])]
    await alice.close()
    await bob.close()
