"""The one object both protocol servers reference for users and rights; `reload()` swaps in place.

Servers read `security.passwords` / `security.acl` at each operation (never keep their own copy beyond a
cache keyed by `generation`), so rules reloaded on SIGHUP apply to open connections from their next
operation and delivery on, without dropping any connection.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from store.auth.acl import Acl, ClientAcl
from store.auth.errors import AuthFileError
from store.auth.http_hook import HttpAuth
from store.auth.jwt_auth import JwtAuth
from store.auth.passwords import PasswordFile


class ConnectVerdict(enum.Enum):
    """What CONNECT (or SASL) gets: MQTT maps these to 0x00, 0x04/0x86 and 0x05/0x87."""

    OK = "ok"
    BAD_CREDENTIALS = "bad user name or password"
    NOT_AUTHORIZED = "not authorized"


class Security:
    """Current password file, ACL and anonymous policy (allow_anonymous already resolved to a bool)."""

    __slots__ = (
        "password_file", "acl_file", "allow_anonymous", "passwords", "acl", "generation", "_listeners",
        "jwt", "http",
    )  # fmt: skip

    def __init__(
        self,
        *,
        password_file: str = "",
        acl_file: str = "",
        allow_anonymous: bool = True,
        passwords: PasswordFile | None = None,
        acl: Acl | None = None,
    ) -> None:
        self.password_file = password_file
        self.acl_file = acl_file
        self.allow_anonymous = allow_anonymous
        self.passwords = passwords
        self.acl = acl if acl is not None else Acl.allow_all()
        # Bumped by every successful reload: per-connection caches compare it to drop stale decisions.
        self.generation = 0
        self._listeners: list[Callable[[], None]] = []
        # Tokens as passwords (jwt_auth.py) and the web service hook (http_hook.py); None: off.
        self.jwt: JwtAuth | None = None
        self.http: HttpAuth | None = None

    @classmethod
    def load(
        cls, *, password_file: str = "", acl_file: str = "", allow_anonymous: bool = True
    ) -> Security:
        """Read both files now; AuthFileError (path:line) if either does not parse (startup fails)."""
        passwords, acl = _read(password_file, acl_file)
        return cls(
            password_file=password_file,
            acl_file=acl_file,
            allow_anonymous=allow_anonymous,
            passwords=passwords,
            acl=acl,
        )

    @classmethod
    def open(cls) -> Security:
        """No files: anyone may connect and do anything (tests and embedders)."""
        return cls()

    def reload(self) -> list[str]:
        """Re-read both files. All or nothing: on any error the old rules stay and the errors return."""
        try:
            passwords, acl = _read(self.password_file, self.acl_file)
            if self.jwt is not None:
                self.jwt.reload()
        except AuthFileError as exc:
            return [str(exc)]
        self.passwords, self.acl = passwords, acl
        if self.http is not None:
            self.http.clear()
        self.generation += 1
        for callback in list(self._listeners):
            callback()
        return []

    async def close(self) -> None:
        """Stop the JWKS refresher and the auth hook's HTTP session."""
        if self.jwt is not None:
            self.jwt.close()
        if self.http is not None:
            await self.http.close()

    def on_reload(self, callback: Callable[[], None]) -> None:
        """Call `callback` after each successful reload (servers refresh per-connection caches)."""
        self._listeners.append(callback)

    @property
    def enabled(self) -> bool:
        """True when something is checked at all (a password file or an ACL, or anonymous refused)."""
        return (
            self.passwords is not None
            or not self.acl.allows_everything
            or not self.allow_anonymous
            or self.jwt is not None
            or self.http is not None
        )

    def check_connect(
        self, user: str | None, password: bytes | None, *, verified_user: bool = False
    ) -> ConnectVerdict:
        """Decide a CONNECT (or SASL PLAIN). `verified_user`: the name was proven otherwise (a TLS cert).

        - no user name: anonymous, OK only when allow_anonymous;
        - a user name and a password file: the password must match (a missing password never does);
        - a user name and no password file: Mosquitto's rule, the name is taken unverified when
          anonymous clients are allowed, and nobody is let in otherwise.
        Costs one PBKDF2 derivation when a password file is set (callers may run it in a thread).
        """
        if verified_user and user is not None:
            return ConnectVerdict.OK
        if user is None:
            return ConnectVerdict.OK if self.allow_anonymous else ConnectVerdict.NOT_AUTHORIZED
        passwords = self.passwords
        if passwords is None:
            return ConnectVerdict.OK if self.allow_anonymous else ConnectVerdict.NOT_AUTHORIZED
        try:
            text = None if password is None else password.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None:
            passwords.check("", "\0")  # the same cost as any other refusal
            return ConnectVerdict.BAD_CREDENTIALS
        return ConnectVerdict.OK if passwords.check(user, text) else ConnectVerdict.BAD_CREDENTIALS

    def client_acl(self, user: str | None, client_id: str) -> ClientAcl:
        """The current compiled rules of one client; callers cache it with `generation`."""
        return self.acl.for_client(user, client_id)


def _read(password_file: str, acl_file: str) -> tuple[PasswordFile | None, Acl]:
    passwords = PasswordFile.load(password_file) if password_file else None
    acl = Acl.load(acl_file) if acl_file else Acl.allow_all()
    return passwords, acl
