"""Overload limits: token buckets for the publish rates and the connection rate per address.

Pure bookkeeping (no asyncio): callers pass the loop's monotonic time. docs/security.md
("Limits") says what each limit answers; this module only counts.
"""

from __future__ import annotations

from typing import Any


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; a new bucket starts full.

    Why a bucket and not a fixed window: a client that stays under the rate on average may
    still send a short burst (a reconnecting device flushing its queue) without being refused.
    """

    __slots__ = ("rate", "burst", "tokens", "stamp")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = max(1.0, burst)
        self.tokens = self.burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        t = self.tokens + (now - self.stamp) * self.rate
        self.tokens = t if t < self.burst else self.burst
        self.stamp = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one."""
        if self.tokens < 1.0:
            self._refill(now)
            if self.tokens < 1.0:
                return False
        self.tokens -= 1.0
        return True

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until `n` tokens (capped at `burst`) are available."""
        self._refill(now)
        need = min(n, self.burst) - self.tokens
        return need / self.rate if need > 0 else 0.0

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


class PublishLimit:
    """`max_publish_rate` and `max_publish_bytes_rate` of one connection, either may be off.

    The bytes bucket may go into debt: a PUBLISH is admitted while the bucket is not empty and
    then charged its whole payload, so a payload larger than one second's worth still passes
    (at the average rate) instead of waiting forever for tokens that never add up to it.
    """

    __slots__ = ("msgs", "nbytes")

    def __init__(self, msgs_per_s: float, bytes_per_s: float, now: float) -> None:
        self.msgs = TokenBucket(msgs_per_s, msgs_per_s, now) if msgs_per_s > 0 else None
        self.nbytes = TokenBucket(bytes_per_s, bytes_per_s, now) if bytes_per_s > 0 else None

    def take(self, size: int, now: float) -> bool:
        """Admit one PUBLISH of `size` payload bytes, or False (nothing spent)."""
        b = self.nbytes
        if b is not None:
            if b.tokens <= 0.0:
                b._refill(now)
                if b.tokens <= 0.0:
                    return False
            m = self.msgs
            if m is not None and not m.take(now):
                return False
            b.tokens -= size
            return True
        m = self.msgs
        return m is None or m.take(now)

    def take_all(self, packets: list[Any], now: float) -> bool:
        """Admit a whole chunk of PUBLISH at once if both buckets have room for all of it (the
        usual case for a client under its limits: the chunk keeps its batched path), or admit
        nothing and return False (then `take` decides packet by packet)."""
        m, b = self.msgs, self.nbytes
        n = len(packets)
        if m is not None and m.tokens < n:
            m._refill(now)
            if m.tokens < n:
                return False
        if b is not None:
            size = sum([len(p.payload) for p in packets])
            if b.tokens < size:  # no debt for a batch: only a single PUBLISH may overdraw
                b._refill(now)
                if b.tokens < size:
                    return False
            b.tokens -= size
        if m is not None:
            m.tokens -= n
        return True

    def wait_for(self, n: int, size: int, now: float) -> float:
        """Seconds until `n` PUBLISH of `size` payload bytes in all could pass (each bucket
        capped at its burst)."""
        wait = 0.0
        if self.msgs is not None:
            wait = self.msgs.wait_for(n, now)
        if self.nbytes is not None:
            wait = max(wait, self.nbytes.wait_for(max(1, size), now))
        return wait

    def holds(self, n: int, size: int) -> bool:
        """Whether `n` PUBLISH of `size` bytes fit in one second's worth (what may be held)."""
        m, b = self.msgs, self.nbytes
        return (m is None or n <= m.burst) and (b is None or n <= 1 or size <= b.burst)


class ConnectionRate:
    """`max_connection_rate` per source address: one bucket per IP, burst of one second.

    Buckets that are full again are forgotten by `prune` (the server's periodic task), so a scan
    from many addresses costs memory only while it lasts.
    """

    __slots__ = ("rate", "_buckets")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[str, TokenBucket] = {}

    def allow(self, ip: str, now: float) -> bool:
        """True if a new connection from `ip` is within the rate (0 = no limit)."""
        if self.rate <= 0:
            return True
        b = self._buckets.get(ip)
        if b is None:
            b = self._buckets[ip] = TokenBucket(self.rate, self.rate, now)
        return b.take(now)

    def prune(self, now: float) -> None:
        for ip in [ip for ip, b in self._buckets.items() if b.full(now)]:
            del self._buckets[ip]

    def __len__(self) -> int:
        return len(self._buckets)
