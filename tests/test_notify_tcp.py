"""TCP notify: routing over real sockets, heartbeat, and reconnect with re-registration."""

from __future__ import annotations

import asyncio
import socket

from notify import InProcessNotifier, TcpNotifyClient, TcpNotifyServer


async def next_events(
    c: TcpNotifyClient, proxy: str, want: dict[str, int], timeout: float = 5
) -> dict[str, int]:
    got: dict[str, int] = {}

    async def run() -> None:
        async for ev in c.events(proxy):
            got[ev.queue] = max(ev.last_seq, got.get(ev.queue, -1))
            if all(got.get(q, -1) >= s for q, s in want.items()):
                return

    await asyncio.wait_for(run(), timeout)
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_remote_routing() -> None:
    core = InProcessNotifier(resync_interval=None)
    srv = TcpNotifyServer(core, heartbeat=0.2)
    await srv.start()
    c1 = TcpNotifyClient("127.0.0.1", srv.port, "p1", heartbeat=0.2)
    c2 = TcpNotifyClient("127.0.0.1", srv.port, "p2", heartbeat=0.2)
    c1.register("p1", ["a"])
    c2.register("p2", ["b"])
    await c1.start()
    await c2.start()
    await asyncio.wait_for(c1.connected.wait(), 5)
    await asyncio.wait_for(c2.connected.wait(), 5)
    for _ in range(50):
        if core.routes.proxies_for("a") and core.routes.proxies_for("b"):
            break
        await asyncio.sleep(0.01)
    core.publish([("a", 1), ("b", 2), ("c", 3)])
    assert await next_events(c1, "p1", {"a": 1}) == {"a": 1}
    assert await next_events(c2, "p2", {"b": 2}) == {"b": 2}
    # Registration after connecting goes over the wire; the answer announces the current seq.
    c2.register("p2", ["a"])
    assert (await next_events(c2, "p2", {"a": 1}))["a"] == 1
    # A client can publish too (events are routed by the server).
    c1.publish([("b", 7)])
    assert (await next_events(c2, "p2", {"b": 7}))["b"] == 7
    # Heartbeats keep an idle connection up.
    await asyncio.sleep(1.0)
    assert c1.connects == 1 and srv.connected_proxies() == ["p1", "p2"]
    await c1.close()
    await c2.close()
    await srv.close()
    await core.close()


async def test_reconnect_reregisters_after_server_restart() -> None:
    port = free_port()
    seqs: dict[str, int] = {"q": 4}
    core = InProcessNotifier(last_seq_of=seqs.get, resync_interval=None)
    srv = TcpNotifyServer(core, port=port, heartbeat=0.2)
    await srv.start()
    c = TcpNotifyClient("127.0.0.1", port, "px", heartbeat=0.2, backoff_min=0.02, backoff_max=0.2)
    c.register("px", ["q"])
    await c.start()
    assert (await next_events(c, "px", {"q": 4}))["q"] == 4  # announced on REGISTER
    # Kill the server side: the client notices, backs off, reconnects when it is back.
    await srv.close()
    await core.close()
    for _ in range(100):
        if not c.connected.is_set():
            break
        await asyncio.sleep(0.02)
    assert not c.connected.is_set()
    await asyncio.sleep(0.3)  # a few failed attempts while nobody listens
    seqs["q"] = 9  # data arrived while the proxy was cut off
    core2 = InProcessNotifier(last_seq_of=seqs.get, resync_interval=None)
    srv2 = TcpNotifyServer(core2, port=port, heartbeat=0.2)
    await srv2.start()
    await asyncio.wait_for(c.connected.wait(), 5)
    assert c.connects == 2
    # Interest re-registered without the proxy doing anything; the catch-up event arrives ...
    assert (await next_events(c, "px", {"q": 9}))["q"] == 9
    # ... and live events flow again.
    for _ in range(100):
        if core2.routes.proxies_for("q"):
            break
        await asyncio.sleep(0.01)
    core2.publish([("q", 10)])
    assert (await next_events(c, "px", {"q": 10}))["q"] == 10
    await c.close()
    await srv2.close()
    await core2.close()


async def test_silent_peer_is_dropped() -> None:
    core = InProcessNotifier(resync_interval=None)
    srv = TcpNotifyServer(core, heartbeat=0.1)
    await srv.start()
    r, w = await asyncio.open_connection("127.0.0.1", srv.port)
    from notify.frames import REGISTER, encode_hello, encode_queues

    w.write(encode_hello("mute") + encode_queues(REGISTER, ["q"]))
    await w.drain()
    await asyncio.sleep(0.1)
    assert core.routes.proxies_for("q") == {"mute"}
    # We never answer: after 3 heartbeats the server drops us and our routes.
    data = await asyncio.wait_for(r.read(), 3)  # PINGs, then EOF
    assert data  # pings were sent
    await asyncio.sleep(0.05)
    assert core.routes.proxies_for("q") == set()
    w.close()
    await srv.close()
    await core.close()


def test_client_is_a_full_notifier_under_uvloop() -> None:
    """What the MQTT proxy uses of a notifier (register with announce, batches, drop), over
    TCP on uvloop (whose transports are not asyncio.Transport subclasses)."""
    import uvloop

    async def main() -> None:
        core = InProcessNotifier(last_seq_of=lambda q: 41 if q == "a" else None)
        srv = TcpNotifyServer(core, heartbeat=0.2)
        await srv.start()
        c = TcpNotifyClient("127.0.0.1", srv.port, "p", heartbeat=0.2)
        await c.start()
        await asyncio.wait_for(c.connected.wait(), 5)
        c.register("p", ["a", "b"], announce=True)
        batches = c.batches("p")
        got = await asyncio.wait_for(batches.__anext__(), 5)
        assert got == {"a": 41}  # the answer to REGISTER announces the current sequence
        core.publish([("b", 3), ("zzz", 9)])
        assert await asyncio.wait_for(batches.__anext__(), 5) == {"b": 3}
        c.drop("p")
        for _ in range(100):
            if not core.routes.proxies_for("a") and not core.routes.proxies_for("b"):
                break
            await asyncio.sleep(0.01)
        assert not core.routes.proxies_for("a") and not core.routes.proxies_for("b")
        await c.close()
        await srv.close()
        await core.close()

    uvloop.run(main())
