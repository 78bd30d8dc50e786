"""What a read chunk of PUBACKs costs the proxy (`handlers.handle_pubacks`): ns per PUBACK, 64
per call, on real Session / Subscription / Inflight objects and the real `Delivery` crediting
(a stand-in holds only what handle_pubacks reaches through: conn.ctx.delivery, and
`mark_session`, which does nothing here). A lagging QoS 1 reader of a fan-in acks ~60k/s.

    .venv/bin/python bench/puback_bench.py [TREE]   (TREE: another checkout's code, e.g. a work tree)
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(
    0, str(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).parents[1])
)

from mqtt_proxy.codec import Puback  # noqa: E402
from mqtt_proxy.connection import handlers  # noqa: E402
from mqtt_proxy.delivery.delivery import Delivery  # noqa: E402
from mqtt_proxy.sessions.state import Inflight, Session, Subscription  # noqa: E402
from mqtt_proxy.sessions.topic_filters import parse_filter  # noqa: E402

N = 64


def main() -> None:
    session = Session("c")
    sub = session.subs["a/#"] = Subscription(session, parse_filter("a/#"), 1, queue="a/#")
    delivery = SimpleNamespace(mark_session=lambda s: None, group_of=None, leases=None)
    for name in ("acked", "acked_many"):  # the real methods, on the stand-in
        if hasattr(Delivery, name):
            setattr(delivery, name, getattr(Delivery, name).__get__(delivery))
    conn = SimpleNamespace(session=session, ctx=SimpleNamespace(delivery=delivery))
    packets = [Puback(i) for i in range(1, N + 1)]
    infs = {i: Inflight("a/#", 1000 + i, 1, b"", filter_raw="a/#") for i in range(1, N + 1)}
    pend = {1000 + i: i for i in range(1, N + 1)}

    def refill() -> None:
        session.inflight.update(infs)
        sub.pending.update(pend)

    def chunk() -> None:
        refill()
        handlers.handle_pubacks(conn, packets)  # type: ignore[arg-type]

    chunk()
    assert not session.inflight and not sub.pending, "every PUBACK credited"
    for _ in range(3):
        n = 20000
        t = min(timeit.repeat(chunk, number=n, repeat=5)) - min(
            timeit.repeat(refill, number=n, repeat=5)
        )
        print(f"{t / n / N * 1e9:.0f} ns per PUBACK")


if __name__ == "__main__":
    main()
