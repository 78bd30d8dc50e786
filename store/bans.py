"""Banned MQTT client ids and source addresses, and the flapping detection that adds bans.

A ban names a client id or a source address (an IP), lasts until a wall-clock time (or for
ever) and carries a reason. A client that connects while banned gets CONNACK 0x8A Banned (MQTT
5) / 0x05 not authorized (3.1.1); `first_refusal` tells the caller to log only the first
refusal of each ban, so a device retrying every second does not fill the log.

Flapping: `disconnected` counts each client id's disconnects in a sliding window; the
`max_disconnects`-th within `window_s` bans the client id (and, with `ban_address`, the address
it came from) for `ban_s`. Counting is per client id across all listeners and proxies: the core
holds the one `BanList` (several proxies mirror it and report their disconnects to it).

Bans are administrative state, not derived data: `path` (the data dir's `bans.json`) is
rewritten atomically (temporary file, fsync, rename) on every change, and bans that expired are
dropped when it is read. Event-loop-only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("lightgate.bans")

KINDS = ("client_id", "address")
PRUNE_EVERY = 1024  # disconnects between sweeps of the flapping counters of quiet clients


@dataclass(frozen=True, slots=True)
class Ban:
    kind: str  # "client_id" or "address"
    value: str
    until: float  # Unix time the ban ends; 0: never
    reason: str
    created: float

    def active(self, now: float) -> bool:
        return self.until == 0 or now < self.until

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Ban:
        kind = str(d["kind"])
        if kind not in KINDS:
            raise ValueError(f"unknown ban kind {kind!r} (client_id or address)")
        return cls(kind, str(d["value"]), float(d.get("until", 0)), str(d.get("reason", "")),
                   float(d.get("created", 0)))  # fmt: skip


class BanList:
    """The bans in force, and flapping detection (`max_disconnects` 0: off)."""

    __slots__ = ("path", "max_disconnects", "window_s", "ban_s", "ban_address", "_bans",
                 "_flaps", "_logged", "_since_prune", "listeners")  # fmt: skip

    def __init__(
        self,
        path: Path | None = None,
        max_disconnects: int = 0,
        window_s: float = 60.0,
        ban_s: float = 300.0,
        ban_address: bool = False,
    ) -> None:
        """`path`: where bans persist (None: in memory only, as a proxy's mirror)."""
        self.path = path
        self.max_disconnects = max_disconnects
        self.window_s = window_s
        self.ban_s = ban_s
        self.ban_address = ban_address
        self._bans: dict[tuple[str, str], Ban] = {}
        self._flaps: dict[str, deque[float]] = {}  # client id -> its recent disconnect times
        self._logged: set[Ban] = set()  # bans whose first refusal was logged
        self._since_prune = 0
        # Called with the full list after every change (the core pushes it to its proxies).
        self.listeners: list[Callable[[list[Ban]], None]] = []
        if path is not None and path.exists():
            self._load(path)

    # -- checks (every CONNECT) --------------------------------------------------------------
    def banned(self, client_id: str, address: str, now: float | None = None) -> Ban | None:
        """The ban in force on `client_id` or `address`, if any; an expired one is dropped."""
        if not self._bans:
            return None
        t = time.time() if now is None else now
        for key in (("client_id", client_id), ("address", address)):
            ban = self._bans.get(key)
            if ban is not None:
                if ban.active(t):
                    return ban
                self._drop(key)
        return None

    def first_refusal(self, ban: Ban) -> bool:
        """True the first time a refusal because of `ban` is reported (log it then only)."""
        if ban in self._logged:
            return False
        self._logged.add(ban)
        return True

    # -- flapping ------------------------------------------------------------------------------
    def disconnected(self, client_id: str, address: str, now: float | None = None) -> Ban | None:
        """Count a disconnect of `client_id` (from `address`); the ban it triggers, if any."""
        n = self.max_disconnects
        if n <= 0 or not client_id:
            return None
        t = time.time() if now is None else now
        start = t - self.window_s
        times = self._flaps.get(client_id)
        if times is None:
            times = self._flaps[client_id] = deque()
        times.append(t)
        while times and times[0] <= start:
            times.popleft()
        self._since_prune += 1
        if self._since_prune >= PRUNE_EVERY:
            self._prune_flaps(start)
        if len(times) < n:
            return None
        del self._flaps[client_id]
        reason = f"flapping: {len(times)} disconnects in {self.window_s:g} s"
        ban = self.add("client_id", client_id, self.ban_s, reason, t)
        if self.ban_address and address:
            self.add("address", address, self.ban_s, f"{reason} (client {client_id!r})", t)
        log.warning("client %r from %s banned for %g s: %s", client_id, address, self.ban_s,
                    reason, extra={"client_id": client_id, "address": address})  # fmt: skip
        return ban

    def _prune_flaps(self, start: float) -> None:
        self._since_prune = 0
        for cid in [c for c, ts in self._flaps.items() if not ts or ts[-1] <= start]:
            del self._flaps[cid]

    # -- administration ------------------------------------------------------------------------
    def add(
        self, kind: str, value: str, duration_s: float, reason: str = "", now: float | None = None
    ) -> Ban:
        """Ban `value` (a client id or an address) for `duration_s` (0: until removed)."""
        if kind not in KINDS:
            raise ValueError(f"unknown ban kind {kind!r} (client_id or address)")
        if not value:
            raise ValueError(f"an empty {kind} cannot be banned")
        if duration_s < 0:
            raise ValueError("a ban's duration cannot be negative")
        t = time.time() if now is None else now
        ban = Ban(kind, value, t + duration_s if duration_s else 0.0, reason, t)
        self._bans[(kind, value)] = ban
        self._changed()
        return ban

    def remove(self, kind: str, value: str) -> bool:
        """Lift a ban; False if there was none."""
        if (kind, value) not in self._bans:
            return False
        self._drop((kind, value))
        if kind == "client_id":
            self._flaps.pop(value, None)  # a fresh start, not one disconnect from a new ban
        return True

    def in_force(self, now: float | None = None) -> list[Ban]:
        """The bans in force, oldest first (expired ones are dropped)."""
        t = time.time() if now is None else now
        for key in [k for k, b in self._bans.items() if not b.active(t)]:
            self._drop(key)
        return sorted(self._bans.values(), key=lambda b: (b.created, b.kind, b.value))

    def replace(self, bans: list[Ban]) -> None:
        """Take `bans` as the whole list (a proxy's mirror of the core's)."""
        self._bans = {(b.kind, b.value): b for b in bans}
        self._logged &= set(bans)

    def _drop(self, key: tuple[str, str]) -> None:
        ban = self._bans.pop(key)
        self._logged.discard(ban)
        self._changed()

    def _changed(self) -> None:
        if self.path is not None:
            self._save(self.path)
        if self.listeners:
            bans = sorted(self._bans.values(), key=lambda b: (b.created, b.kind, b.value))
            for fn in self.listeners:
                fn(bans)

    # -- persistence ---------------------------------------------------------------------------
    def _save(self, path: Path) -> None:
        data = json.dumps([b.to_json() for b in self._bans.values()], indent=1).encode()
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:  # the ban holds in memory; say once per change why it may not last
            log.error("bans not saved to %s: %s", path, exc)

    def _load(self, path: Path) -> None:
        try:
            items = json.loads(path.read_bytes())
            bans = [Ban.from_json(d) for d in items]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: cannot read the bans: {exc}") from exc
        now = time.time()
        self._bans = {(b.kind, b.value): b for b in bans if b.active(now)}


def encode_bans(bans: list[Ban]) -> bytes:
    return json.dumps([b.to_json() for b in bans]).encode()


def decode_bans(body: bytes) -> list[Ban]:
    return [Ban.from_json(d) for d in json.loads(body)]
