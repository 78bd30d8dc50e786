"""SASL and ACLs with real Kafka clients against `lightgate serve` with a password file and an ACL.

alice may read and write log topic `sensors` (every MQTT topic under it), bob only read it, carol
only write it. Each client library logs in with PLAIN and SCRAM-SHA-512, produces (an MQTT
subscriber receives it) and fetches; a wrong password, an unknown user and a client without SASL
are refused; bob's produce and carol's fetch are TOPIC_AUTHORIZATION_FAILED.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_process import ROOT, GatewayProcess
from mqtt_helpers import Client

from store.auth import PasswordFile

pytestmark = pytest.mark.timeout(120)

USERS = {"alice": "wonder land", "bob": "builder", "carol": "c4r0l"}
ACL = """\
user alice
topic readwrite sensors/#
user bob
topic read sensors/#
user carol
topic write sensors/#
"""
MECHANISMS = ["PLAIN", "SCRAM-SHA-512"]
needs_kcat = pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat not installed "
                                "(scripts/system-deps.sh)")  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("sasl")
    pw = PasswordFile()
    for user, password in USERS.items():
        pw.set(user, password)
    pw.save(root / "passwd")
    (root / "acl").write_text(ACL)
    args = [f"--set=password_file={root / 'passwd'}", f"--set=acl_file={root / 'acl'}",
            "--set=allow_anonymous=false", "--set=default_partitions=1"]  # fmt: skip
    gateway = GatewayProcess(root / "data", args).start()
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def subscriber(gw: GatewayProcess) -> Iterator[Client]:
    """An MQTT subscriber (alice) of everything under sensors/: Kafka produces reach it."""
    c = Client(gw.port("mqtt"), "sasl-watcher").connect(username="alice", password=USERS["alice"])
    c.subscribe("sensors/#", 1)
    yield c
    c.disconnect()


def bootstrap(gw: GatewayProcess) -> str:
    return f"127.0.0.1:{gw.port('kafka')}"


def mqtt_gets(sub: Client, topic: str, payload: bytes) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for m in sub.expect(1, timeout=deadline - time.monotonic()):
            if (m.topic, m.payload) == (topic, payload):
                return
    raise AssertionError(f"MQTT subscriber did not get {topic}")


# --- librdkafka (confluent-kafka) -----------------------------------------------------------


def rdkafka_conf(gw: GatewayProcess, mech: str | None, user: str = "", password: str = "") -> dict:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap(gw), "log_level": 0}
    if mech is not None:
        conf.update({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mech,
                     "sasl.username": user, "sasl.password": password})  # fmt: skip
    return conf


def rdkafka_login_error(conf: dict) -> Any:
    """Poll a producer until librdkafka reports an error (or connects): the error, or None."""
    from confluent_kafka import Producer

    errors: list[Any] = []
    p = Producer({**conf, "error_cb": errors.append})
    p.produce("sensors", b"x", key="sensors/x")  # makes it connect
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:
        p.poll(0.1)
    p.purge()
    return errors[0] if errors else None


@pytest.mark.parametrize("mech", MECHANISMS)
def test_confluent_kafka(gw: GatewayProcess, subscriber: Client, mech: str) -> None:
    from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

    key = f"sensors/ck-{mech}"
    conf = rdkafka_conf(gw, mech, "alice", USERS["alice"])
    p = Producer(conf)
    results: list[Any] = []
    p.produce("sensors", b"from librdkafka", key=key, on_delivery=lambda e, m: results.append(e))
    p.flush(10)
    assert results == [None]
    mqtt_gets(subscriber, key, b"from librdkafka")

    c = Consumer({**conf, "group.id": f"g-{mech}", "auto.offset.reset": "earliest"})
    c.assign([TopicPartition("sensors", 0, 0)])
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while key.encode() not in got and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and m.error() is None:
            got.append(m.key())
    c.close()
    assert key.encode() in got

    # bob may read but not write: the produce is refused, as Kafka refuses it
    p = Producer(rdkafka_conf(gw, mech, "bob", USERS["bob"]))
    results.clear()
    p.produce("sensors", b"x", key="sensors/b", on_delivery=lambda e, m: results.append(e))
    p.flush(10)
    assert results and results[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED

    # carol may write but not read: her fetch is refused
    c = Consumer({**rdkafka_conf(gw, mech, "carol", USERS["carol"]), "group.id": "gc"})
    c.assign([TopicPartition("sensors", 0, 0)])
    error = None
    deadline = time.monotonic() + 10
    while error is None and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and m.error() is not None:
            error = m.error()
    c.close()
    assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


@pytest.mark.parametrize(
    ("mech", "user", "password"),
    [("PLAIN", "alice", "wrong"), ("SCRAM-SHA-512", "alice", "wrong"),
     ("SCRAM-SHA-512", "mallory", "x"), ("PLAIN", "mallory", "x")],
)  # fmt: skip
def test_confluent_kafka_bad_credentials(
    gw: GatewayProcess, mech: str, user: str, password: str
) -> None:
    from confluent_kafka import KafkaError

    error = rdkafka_login_error(rdkafka_conf(gw, mech, user, password))
    assert error is not None and error.code() == KafkaError._AUTHENTICATION, error
    assert "Authentication failed" in error.str()


def test_confluent_kafka_without_sasl_is_refused(gw: GatewayProcess) -> None:
    error = rdkafka_login_error(rdkafka_conf(gw, None))
    assert error is not None  # the connection is closed at the first Metadata request


# --- kcat -------------------------------------------------------------------------------------


def kcat(gw: GatewayProcess, mech: str | None, user: str, password: str, *args: str,
         stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:  # fmt: skip
    sasl = [] if mech is None else [
        "-X", "security.protocol=SASL_PLAINTEXT", "-X", f"sasl.mechanisms={mech}",
        "-X", f"sasl.username={user}", "-X", f"sasl.password={password}",
    ]  # fmt: skip
    cmd = ["kcat", "-b", bootstrap(gw), "-m", "5", *sasl, *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=30, check=False)


@needs_kcat
@pytest.mark.parametrize("mech", MECHANISMS)
def test_kcat(gw: GatewayProcess, subscriber: Client, mech: str) -> None:
    key = f"sensors/kcat-{mech}"
    r = kcat(gw, mech, "alice", USERS["alice"], "-P", "-t", "sensors", "-K", "|",
             stdin=f"{key}|from kcat\n".encode())  # fmt: skip
    assert r.returncode == 0, r.stderr
    mqtt_gets(subscriber, key, b"from kcat")
    r = kcat(gw, mech, "bob", USERS["bob"], "-C", "-t", "sensors", "-e", "-o", "beginning",
             "-f", "%k\n")  # fmt: skip
    assert r.returncode == 0 and key.encode() in r.stdout.split(), r.stderr

    r = kcat(gw, mech, "alice", "nope", "-P", "-t", "sensors", stdin=b"x\n")
    assert r.returncode != 0 and b"Authentication failed" in r.stderr
    r = kcat(gw, mech, "bob", USERS["bob"], "-P", "-t", "sensors", "-K", "|",
             stdin=b"sensors/x|no\n")  # fmt: skip
    assert r.returncode != 0 and b"Topic authorization failed" in r.stderr
    r = kcat(gw, mech, "carol", USERS["carol"], "-C", "-t", "sensors", "-e", "-o", "beginning")
    assert b"Topic authorization failed" in r.stderr


@needs_kcat
def test_kcat_without_sasl_is_refused(gw: GatewayProcess) -> None:
    r = kcat(gw, None, "", "", "-P", "-t", "sensors", stdin=b"x\n")
    assert r.returncode != 0 and b"broker might require SASL authentication" in r.stderr


# --- aiokafka ---------------------------------------------------------------------------------


def aio_kwargs(mech: str, user: str, password: str) -> dict[str, Any]:
    return dict(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mech,
                sasl_plain_username=user, sasl_plain_password=password)  # fmt: skip


@pytest.mark.parametrize("mech", MECHANISMS)
async def test_aiokafka(gw: GatewayProcess, subscriber: Client, mech: str) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

    key = f"sensors/aio-{mech}"
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap(gw),
                                **aio_kwargs(mech, "alice", USERS["alice"]))  # fmt: skip
    await producer.start()
    try:
        await producer.send_and_wait("sensors", b"from aiokafka", key=key.encode())
    finally:
        await producer.stop()
    await asyncio.get_running_loop().run_in_executor(
        None, mqtt_gets, subscriber, key, b"from aiokafka"
    )

    async def fetch(user: str) -> list[bytes]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap(gw), auto_offset_reset="earliest",
                                    **aio_kwargs(mech, user, USERS[user]))  # fmt: skip
        await consumer.start()
        try:
            consumer.assign([TopicPartition("sensors", 0)])
            out: list[bytes] = []
            deadline = time.monotonic() + 10
            while key.encode() not in out and time.monotonic() < deadline:
                for msgs in (await consumer.getmany(timeout_ms=300)).values():
                    out += [m.key for m in msgs]
            return out
        finally:
            await consumer.stop()

    assert key.encode() in await fetch("bob")
    with pytest.raises(TopicAuthorizationFailedError):
        await fetch("carol")

    # a consumer group: JoinGroup/SyncGroup, then OffsetCommit (read on the topic) and back
    group = AIOKafkaConsumer("sensors", bootstrap_servers=bootstrap(gw), group_id=f"bobs-{mech}",
                             auto_offset_reset="earliest", enable_auto_commit=False,
                             **aio_kwargs(mech, "bob", USERS["bob"]))  # fmt: skip
    await group.start()
    try:
        seen: list[bytes] = []
        deadline = time.monotonic() + 15
        while key.encode() not in seen and time.monotonic() < deadline:
            for msgs in (await group.getmany(timeout_ms=300)).values():
                seen += [m.key for m in msgs]
        assert key.encode() in seen
        await group.commit()
        assert (await group.committed(TopicPartition("sensors", 0))) is not None
    finally:
        await group.stop()

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap(gw),
                                **aio_kwargs(mech, "bob", USERS["bob"]))  # fmt: skip
    await producer.start()
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.send_and_wait("sensors", b"x", key=b"sensors/b")
    finally:
        await producer.stop()

    for user, password in (("alice", "wrong"), ("mallory", "x")):
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap(gw),
                                    **aio_kwargs(mech, user, password))  # fmt: skip
        with pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()


async def test_aiokafka_without_sasl_is_refused(gw: GatewayProcess) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaConnectionError

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap(gw))
    with pytest.raises(KafkaConnectionError):
        await producer.start()
    await producer.stop()


# --- kafka-python -----------------------------------------------------------------------------


def kp_kwargs(gw: GatewayProcess, mech: str | None, user: str = "", pw: str = "") -> dict:
    kw: dict[str, Any] = {"bootstrap_servers": bootstrap(gw), "bootstrap_timeout_ms": 1500}
    if mech is not None:
        kw.update(security_protocol="SASL_PLAINTEXT", sasl_mechanism=mech,
                  sasl_plain_username=user, sasl_plain_password=pw)  # fmt: skip
    return kw


@pytest.mark.parametrize("mech", MECHANISMS)
def test_kafka_python(gw: GatewayProcess, subscriber: Client, mech: str) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.errors import TopicAuthorizationFailedError

    key = f"sensors/kp-{mech}"
    p = KafkaProducer(**kp_kwargs(gw, mech, "alice", USERS["alice"]))
    p.send("sensors", b"from kafka-python", key=key.encode()).get(10)
    p.close()
    mqtt_gets(subscriber, key, b"from kafka-python")

    c = KafkaConsumer(**kp_kwargs(gw, mech, "bob", USERS["bob"]), auto_offset_reset="earliest")
    c.assign([TopicPartition("sensors", 0)])
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while key.encode() not in got and time.monotonic() < deadline:
        for msgs in c.poll(300).values():
            got += [m.key for m in msgs]
    c.close()
    assert key.encode() in got

    p = KafkaProducer(**kp_kwargs(gw, mech, "bob", USERS["bob"]))
    with pytest.raises(TopicAuthorizationFailedError):
        p.send("sensors", b"x", key=b"sensors/b").get(10)
    p.close()


@pytest.mark.parametrize(
    ("mech", "user", "password"),
    [("SCRAM-SHA-512", "alice", "wrong"), ("PLAIN", "mallory", "x"), (None, "", "")],
)
def test_kafka_python_refused(
    gw: GatewayProcess, caplog: pytest.LogCaptureFixture, mech: str | None, user: str,
    password: str,
) -> None:  # fmt: skip
    from kafka import KafkaConsumer
    from kafka.errors import KafkaTimeoutError

    caplog.set_level(logging.WARNING, logger="kafka")
    with pytest.raises(KafkaTimeoutError):  # it never bootstraps
        KafkaConsumer(**kp_kwargs(gw, mech, user, password))
    text = caplog.text
    if mech is None:
        assert "socket disconnected" in text  # closed at its first request (Metadata)
    else:
        assert "SaslAuthenticationFailedError" in text, text[-2000:]


def test_admin_needs_write_on_the_log_topic(gw: GatewayProcess) -> None:
    """A read-only user can neither delete the topic nor its records, nor create one."""
    from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    p = Producer(rdkafka_conf(gw, "PLAIN", "alice", USERS["alice"]))  # the topic exists
    p.produce("sensors", b"x", key="sensors/admin")
    assert p.flush(10) == 0
    admin = AdminClient(rdkafka_conf(gw, "SCRAM-SHA-512", "bob", USERS["bob"]))
    futures = {
        "delete": admin.delete_topics(["sensors"], operation_timeout=5)["sensors"],
        "create": admin.create_topics([NewTopic("elsewhere", 1, 1)])["elsewhere"],
        "records": admin.delete_records([TopicPartition("sensors", 0, 0)])[
            TopicPartition("sensors", 0, 0)
        ],
    }
    for what, fut in futures.items():
        with pytest.raises(KafkaException) as info:
            fut.result(10)
        assert info.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, what


async def test_defaults_and_sighup_reload(tmp_path: Path) -> None:
    """`lightgate passwd -b` writes the users; with a password_file, allow_anonymous (auto) is
    off, so a Kafka client without SASL is refused; `kill -HUP` applies a new ACL and a new
    password file to later requests, on connections already open."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

    passwd, acl = tmp_path / "passwd", tmp_path / "acl"
    lg = [sys.executable, "-m", "lightgate", "passwd"]
    subprocess.run([*lg, "-c", "-b", str(passwd), "dave", "d1"], check=True, cwd=ROOT)
    acl.write_text("user dave\ntopic readwrite plant/#\n")
    gw = GatewayProcess(tmp_path / "data", [f"--set=password_file={passwd}",
                                            f"--set=acl_file={acl}"]).start()  # fmt: skip
    try:
        bs = f"127.0.0.1:{gw.port('kafka')}"
        anonymous = AIOKafkaProducer(bootstrap_servers=bs)
        with pytest.raises(KafkaConnectionError):
            await anonymous.start()
        await anonymous.stop()

        producer = AIOKafkaProducer(
            bootstrap_servers=bs, **aio_kwargs("SCRAM-SHA-512", "dave", "d1")
        )
        await producer.start()
        try:
            await producer.send_and_wait("plant", b"1", key=b"plant/a")

            def reload() -> None:
                before = gw.log_text().count("users and ACL reloaded")
                assert gw.proc is not None
                gw.proc.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 10
                while gw.log_text().count("users and ACL reloaded") == before:
                    assert time.monotonic() < deadline, gw.log_text()[-2000:]
                    time.sleep(0.05)

            acl.write_text("user dave\ntopic read plant/#\n")
            subprocess.run([*lg, "-b", str(passwd), "erin", "e1"], check=True, cwd=ROOT)
            reload()
            with pytest.raises(TopicAuthorizationFailedError):  # same connection, new rules
                await producer.send_and_wait("plant", b"2", key=b"plant/a")
        finally:
            await producer.stop()
        # erin was added by the reload: she can log in now (and has no rights)
        erin = AIOKafkaProducer(bootstrap_servers=bs, **aio_kwargs("PLAIN", "erin", "e1"))
        await erin.start()
        try:
            with pytest.raises(TopicAuthorizationFailedError):
                await erin.send_and_wait("plant", b"3", key=b"plant/a")
        finally:
            await erin.stop()
    finally:
        gw.stop()


