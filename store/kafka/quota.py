"""Produce quota per connection, answered Kafka's way (KIP-13, KIP-219).

A token bucket of `produce_byte_rate` bytes a second (burst: one second's worth) is charged with
each Produce request's size. A request that takes the bucket below zero is still handled; its
response carries `throttle_time_ms` (the time the debt takes to refill), and the connection is
muted (not read) for that long, as a Kafka broker mutes the channel after sending a throttled
response. librdkafka, the Java client and aiokafka also hold back sends for that time.
Pure bookkeeping: the caller passes the loop's monotonic time and does the muting.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

__all__ = ["ProduceQuota", "with_throttle"]


class ProduceQuota:
    __slots__ = ("rate", "tokens", "stamp")

    def __init__(self, byte_rate: int, now: float) -> None:
        self.rate = float(byte_rate)
        self.tokens = self.rate
        self.stamp = now

    def charge(self, nbytes: int, now: float) -> int:
        """Spend `nbytes`; the throttle time in ms (0 while the bucket is not in debt)."""
        t = self.tokens + (now - self.stamp) * self.rate
        self.tokens = (t if t < self.rate else self.rate) - nbytes
        self.stamp = now
        if self.tokens >= 0:
            return 0
        return int(-self.tokens / self.rate * 1000) + 1


def with_throttle(response: Any, throttle_ms: int) -> Any:
    """`response` with its `throttle_time` set (versions without the field are left as they are)."""
    if throttle_ms <= 0 or not hasattr(response, "throttle_time"):
        return response
    return dataclasses.replace(response, throttle_time=timedelta(milliseconds=throttle_ms))
