"""Routing and coalescing of notify events, in process."""

from __future__ import annotations

import asyncio

from notify import InProcessNotifier, QueueEvent, wire


async def drain(n: InProcessNotifier, proxy: str, timeout: float = 0.05) -> dict[str, int]:
    got: dict[str, int] = {}

    async def run() -> None:
        async for ev in n.events(proxy):
            got[ev.queue] = ev.last_seq

    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        pass
    return got


async def test_routes_only_to_interested_proxies() -> None:
    n = InProcessNotifier(resync_interval=None)
    n.register("p1", ["a/b", "x/#"])
    n.register("p2", ["x/#"])
    n.register("p3", [])
    n.publish([("a/b", 3), ("x/#", 9), ("nobody", 1)])
    assert await drain(n, "p1") == {"a/b": 3, "x/#": 9}
    assert await drain(n, "p2") == {"x/#": 9}
    assert await drain(n, "p3") == {}
    assert n.routes.proxies_for("x/#") == {"p1", "p2"}
    assert n.routes.proxies_for("nobody") == set()


async def test_coalesces_per_queue() -> None:
    n = InProcessNotifier(resync_interval=None)
    n.register("p", ["q"])
    for seq in range(100):
        n.publish([QueueEvent("q", seq)])
    n.publish([("q", 50)])  # late, lower: never moves the announcement back
    assert await drain(n, "p") == {"q": 99}
    assert n.routes.mailbox("p").delivered == 1


async def test_unregister_and_resync() -> None:
    seqs = {"q1": 10, "q2": 20}
    n = InProcessNotifier(last_seq_of=seqs.get, resync_interval=0.01)
    n.register("p", ["q1", "q2"])
    n.unregister("p", ["q2"])
    n.start()
    got = await drain(n, "p", timeout=0.1)  # nothing published: the resync announces
    assert got == {"q1": 10}
    await n.close()
    m = InProcessNotifier(last_seq_of=seqs.get, resync_interval=None)
    m.register("p", ["q2"], announce=True)  # announce: the current seq at once
    assert await drain(m, "p") == {"q2": 20}


async def test_events_iterator_ends_on_drop() -> None:
    n = InProcessNotifier(resync_interval=None)
    n.register("p", ["q"])
    seen: list[QueueEvent] = []

    async def consume() -> None:
        async for ev in n.events("p"):
            seen.append(ev)

    t = asyncio.create_task(consume())
    await asyncio.sleep(0)
    n.publish([("q", 1)])
    await asyncio.sleep(0.01)
    n.drop("p")
    await asyncio.wait_for(t, 1)
    assert seen == [QueueEvent("q", 1)]


def test_link_bodies_golden_bytes_and_round_trip() -> None:
    """The REGISTER and EVENTS bodies the core link carries (notify.wire): the bytes of the TCP
    notify transport's bodies that came before, so a proxy and a core of either age agree."""
    queues = ["a/+", "ü/#"]
    body = wire.encode_queues(queues)
    assert body == bytes.fromhex(
        "00000002"  # u32 n
        "0003" "612f2b"  # str "a/+"
        "0004" "c3bc2f23"  # str "ü/#" (UTF-8)
    )  # fmt: skip
    assert wire.decode_queues(body) == queues
    events = [("a/+", 5), ("ü/#", 2**40)]
    body = wire.encode_events(events)
    assert body == bytes.fromhex(
        "00000002"  # u32 n
        "0003" "612f2b" "0000000000000005"  # str queue, i64 last_seq
        "0004" "c3bc2f23" "0000010000000000"
    )  # fmt: skip
    assert wire.decode_events(body) == events
    for cut in range(len(body)):  # a short body is refused with the link's BAD_REQUEST code
        try:
            wire.decode_events(body[:cut])
        except wire.WireError as exc:
            assert exc.rpc_code == 3
        else:
            raise AssertionError(f"{cut} bytes decoded")


async def test_events_the_proxy_already_has_are_not_sent() -> None:
    """`skip_known`: a proxy in this process got the round's entries pushed before the events;
    an event it has (its `known` says so) is not put in its mailbox, and wakes nothing."""
    have = {"q": 5}
    n = InProcessNotifier(resync_interval=None)
    n.register("p", ["q", "r"])
    n.register("other", ["q"])
    n.skip_known("p", lambda q, seq: seq <= have.get(q, -1))
    n.publish([("q", 5), ("r", 0)])
    assert n.routes.mailbox("p").pending == {"r": 0}
    assert await drain(n, "p") == {"r": 0}
    assert await drain(n, "other") == {"q": 5}  # other proxies are not filtered
    n.publish([("q", 6)])  # news to p
    assert await drain(n, "p") == {"q": 6}
    n.skip_known("p", None)
    n.publish([("q", 5)])
    assert await drain(n, "p") == {"q": 5}
