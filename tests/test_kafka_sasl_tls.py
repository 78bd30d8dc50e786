"""SASL inside TLS (Kafka's SASL_SSL) and a client certificate as the user, on the same connection
class as the plain listener: the SASL gate does not care what carries the bytes."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

from store.auth import PasswordFile, Security
from store.kafka.connection import KafkaConnection
from tests.kafka_helpers import Gateway, running_gateway

pytestmark = pytest.mark.timeout(60)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate with CN alice."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
        cwd=d,
    )
    for name, cn, ext in (
        ("server", "localhost", "subjectAltName=IP:127.0.0.1"),
        ("client", "alice", "extendedKeyUsage=clientAuth"),
    ):
        openssl(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={cn}",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
                "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d


@pytest.fixture
async def tls_gateway(tmp_path: Path, pki: Path) -> AsyncIterator[tuple[Gateway, int]]:
    pw = PasswordFile()
    pw.set("alice", "secret", iterations=256)
    pw.save(tmp_path / "passwd")
    (tmp_path / "acl").write_text("user alice\ntopic readwrite t/#\n")
    security = Security.load(password_file=str(tmp_path / "passwd"),
                             acl_file=str(tmp_path / "acl"), allow_anonymous=False)  # fmt: skip
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki / "server.crt", pki / "server.key")
    ctx.load_verify_locations(pki / "ca.crt")
    ctx.verify_mode = ssl.CERT_OPTIONAL
    async with running_gateway(tmp_path / "data", security=security) as g:
        server = await asyncio.get_running_loop().create_server(
            lambda: KafkaConnection(g.server), "127.0.0.1", 0, ssl=ctx
        )
        port = server.sockets[0].getsockname()[1]
        g.server.broker.port = port  # Metadata sends the client back to this listener
        try:
            yield g, port
        finally:
            server.close()


def client_ctx(pki: Path, cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert:
        ctx.load_cert_chain(pki / "client.crt", pki / "client.key")
    return ctx


@pytest.mark.parametrize("mech", ["PLAIN", "SCRAM-SHA-512"])
async def test_sasl_ssl(tls_gateway: tuple[Gateway, int], pki: Path, mech: str) -> None:
    g, port = tls_gateway
    kw = dict(bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SASL_SSL",
              ssl_context=client_ctx(pki), sasl_mechanism=mech)  # fmt: skip
    producer = AIOKafkaProducer(**kw, sasl_plain_username="alice", sasl_plain_password="secret")
    await producer.start()
    try:
        md = await producer.send_and_wait("t", b"over tls", key=b"t/a")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(**kw, sasl_plain_username="alice", sasl_plain_password="secret")
    await consumer.start()
    try:
        tp = TopicPartition("t", md.partition)
        consumer.assign([tp])
        consumer.seek(tp, md.offset)
        batch = await consumer.getmany(tp, timeout_ms=10_000)
        assert [r.value for r in batch[tp]] == [b"over tls"]
    finally:
        await consumer.stop()
    bad = AIOKafkaProducer(**kw, sasl_plain_username="alice", sasl_plain_password="nope")
    with pytest.raises(KafkaConnectionError):
        await bad.start()
    await bad.stop()
    # plain TLS without SASL is refused like plaintext without SASL
    bare = AIOKafkaProducer(bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SSL",
                            ssl_context=client_ctx(pki))  # fmt: skip
    with pytest.raises(KafkaConnectionError):
        await bare.start()
    await bare.stop()


async def test_client_certificate_as_user(tls_gateway: tuple[Gateway, int], pki: Path) -> None:
    """`certificate_user` (tls_identity_as_username): the certificate's CN is the user, the
    ACL applies to it, and no SASL is needed."""
    g, port = tls_gateway
    g.server.certificate_user = lambda cert: next(
        (v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"), None
    )
    kw = dict(bootstrap_servers=f"127.0.0.1:{port}", security_protocol="SSL")
    producer = AIOKafkaProducer(**kw, ssl_context=client_ctx(pki, cert=True))
    await producer.start()
    try:
        await producer.send_and_wait("t", b"by certificate", key=b"t/c")
        with pytest.raises(TopicAuthorizationFailedError):  # alice's ACL: t only
            await producer.send_and_wait("other", b"x", key=b"other/c")
    finally:
        await producer.stop()
    nocert = AIOKafkaProducer(**kw, ssl_context=client_ctx(pki))
    with pytest.raises(KafkaConnectionError):  # no certificate, no SASL: refused
        await nocert.start()
    await nocert.stop()
