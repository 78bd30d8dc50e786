"""The HTTP auth hook against a real `lightgate serve` and a local aiohttp service: CONNECTs and
topic rights decided by the service, its answers cached for `auth_http_cache_ttl_s` (a changed
answer is seen once the TTL passed, not before), failures and timeouts refusing (fail closed), at
most `auth_http_max_in_flight` requests at once, and a slow service slowing CONNECTs but not a
client publishing to topics it was already allowed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from auth_helpers import WebServer, json_answer
from gateway_process import GatewayProcess
from mqtt_helpers import V5, V311, Client

pytestmark = pytest.mark.timeout(180)


def code(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


class Service:
    """The decisions the test changes as it goes: who may connect, which topics are allowed."""

    def __init__(self) -> None:
        self.passwords = {"alice": "pw-a", "bob": "pw-b"}
        self.allowed_prefixes = ["ok/", "shared/"]
        self.connect_delay = 0.0
        self.acl_delay = 0.0
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    async def _track(self, delay: float) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if delay:
                await asyncio.sleep(delay)
        finally:
            with self._lock:
                self.running -= 1

    async def connect(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await self._track(self.connect_delay)
        if self.passwords.get(body["username"]) == body["password"]:
            return web.json_response({"result": "allow"})
        return web.json_response({"result": "deny"})

    async def acl(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await self._track(self.acl_delay)
        topic = body["topic"]
        if any(topic.startswith(p) for p in self.allowed_prefixes):
            return web.Response(status=200)  # an empty 2xx allows
        return web.Response(status=403)


@pytest.fixture
def service() -> Iterator[tuple[WebServer, Service]]:
    web_server = WebServer().start()
    s = Service()
    web_server.routes["/auth"] = s.connect
    web_server.routes["/acl"] = s.acl
    yield web_server, s
    web_server.stop()


def start(tmp: Path, web_server: WebServer, *sets: str) -> GatewayProcess:
    args = ["--kafka-port", "-1", "--ws-port", "-1", "--set", "allow_anonymous=false",
            "--set", f"auth_http_connect_url={web_server.url('/auth')}",
            "--set", f"auth_http_acl_url={web_server.url('/acl')}"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    return GatewayProcess(tmp / "data", args).start()


def login(port: int, cid: str, user: str, pw: str, version: int = V5, ok: bool = True) -> Client:
    return Client(port, cid, version).connect(username=user, password=pw, expect_ok=ok)


@pytest.mark.parametrize("version", [V311, V5])
def test_connect_and_topics_by_the_service(
    tmp_path: Path, service: tuple[WebServer, Service], version: int
) -> None:
    web_server, s = service
    g = start(tmp_path, web_server, "auth_http_cache_ttl_s=2")
    try:
        port = g.port("mqtt")
        for user, pw in (("alice", "wrong"), ("mallory", "pw-a")):
            c = login(port, "refused", user, pw, version, ok=False)
            assert code(c.connack) == 0x86  # 3.1.1's 0x04 reads as 0x86 in paho
            c.paho.loop_stop()
        alice = login(port, "alice-1", "alice", "pw-a", version)
        watcher = login(port, "watcher", "bob", "pw-b", V5)
        no = 0x87 if version == V5 else 0x80
        assert [code(r) for r in alice.subscribe("ok/#", 1)] == [1]
        assert [code(r) for r in alice.subscribe("secret/#", 1)] == [no]
        watcher.subscribe("ok/#", 1)
        watcher.subscribe("shared/#", 1)
        for i in range(20):
            alice.publish("ok/a", f"{i}".encode(), 1)
        alice.publish("secret/a", b"no", 1)  # acked (v5: 0x87) and dropped
        got = [m.payload for m in watcher.expect(20)]
        assert got == [f"{i}".encode() for i in range(20)]
        # 20 PUBLISHes to one topic: one question to the service.
        asked = [b for p, b in web_server.requests if p == "/acl" and b["topic"] == "ok/a"]
        assert len(asked) == 1 and asked[0]["acc"] == 2 and asked[0]["clientid"] == "alice-1"
        # The service changes its mind: the cached answer holds until the TTL passes.
        s.allowed_prefixes = ["shared/"]
        alice.publish("ok/a", b"still cached", 1)
        assert [m.payload for m in watcher.expect(1)] == [b"still cached"]
        time.sleep(2.2)
        alice.publish("ok/a", b"now refused", 1)
        alice.publish("shared/x", b"allowed", 1)
        assert [m.payload for m in watcher.expect(1)] == [b"allowed"]
        watcher.expect_none(0.5)
        for c in (alice, watcher):
            c.disconnect()
    finally:
        g.stop()


def test_fails_closed(tmp_path: Path, service: tuple[WebServer, Service]) -> None:
    web_server, s = service
    g = start(tmp_path, web_server, "auth_http_timeout_ms=500")
    try:
        port = g.port("mqtt")
        s.connect_delay = 1.5  # past the timeout
        c = login(port, "slow", "alice", "pw-a", ok=False)
        assert code(c.connack) == 0x86
        c.paho.loop_stop()
        s.connect_delay = 0.0
        web_server.routes["/auth"] = json_answer({"error": "boom"}, status=500)
        c = login(port, "err", "alice", "pw-a", ok=False)
        assert code(c.connack) == 0x86
        c.paho.loop_stop()
        web_server.routes["/auth"] = s.connect
        alice = login(port, "alice-2", "alice", "pw-a")
        web_server.routes["/acl"] = json_answer(lambda _b: web.Response(text="<html>oops"))
        assert [code(r) for r in alice.subscribe("ok/#", 1)] == [0x87]
        web_server.routes["/acl"] = json_answer({"error": "boom"}, status=503)
        assert [code(r) for r in alice.subscribe("ok/a/#", 1)] == [0x87]
        # Failures are not remembered as answers: the service back, the same filter is granted.
        web_server.routes["/acl"] = s.acl
        time.sleep(1.1)
        assert [code(r) for r in alice.subscribe("ok/a/#", 1)] == [1]
        web_server.stop()  # the service gone: connection refused
        c = login(port, "gone", "bob", "pw-b", ok=False)
        assert code(c.connack) == 0x86
        c.paho.loop_stop()
        alice.disconnect()
    finally:
        g.stop()


def test_a_slow_service_slows_connects_not_publishers(
    tmp_path: Path, service: tuple[WebServer, Service]
) -> None:
    web_server, s = service
    g = start(tmp_path, web_server, "auth_http_max_in_flight=2", "auth_http_timeout_ms=10000")
    try:
        port = g.port("mqtt")
        pub = login(port, "steady", "alice", "pw-a")
        pub.publish("ok/steady", b"warm", 1)  # its topic answered and cached
        s.connect_delay = 1.0
        started = time.monotonic()
        clients: list[Client] = []
        threads = [
            threading.Thread(target=lambda i=i: clients.append(login(port, f"n{i}", "bob", "pw-b")))
            for i in range(6)
        ]
        for t in threads:
            t.start()
        worst = 0.0
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            pub.publish("ok/steady", b"x", 1)  # waits for its PUBACK
            worst = max(worst, time.monotonic() - t0)
        for t in threads:
            t.join()
        connects_took = time.monotonic() - started
        assert len(clients) == 6
        assert s.most <= 2  # auth_http_max_in_flight
        assert connects_took >= 2.9  # 6 CONNECTs, 2 at a time, 1 s each
        assert worst < 0.5, f"a publish waited {worst:.2f} s behind the slow CONNECTs"
        for c in (pub, *clients):
            c.disconnect()
    finally:
        g.stop()
