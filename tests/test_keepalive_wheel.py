"""KeepaliveWheel on a real event loop: each filed deadline is checked once, no earlier than
its deadline and at most one tick (plus scheduling slack) after; a removed entry never is; a
re-filed one is checked at its new deadline only. (End to end: test_mqtt_connect's keep-alive
tests, test_listeners_polite's CONNECT timeout.)"""

from __future__ import annotations

import asyncio

from mqtt_proxy.connection.keepalive import TICK_S, KeepaliveWheel


class Deadline:
    """What the wheel needs of a connection: a slot and the check it calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wheel: KeepaliveWheel, at: float) -> None:
        self.ka_slot = 0
        self.loop, self.wheel, self.at = loop, wheel, at
        self.checked: list[float] = []
        self.then: float | None = None  # file again at this deadline when checked

    def _keepalive_check(self) -> None:
        self.checked.append(self.loop.time())
        if self.then is not None:
            at, self.then = self.then, None
            self.at = at
            self.wheel.add(self, at)


def test_deadlines_checked_in_time() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wheel = KeepaliveWheel(loop)
        t0 = loop.time()
        items = [Deadline(loop, wheel, t0 + d) for d in (0.05, 0.3, 0.3, 0.62, 0.9, 0.1)]
        for it in items:
            wheel.add(it, it.at)
        items[3].then = t0 + 1.1  # re-filed from its own check
        wheel.remove(items[4])  # closed: never checked
        early = Deadline(loop, wheel, t0 + 0.8)
        wheel.add(early, t0 + 0.8)
        early.at = t0 + 0.2
        wheel.add(early, early.at)  # moved earlier: the timer is armed again for it
        assert len(wheel) == 6
        await asyncio.sleep(1.6)
        for it in items[:4] + [items[5], early]:
            assert len(it.checked) == 1 or it is items[3], (it.at - t0, it.checked)
            assert it.checked[-1] >= it.at - 0.002, (it.at - t0, it.checked[-1] - t0)
            assert it.checked[-1] <= it.at + TICK_S + 0.1, (it.at - t0, it.checked[-1] - t0)
        assert len(items[3].checked) == 2 and items[3].checked[0] < t0 + 1.0
        assert items[4].checked == []
        assert len(wheel) == 0
        wheel.close()

    asyncio.run(main())
