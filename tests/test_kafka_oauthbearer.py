"""SASL/OAUTHBEARER on the Kafka listener with the JWTs MQTT takes, and their ACL claim, against a
real `lightgate serve`, with librdkafka (confluent-kafka's `oauth_cb`) and aiokafka
(`sasl_oauth_token_provider`): a good token produces and fetches, a bad one is refused at login,
a token's rights refuse what they do not cover with TOPIC_AUTHORIZATION_FAILED."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from auth_helpers import HS_SECRET, token
from gateway_process import GatewayProcess

pytestmark = pytest.mark.timeout(120)

RIGHTS = {
    "alice": {"all": ["sensors/#"]},
    "bob": {"sub": ["sensors/#"]},  # read only
    "carol": {"pub": ["sensors/#"]},  # write only
}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("oauth")
    (root / "secret").write_bytes(HS_SECRET)
    args = [f"--set=auth_jwt_secret_file={root / 'secret'}", "--set=allow_anonymous=false",
            "--set=default_partitions=1", "--ws-port=-1"]  # fmt: skip
    gateway = GatewayProcess(root / "data", args).start()
    yield gateway
    gateway.stop()


def bootstrap(gw: GatewayProcess) -> str:
    return f"127.0.0.1:{gw.port('kafka')}"


def jwt_of(user: str, ttl: float = 300, secret: bytes = HS_SECRET) -> str:
    return token(secret, "HS256", sub=user, ttl=ttl, acl=RIGHTS[user])


# --- librdkafka -------------------------------------------------------------------------------


def rdkafka_conf(gw: GatewayProcess, tok: str) -> dict[str, Any]:
    def oauth_cb(_config: str) -> tuple[str, float]:
        return tok, time.time() + 300

    return {"bootstrap.servers": bootstrap(gw), "log_level": 0, "security.protocol":
            "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER", "oauth_cb": oauth_cb}  # fmt: skip


def test_confluent_kafka(gw: GatewayProcess) -> None:
    from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

    results: list[Any] = []
    p = Producer(rdkafka_conf(gw, jwt_of("alice")))
    p.produce("sensors", b"rd", key="sensors/rd", on_delivery=lambda e, m: results.append(e))
    p.flush(15)
    assert results == [None]

    def first_error_or_keys(user: str) -> tuple[Any, list[bytes]]:
        conf = {**rdkafka_conf(gw, jwt_of(user)), "group.id": f"g-{user}"}
        c = Consumer(conf)
        c.assign([TopicPartition("sensors", 0, 0)])
        keys: list[bytes] = []
        deadline = time.monotonic() + 10
        try:
            while b"sensors/rd" not in keys and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is not None and m.error() is not None:
                    return m.error(), keys
                if m is not None:
                    keys.append(m.key())
        finally:
            c.close()
        return None, keys

    assert first_error_or_keys("bob") == (None, [b"sensors/rd"])
    error, _ = first_error_or_keys("carol")
    assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED

    results.clear()
    p = Producer(rdkafka_conf(gw, jwt_of("bob")))
    p.produce("sensors", b"x", key="sensors/b", on_delivery=lambda e, m: results.append(e))
    p.flush(15)
    assert results and results[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


@pytest.mark.parametrize("why", ["expired", "wrong key"])
def test_confluent_kafka_refused(gw: GatewayProcess, why: str) -> None:
    from confluent_kafka import KafkaError, Producer

    tok = jwt_of("alice", ttl=-60) if why == "expired" else jwt_of("alice", secret=b"w" * 40)
    errors: list[Any] = []
    p = Producer({**rdkafka_conf(gw, tok), "error_cb": errors.append})
    p.produce("sensors", b"x", key="sensors/x")
    deadline = time.monotonic() + 10
    while not errors and time.monotonic() < deadline:
        p.poll(0.1)
    p.purge()
    assert errors and errors[0].code() == KafkaError._AUTHENTICATION, errors


# --- aiokafka ---------------------------------------------------------------------------------


def aio_kwargs(tok: str) -> dict[str, Any]:
    from aiokafka.abc import AbstractTokenProvider

    class Provider(AbstractTokenProvider):
        async def token(self) -> str:
            return tok

    return dict(bootstrap_servers=None, security_protocol="SASL_PLAINTEXT",
                sasl_mechanism="OAUTHBEARER", sasl_oauth_token_provider=Provider())  # fmt: skip


async def test_aiokafka(gw: GatewayProcess) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

    def kw(tok: str) -> dict[str, Any]:
        return {**aio_kwargs(tok), "bootstrap_servers": bootstrap(gw)}

    producer = AIOKafkaProducer(**kw(jwt_of("alice")))
    await producer.start()
    try:
        await producer.send_and_wait("sensors", b"aio", key=b"sensors/aio")
    finally:
        await producer.stop()

    async def fetch(user: str) -> list[bytes]:
        consumer = AIOKafkaConsumer(auto_offset_reset="earliest", **kw(jwt_of(user)))
        await consumer.start()
        try:
            consumer.assign([TopicPartition("sensors", 0)])
            out: list[bytes] = []
            deadline = time.monotonic() + 10
            while b"sensors/aio" not in out and time.monotonic() < deadline:
                for msgs in (await consumer.getmany(timeout_ms=300)).values():
                    out += [m.key for m in msgs]
            return out
        finally:
            await consumer.stop()

    assert b"sensors/aio" in await fetch("bob")
    with pytest.raises(TopicAuthorizationFailedError):
        await fetch("carol")
    producer = AIOKafkaProducer(**kw(jwt_of("bob")))
    await producer.start()
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.send_and_wait("sensors", b"x", key=b"sensors/b")
    finally:
        await producer.stop()
    for bad in (jwt_of("alice", ttl=-60), jwt_of("alice", secret=b"w" * 40), "not-a-jwt"):
        producer = AIOKafkaProducer(**kw(bad))
        with pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()


async def test_expired_token_closes_the_kafka_connection(gw: GatewayProcess) -> None:
    """The gateway closes a connection whose token expired; the client reconnects with the
    token its provider gives then."""
    from aiokafka import AIOKafkaProducer

    tokens = [jwt_of("alice", ttl=2)]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap(gw), **{
        k: v for k, v in aio_kwargs("").items() if k != "bootstrap_servers"
    })  # fmt: skip
    provider = producer.client._sasl_oauth_token_provider

    async def current() -> str:
        return tokens[-1]

    provider.token = current  # type: ignore[method-assign]
    await producer.start()
    try:
        await producer.send_and_wait("sensors", b"1", key=b"sensors/exp")
        tokens.append(jwt_of("alice", ttl=300))
        await asyncio.sleep(3.5)  # the first connection is closed by now
        await producer.send_and_wait("sensors", b"2", key=b"sensors/exp")
    finally:
        await producer.stop()
    log = Path(gw.log_path or "").read_text()
    assert "kafka token expired" in log
