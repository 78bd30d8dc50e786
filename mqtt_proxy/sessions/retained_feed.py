"""Retained messages for a new subscription, fed page by page as the client takes them.

A `#` subscription on a gateway holding a million retained topics must neither load them all
at once (in either process: the core answers one page per call) nor send more QoS 1/2
messages than the client's Receive Maximum allows (MQTT 5 §4.9), nor stop at a fixed count.
The feed writes what the socket and the window take, then waits: `Delivery.mark_session`, which
runs when acks free the window or the socket drains, calls `pump` again. The subscription's
own queue stays held until the feed ends, so a newer message on a retained topic never
arrives before the retained one.

`started` runs once the first page has been written (or could not be): the SUBSCRIBE that asked
for it then lets the connection read again, which it must, since the client's PUBACKs are what
let a large feed go on. `finished` runs once, when every page is written or the feed is
abandoned (connection gone, filter unsubscribed).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from lightqueue.model import StoredMessage
from mqtt_proxy.delivery.queue_cache import CachedMsg
from mqtt_proxy.ports import RetainedPageSink
from mqtt_proxy.sessions.state import Inflight, Subscription

PAGE = 512  # retained messages per page asked of the store
CHUNK = 64  # messages per socket write; the socket's pause is checked between chunks

PageSource = Callable[[str, bytes | None, int, RetainedPageSink], None]


class RetainedFeed:
    """One subscription's retained messages, from the first page to the last."""

    __slots__ = ("sub", "conn", "_source", "_msgs", "_i", "_cursor", "_more", "_asking", "_pumping",
                 "_received", "_started", "_finished")  # fmt: skip

    def __init__(
        self,
        source: PageSource,
        sub: Subscription,
        started: Callable[[], None],
        finished: Callable[[], None],
    ) -> None:
        self.sub = sub
        self.conn = sub.session.conn  # the connection it writes to; a takeover ends the feed
        self._source = source
        self._msgs: list[StoredMessage] = []
        self._i = 0
        self._cursor: bytes | None = None
        self._more = True  # pages left to ask for
        self._asking = False
        self._pumping = False
        self._received = False
        self._started: Callable[[], None] | None = started
        self._finished: Callable[[], None] | None = finished

    def start(self) -> None:
        self.sub.session.feeds.append(self)
        self.pump()

    def _page(self, msgs: list[StoredMessage], cursor: bytes | None) -> None:
        self._asking = False
        self._received = True
        self._msgs, self._i = msgs, 0
        self._cursor, self._more = cursor, cursor is not None
        if not self._pumping:  # an answer that came later (another process); else pump loops
            self.pump()

    def pump(self) -> None:
        """Write what the connection takes now; ask for the next page when this one is done.
        A loop, not recursion: the in-process store answers within the call."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while True:
                if self._gone():
                    self.finish()
                    return
                if self._i < len(self._msgs):
                    if not self._write():
                        break  # the window or the socket is full: wait for mark_session
                    continue
                if not self._more:
                    self.finish()
                    return
                if self._asking:
                    break
                self._asking = True
                self._source(self.sub.spec.filter, self._cursor, PAGE, self._page)
                if self._asking:
                    break  # the answer comes later, through _page
        finally:
            self._pumping = False
        if self._received:  # not before the first page is written: its order is the lookup's
            self._start_done()

    def _gone(self) -> bool:
        session = self.sub.session
        conn = self.conn
        return (
            conn is None
            or conn.closed
            or session.conn is not conn
            or session.subs.get(self.sub.spec.raw) is not self.sub
        )

    def _write(self) -> bool:
        """Write up to CHUNK messages of the page; False when nothing more can go now."""
        sub = self.sub
        session = sub.session
        conn = self.conn
        assert conn is not None
        if not conn.writable:
            return False
        now_ms = int(time.time() * 1000)
        acl = conn.acl
        msgs = self._msgs
        out = []
        i = self._i
        end = min(len(msgs), i + CHUNK)
        window = conn.out_window
        while i < end:
            m = CachedMsg.from_stored(msgs[i])
            if m.expired(now_ms) or (acl is not None and not acl.can_read(m.topic)):
                i += 1
                continue
            qos = min(m.qos, sub.qos)
            if qos and len(session.inflight) >= window:
                break
            i += 1
            sids = (sub.sub_id,) if (conn.v5 and sub.sub_id) else ()
            tpl = m.template(qos, True, conn.v5, sids, now_ms)
            if qos:
                pid = session.alloc_pid()
                data = tpl.packet(pid)
                session.inflight[pid] = Inflight("", -1, qos, data, False, sub.spec.raw)
            else:
                pid = 0
                data = tpl.data
            if conn.out_aliases is not None:
                data = conn.out_aliases.packet(m.topic, tpl, pid, data)
            out.append(data)
        moved = i > self._i
        self._i = i
        if out:
            conn.write_delivery(b"".join(out), len(out), sum(map(len, out)))
        return moved

    def _start_done(self) -> None:
        started, self._started = self._started, None
        if started is not None:
            started()

    def finish(self) -> None:
        """The feed ends (all sent, or the connection or subscription is gone)."""
        feeds = self.sub.session.feeds
        if self in feeds:
            feeds.remove(self)
        self._msgs = []
        self._more = False
        self._start_done()
        finished, self._finished = self._finished, None
        if finished is not None:
            finished()
