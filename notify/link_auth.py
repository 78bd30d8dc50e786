"""The core link's handshake: both ends prove they know `core_secret` without sending it.

Sans-IO: `LinkAuth.start()` and `LinkAuth.receive(step, body)` return the `(step, body)` messages
to send (notify.link carries them as AUTH frames, the step in the method field) and raise
`AuthFailed` with a message for the log (and for the peer) when the other end fails.

Theory of operation (HMAC-SHA256, 32-byte random nonces, labels keep the two proofs apart so
neither can be replayed as the other)::

    proxy → core   HELLO      nonce_p            (empty: the proxy has no secret)
    core  → proxy  CHALLENGE  nonce_c
    proxy → core   PROOF      HMAC(secret, "lightgate core link: proxy" | nonce_c | nonce_p)
    core  → proxy  ACCEPT     HMAC(secret, "lightgate core link: core"  | nonce_p | nonce_c)

The proxy proves first, over the core's fresh nonce, so a stranger who connects to a core learns
nothing computed from the secret; the core then proves itself over the proxy's fresh nonce. With
no secret on either end the exchange is HELLO (empty), ACCEPT (empty): a Unix-socket link, whose
file permissions guard it. A secret on one end only is refused on both, with a message that says
which. Nothing but this exchange (and heartbeats) is accepted before ACCEPT. Without TLS the
handshake authenticates the link but does not encrypt it: `core_tls` does that.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

HELLO, CHALLENGE, PROOF, ACCEPT = 1, 2, 3, 4
NONCE = 32
_PROXY_LABEL = b"lightgate core link: proxy"
_CORE_LABEL = b"lightgate core link: core"
_STEP_NAMES = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", PROOF: "PROOF", ACCEPT: "ACCEPT"}


class AuthFailed(Exception):
    """The other end failed the handshake (or broke it); the link must close."""


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


class LinkAuth:
    """One end of the handshake: `role` is "core" (accepts links) or "proxy" (opens them)."""

    __slots__ = ("role", "_secret", "_mine", "_theirs", "_expect", "done")

    def __init__(self, role: str, secret: bytes | None) -> None:
        if role not in ("core", "proxy"):
            raise ValueError(f"role {role!r}: core or proxy")
        self.role = role
        self._secret = secret or None
        self._mine = b""
        self._theirs = b""
        self._expect = HELLO if role == "core" else CHALLENGE if secret else ACCEPT
        self.done = False

    def start(self) -> list[tuple[int, bytes]]:
        """What this end sends first (the proxy's HELLO; the core waits)."""
        if self.role == "core":
            return []
        self._mine = secrets.token_bytes(NONCE) if self._secret else b""
        return [(HELLO, self._mine)]

    def receive(self, step: int, body: bytes) -> list[tuple[int, bytes]]:
        if self.done or step != self._expect:
            got, want = _STEP_NAMES.get(step, str(step)), _STEP_NAMES[self._expect]
            raise AuthFailed(f"handshake broken: got {got} where {want} was due")
        return self._core(step, body) if self.role == "core" else self._proxy(step, body)

    def _core(self, step: int, body: bytes) -> list[tuple[int, bytes]]:
        secret = self._secret
        if step == HELLO:
            if secret is None:
                if body:
                    raise AuthFailed("the proxy has a core_secret and this core has none")
                self.done = True
                return [(ACCEPT, b"")]
            if not body:
                raise AuthFailed("this core requires core_secret and the proxy has none")
            if len(body) != NONCE:
                raise AuthFailed("handshake broken: malformed HELLO")
            self._theirs, self._mine = body, secrets.token_bytes(NONCE)
            self._expect = PROOF
            return [(CHALLENGE, self._mine)]
        assert secret is not None  # step == PROOF
        want = _mac(secret, _PROXY_LABEL, self._mine, self._theirs)
        if not hmac.compare_digest(body, want):
            raise AuthFailed("wrong core_secret")
        self.done = True
        return [(ACCEPT, _mac(secret, _CORE_LABEL, self._theirs, self._mine))]

    def _proxy(self, step: int, body: bytes) -> list[tuple[int, bytes]]:
        secret = self._secret
        if step == CHALLENGE:
            assert secret is not None
            if len(body) != NONCE:
                raise AuthFailed("handshake broken: malformed CHALLENGE")
            self._theirs = body
            self._expect = ACCEPT
            return [(PROOF, _mac(secret, _PROXY_LABEL, body, self._mine))]
        if secret is None:  # step == ACCEPT of a link without secrets
            if body:
                raise AuthFailed("handshake broken: a proof where none was asked")
        elif not hmac.compare_digest(body, _mac(secret, _CORE_LABEL, self._mine, self._theirs)):
            raise AuthFailed("the core did not prove core_secret (a different secret?)")
        self.done = True
        return []
