"""Notify over the core link with several proxies: the real `CoreLink` in the core, three real
`LinkNotifier`s as proxies, over a Unix socket.

Each queue event goes only to the proxies that registered that queue, and a proxy whose link is
backed up gets nothing written: its events wait in its mailbox, one last sequence per queue, so
the core's memory does not grow with the backlog of a slow proxy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from lightgate.core_link import CoreLink
from lightgate.link_registry import HELLO, MethodRegistry
from lightqueue import LightQueueConfig, LightQueues
from mqtt_proxy.backends.remote_notify import LinkNotifier
from notify.inprocess import InProcessNotifier
from notify.link import connect
from store import Store, StoreConfig


async def _collect(notifier: LinkNotifier, name: str, out: dict[str, dict[str, int]]) -> None:
    async for batch in notifier.batches(name):
        out.setdefault(name, {}).update(batch)


async def test_events_go_only_to_the_proxies_that_watch_the_queue(tmp_path: Path) -> None:
    store = await Store.open(tmp_path / "core", StoreConfig(default_partitions=1))
    lq = LightQueues.open(tmp_path / "core", store, LightQueueConfig())
    await lq.start()
    notifier = InProcessNotifier(last_seq_of=lambda q: None)
    link = CoreLink(store, lq, notifier)
    addr = await link.start(f"unix:{tmp_path}/core.sock")
    got: dict[str, dict[str, int]] = {}
    proxies: list[tuple[str, LinkNotifier, Any]] = []
    tasks = []
    for name in ("p1", "p2", "p3"):
        ln = LinkNotifier(name)
        peer = await connect(addr, MethodRegistry().add("notify", ln.methods()).table())
        peer.send(HELLO, name.encode())
        ln.attach(peer)
        proxies.append((name, ln, peer))
        tasks.append(asyncio.create_task(_collect(ln, name, got)))
    try:
        proxies[0][1].register("p1", ["a/1", "both"])
        proxies[1][1].register("p2", ["a/2", "both"])  # p3 registers nothing
        for _ in range(100):
            if len(link.notify_service.routes.proxies_for("both")) == 2:
                break
            await asyncio.sleep(0.01)
        notifier.routes.publish([("a/1", 5), ("a/2", 7), ("both", 9), ("nobody", 1)])
        for _ in range(100):
            if got.get("p1", {}).get("both") == 9 and got.get("p2", {}).get("both") == 9:
                break
            await asyncio.sleep(0.01)
        assert got["p1"] == {"a/1": 5, "both": 9}
        assert got["p2"] == {"a/2": 7, "both": 9}
        assert "p3" not in got  # a proxy that watches nothing is not woken

        # p2's link backs up: nothing more is written to it, its events coalesce in its mailbox
        core_p2 = link.proxies["p2"]
        core_p2.paused = True
        for seq in range(10, 5010):
            notifier.routes.publish([("a/2", seq), ("both", seq)])
        await asyncio.sleep(0.1)
        assert got["p2"]["a/2"] == 7  # nothing arrived while paused
        assert got["p1"]["both"] == 5009  # the others are not held back
        assert notifier.routes.mailbox("p2").pending == {"a/2": 5009, "both": 5009}  # 2, not 10k
        core_p2.paused = False
        for _ in range(100):
            if got["p2"].get("a/2") == 5009:
                break
            await asyncio.sleep(0.01)
        assert got["p2"] == {"a/2": 5009, "both": 5009}
    finally:
        for _n, _ln, peer in proxies:
            peer.close()
        for t in tasks:
            t.cancel()
        await link.close()
        await lq.close()
        await store.close()
