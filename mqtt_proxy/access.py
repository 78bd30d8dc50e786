"""Who may do what: the embedder's hooks, the ACL of `security` and the web service's cached
answers (store.auth.http_hook), asked by the handlers and the session registry.

Its own object, not methods of the server, so that the layers below the server are handed the
one thing they ask (`TopicAccess`) instead of the server. The embedder sets the hooks on the
server (`server.authenticate = ...`), which keeps them here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mqtt_proxy.codec import Subscribe
from mqtt_proxy.sessions.topic_filters import FilterError, parse_filter
from store.auth import Security
from store.auth.http_hook import PUBLISH, SUBSCRIBE, HttpAuth

if TYPE_CHECKING:
    from mqtt_proxy.ports import ClientPort
    from mqtt_proxy.sessions.state import Will

AuthHook = Callable[[str, str | None, bytes | None], bool]
AclHook = Callable[[str, str], bool]


class TopicAccess:
    """The rights of a client: at CONNECT (`check_auth`), per PUBLISH and SUBSCRIBE, for wills."""

    __slots__ = (
        "security", "topic_hook", "authenticate", "authorize_subscribe", "authorize_publish",
        "_loop",
    )  # fmt: skip

    def __init__(self, security: Security, loop: asyncio.AbstractEventLoop) -> None:
        self.security = security
        self._loop = loop
        # The web service deciding topic rights, None without `acl_url`: its cached answers are
        # read inline, a topic not cached makes only its connection wait.
        http = security.http
        self.topic_hook: HttpAuth | None = (
            http if http is not None and http.settings.acl_url else None
        )
        # Hooks the embedder may set, checked after `security`; None allows everything.
        self.authenticate: AuthHook | None = None
        self.authorize_subscribe: AclHook | None = None
        self.authorize_publish: AclHook | None = None

    def check_auth(self, client_id: str, username: str | None, password: bytes | None) -> bool:
        """The embedder's hook, if any (after `security` accepted the client)."""
        if self.authenticate is not None:
            return bool(self.authenticate(client_id, username, password))
        return True

    def may_subscribe(self, conn: ClientPort, filt: str) -> bool:
        acl = conn.acl
        if acl is not None and not acl.can_subscribe(filt):
            return False
        web = self.topic_hook
        if (
            web is not None
            and not conn.internal
            and not web.cached(conn.username, conn.client_id, filt, SUBSCRIBE)
        ):
            return False  # refused, or its answer aged out since subscribe_pending: fail closed
        hook = self.authorize_subscribe
        return True if hook is None else bool(hook(conn.client_id, filt))

    def may_publish(self, conn: ClientPort, topic: str) -> bool:
        acl = conn.acl
        if acl is not None and not acl.can_write(topic):
            return False
        web = self.topic_hook
        if (
            web is not None
            and not conn.internal
            and web.cached(conn.username, conn.client_id, topic, PUBLISH) is False
        ):
            return False  # not asked yet (a will at CONNECT) is decided when it is published
        hook = self.authorize_publish
        return True if hook is None else bool(hook(conn.client_id, topic))

    def may_publish_hooked(self, conn: ClientPort, topic: str) -> bool | None:
        """`may_publish` with the auth hook: its cached answer (one lookup), or None when it must
        be asked first: the connection then waits (its packets held, reading paused) and
        handles them again once the answer is cached."""
        web = self.topic_hook
        assert web is not None
        if topic[:1] == "$" or (conn.acl is not None and not conn.acl.can_write(topic)):
            return False  # refused without asking
        if conn.internal:
            return True
        answer = web.cached(conn.username, conn.client_id, topic, PUBLISH)
        if answer is None:
            conn.block()
            ask = web.authorize(conn.username, conn.client_id, topic, PUBLISH)
            self._loop.create_task(ask).add_done_callback(lambda _t: conn.unblock())
            return None
        hook = self.authorize_publish
        return answer and (hook is None or bool(hook(conn.client_id, topic)))

    def subscribe_pending(
        self, conn: ClientPort, p: Subscribe, again: Callable[[Any, Subscribe], None]
    ) -> bool:
        """As `may_publish_hooked` for a SUBSCRIBE's filters; `again(conn, p)` runs it once they
        are all answered (the connection stays blocked meanwhile)."""
        web = self.topic_hook
        assert web is not None
        user, cid = conn.username, conn.client_id
        ask = []
        for ts in p.subscriptions:
            try:
                filt = parse_filter(ts.filter, None).filter
            except FilterError:
                continue
            if web.cached(user, cid, filt, SUBSCRIBE) is None:
                ask.append(web.authorize(user, cid, filt, SUBSCRIBE))
        if not ask:
            return False
        conn.block()

        def answered(_t: asyncio.Future[Any]) -> None:
            if not conn.closed:
                again(conn, p)  # ends with the SUBACK and unblock(), as any SUBSCRIBE

        asyncio.gather(*ask, return_exceptions=True).add_done_callback(answered)
        return True

    def will_allowed(self, will: Will) -> bool | None:
        """The will's topic under the rules of now; None: the auth hook was not asked yet."""
        if will.topic[:1] == "$":
            return False
        acl = will.acl
        if acl is None and not self.security.acl.allows_everything:
            acl = self.security.acl.for_client(will.user, will.owner)
        if acl is not None and not acl.can_write(will.topic):
            return False
        web = self.topic_hook
        if web is not None:
            return web.cached(will.user, will.owner, will.topic, PUBLISH)
        hook = self.authorize_publish
        return True if hook is None else bool(hook(will.owner, will.topic))

    def authorize_will(self, will: Will, then: Callable[[bool], None]) -> None:
        """Ask the auth hook about a will's topic (`will_allowed` said None); `then(allowed)`."""
        web = self.topic_hook
        assert web is not None
        task = self._loop.create_task(web.authorize(will.user, will.owner, will.topic, PUBLISH))
        task.add_done_callback(lambda t: then(bool(not t.exception() and t.result())))