def test_transactions_need_write_on_the_log_topic(gw: GatewayProcess) -> None:
    """A transactional producer is checked like a plain one: bob (read only) cannot add
    `sensors` to a transaction and nothing of his is stored (a read_uncommitted consumer would
    see it); alice commits one and the consumer sees it."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

    def producer(user: str, tid: str) -> Any:
        conf = rdkafka_conf(gw, "SCRAM-SHA-512", user, USERS[user])
        p = Producer({**conf, "transactional.id": tid})
        p.init_transactions(15)
        p.begin_transaction()
        return p

    bob = producer("bob", "tx-bob")
    reports: list[Any] = []
    bob.produce("sensors", b"nope", key="sensors/tx", on_delivery=lambda e, _m: reports.append(e))
    with pytest.raises(KafkaException):
        bob.commit_transaction(15)
    # refused at AddPartitionsToTxn (librdkafka then purges the queued record) or at Produce
    refused = (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError._PURGE_QUEUE)
    assert reports and reports[0].code() in refused, reports
    alice = producer("alice", "tx-alice")
    alice.produce("sensors", b"committed", key="sensors/tx")
    alice.commit_transaction(15)
    c = Consumer({**rdkafka_conf(gw, "SCRAM-SHA-512", "alice", USERS["alice"]),
                  "group.id": "tx-readers", "auto.offset.reset": "earliest",
                  "isolation.level": "read_uncommitted"})  # fmt: skip
    c.subscribe(["sensors"])
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    while b"committed" not in got and time.monotonic() < deadline:
        m = c.poll(0.5)
        if m is not None and m.error() is None:
            got.append(m.value())
    c.close()
    assert b"committed" in got and b"nope" not in got
