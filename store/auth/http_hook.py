"""A web service decides CONNECTs and topic rights, as mosquitto-go-auth's HTTP backend and EMQX's
HTTP authenticator do.

A POST of a JSON object whose fields are configured (`connect_body` / `acl_body`: `name=value`
pairs separated by commas, where a value may hold `%u` user, `%P` password, `%c` client id, `%a`
peer address, `%t` topic, `%A` access; a value that is exactly `%A` becomes the number 1 =
subscribe/read, 2 = publish/write, as mosquitto-go-auth sends `acc`). A 2xx answer allows, unless its JSON body says `"result": "deny"` (EMQX) or
`"ok": false` (mosquitto-go-auth); anything else denies: another status, a timeout, a refused
connection, a body that is not JSON when one was sent. The hook fails closed.

Cost is kept off the publishing clients: at most `max_in_flight` requests run at once (more wait
their turn, counted within `timeout_s`), and every answer is cached for `cache_ttl_s` keyed by what
was asked, so a client publishing to a topic it was already allowed pays one dictionary lookup
(`cached`), never an await. Only a topic not asked before (or whose answer aged out) makes its
connection wait for the service (the MQTT proxy then holds that connection's packets, not others').
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("lightgate.auth")

SUBSCRIBE = 1  # mosquitto-go-auth's `acc`: 1 read/subscribe, 2 write/publish
PUBLISH = 2
_CACHE_MAX = 100_000

DEFAULT_CONNECT_BODY = "username=%u,password=%P,clientid=%c,peerhost=%a"
DEFAULT_ACL_BODY = "username=%u,clientid=%c,topic=%t,acc=%A"


@dataclass(frozen=True, slots=True)
class HttpHookSettings:
    connect_url: str = ""
    acl_url: str = ""
    connect_body: str = DEFAULT_CONNECT_BODY
    acl_body: str = DEFAULT_ACL_BODY
    timeout_s: float = 2.0
    cache_ttl_s: float = 60.0
    max_in_flight: int = 16

    @property
    def enabled(self) -> bool:
        return bool(self.connect_url or self.acl_url)


def check_template(text: str, what: str) -> dict[str, Any]:
    """Parse `name=value,name=value`; ValueError names the key and the bad pair."""
    body: dict[str, Any] = {}
    for pair in text.split(","):
        name, eq, value = pair.strip().partition("=")
        if not eq or not name:
            raise ValueError(f"{what}: {pair.strip()!r} is not name=value")
        body[name] = value
    return body


def _fill(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in template.items():
        if isinstance(v, str):
            if v == "%A":
                out[k] = values["%A"]
                continue
            for name, value in values.items():
                if name in v:
                    v = v.replace(name, str(value))
        out[k] = v
    return out


class HttpAuth:
    """The hook's client: bounded concurrency, a TTL cache, counters for /metrics."""

    def __init__(self, settings: HttpHookSettings) -> None:
        self.settings = settings
        self._connect_body = check_template(settings.connect_body, "auth_http_connect_body")
        self._acl_body = check_template(settings.acl_body, "auth_http_acl_body")
        self._slots: asyncio.Semaphore | None = None  # made on the loop at first use
        self._session: Any = None  # aiohttp.ClientSession, made on the loop at first use
        self._connects: dict[tuple[str | None, str, bytes], tuple[float, bool]] = {}
        self._acls: dict[tuple[str | None, str, str, int], tuple[float, bool]] = {}
        self._asking: dict[tuple[str | None, str, str, int], asyncio.Future[bool]] = {}
        self.counters = {"http_auth_requests": 0, "http_auth_failures": 0, "http_auth_cached": 0}

    # -- CONNECT ---------------------------------------------------------------------------
    async def authenticate(
        self, user: str | None, password: bytes | None, client_id: str, peer: str
    ) -> bool:
        if not self.settings.connect_url:
            return True
        pw = (password or b"").decode("utf-8", "replace")
        key = (user, client_id, hashlib.sha256(password or b"").digest())
        hit = self._connects.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            self.counters["http_auth_cached"] += 1
            return hit[1]
        values = {"%u": user or "", "%P": pw, "%c": client_id, "%a": peer, "%t": "", "%A": 0}
        allowed = await self._ask(self.settings.connect_url, _fill(self._connect_body, values))
        if allowed is None:
            return False  # a failure refuses and is not cached: the next try asks again
        _put(self._connects, key, (time.monotonic() + self.settings.cache_ttl_s, allowed))
        return allowed

    # -- topics ----------------------------------------------------------------------------
    def cached(self, user: str | None, client_id: str, topic: str, access: int) -> bool | None:
        """The answer for this topic if one is fresh (the hot path: no await), else None."""
        if not self.settings.acl_url:
            return True
        hit = self._acls.get((user, client_id, topic, access))
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        return None

    async def authorize(self, user: str | None, client_id: str, topic: str, access: int) -> bool:
        """Ask the service (one request for concurrent askers of the same key) and cache."""
        key = (user, client_id, topic, access)
        fut = self._asking.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._asking[key] = fut
            values: dict[str, Any] = {"%u": user or "", "%P": "", "%c": client_id, "%a": ""}
            values.update({"%t": topic, "%A": access})
            allowed: bool | None = None
            try:
                allowed = await self._ask(self.settings.acl_url, _fill(self._acl_body, values))
            finally:
                del self._asking[key]
                if allowed is None:
                    # A failure refuses. Cached briefly (a second at most) all the same, so the
                    # client's retry does not loop on a service that is down; then asked again.
                    ttl = min(1.0, self.settings.cache_ttl_s)
                else:
                    ttl = self.settings.cache_ttl_s
                _put(self._acls, key, (time.monotonic() + ttl, bool(allowed)))
                fut.set_result(bool(allowed))
            return bool(allowed)
        return await fut

    # -- the request -----------------------------------------------------------------------
    async def _ask(self, url: str, body: dict[str, Any]) -> bool | None:
        """The service's answer; None when it gave none (timeout, error, a 5xx, not JSON)."""
        import aiohttp

        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.max_in_flight)
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.settings.max_in_flight)
            self._session = aiohttp.ClientSession(connector=connector)
        self.counters["http_auth_requests"] += 1
        try:
            async with (
                asyncio.timeout(self.settings.timeout_s),
                self._slots,
                self._session.post(url, json=body) as resp,
            ):
                text = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.counters["http_auth_failures"] += 1
            log.warning("auth hook %s failed, refused: %s", url, exc or type(exc).__name__)
            return None
        if status >= 500:
            self.counters["http_auth_failures"] += 1
            log.warning("auth hook %s answered %d: refused", url, status)
            return None
        if not 200 <= status < 300:
            return False
        if not text.strip():
            return True
        try:
            answer = json.loads(text)
        except ValueError:
            self.counters["http_auth_failures"] += 1
            log.warning(
                "auth hook %s answered %d with a body that is not JSON: refused", url, status
            )
            return None
        return not (
            isinstance(answer, dict)
            and (answer.get("result") in ("deny", "ignore") or answer.get("ok") is False)
        )

    def clear(self) -> None:
        """Forget every cached answer (SIGHUP: the service's rules may have changed)."""
        self._connects.clear()
        self._acls.clear()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _put(cache: dict[Any, tuple[float, bool]], key: Any, value: tuple[float, bool]) -> None:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value
