"""`password_file` in `mosquitto_passwd`'s format: one `user:hash` line per user.

Hashes read (as Mosquitto 2 does):
- `$7$<iterations>$<base64 salt>$<base64 hash>`: hash = PBKDF2-HMAC-SHA512(password, salt, iterations,
  dklen=64). That hash is exactly SCRAM-SHA-512's SaltedPassword (RFC 5802 `Hi()`), so the Kafka side can
  run SCRAM from the same file without a clear password anywhere (`scram_sha512`).
- `$6$<base64 salt>$<base64 hash>`: hash = SHA-512(password + salt), old Mosquitto files (read only).

Written: `$7$` with `DEFAULT_ITERATIONS` = 4096, not Mosquitto's 101: the Java Kafka client refuses SCRAM
with fewer than 4096 iterations (`ScramMechanism.minIterations`) and 4096 is Kafka's own default for SCRAM
credentials; librdkafka, kafka-python and aiokafka take any count. A check costs about 6 ms of CPU at 4096
(hashlib releases the GIL, so callers may run it in a thread). Files written by `mosquitto_passwd` (101)
load and check unchanged.

Timing: `check` always derives one hash, compared with `hmac.compare_digest`; for a user that is not in
the file it derives a dummy hash with the file's most common iteration count, so a missing user costs the
same time as a wrong password.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from store.auth.errors import AuthFileError

DEFAULT_ITERATIONS = 4096
SALT_LEN = 12  # what mosquitto_passwd uses
HASH_LEN = 64  # SHA-512 output, SCRAM's dkLen


@dataclass(frozen=True, slots=True)
class PasswordHash:
    """One parsed entry: `kind` 7 (PBKDF2-HMAC-SHA512) or 6 (salted SHA-512)."""

    kind: int
    iterations: int
    salt: bytes
    digest: bytes

    @classmethod
    def make(
        cls, password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
    ) -> PasswordHash:
        if iterations < 1:
            raise ValueError("iterations must be >= 1")
        salt = os.urandom(SALT_LEN) if salt is None else salt
        digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, HASH_LEN)
        return cls(7, iterations, salt, digest)

    @classmethod
    def parse(cls, text: str) -> PasswordHash:
        """Parse the part after `user:`; ValueError names what is wrong."""
        parts = text.split("$")
        if len(parts) == 5 and parts[0] == "" and parts[1] == "7":
            try:
                iterations = int(parts[2])
            except ValueError:
                raise ValueError(f"bad iteration count {parts[2]!r}") from None
            if iterations < 1:
                raise ValueError(f"bad iteration count {parts[2]!r}")
            return cls(7, iterations, _b64(parts[3], "salt"), _b64(parts[4], "hash"))
        if len(parts) == 4 and parts[0] == "" and parts[1] == "6":
            return cls(6, 1, _b64(parts[2], "salt"), _b64(parts[3], "hash"))
        raise ValueError(
            "not a $7$ or $6$ password hash (plain-text password files are not accepted)"
        )

    def derive(self, password: str) -> bytes:
        if self.kind == 7:
            return hashlib.pbkdf2_hmac(
                "sha512", password.encode(), self.salt, self.iterations, len(self.digest)
            )
        return hashlib.sha512(password.encode() + self.salt).digest()

    def matches(self, password: str) -> bool:
        return hmac.compare_digest(self.derive(password), self.digest)

    def format(self) -> str:
        salt = base64.b64encode(self.salt).decode()
        digest = base64.b64encode(self.digest).decode()
        if self.kind == 7:
            return f"$7${self.iterations}${salt}${digest}"
        return f"$6${salt}${digest}"


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"bad base64 {what}") from None


class PasswordFile:
    """The users of one password file; immutable once loaded except through `set`/`delete` (CLI use)."""

    __slots__ = ("_entries", "_dummy")

    def __init__(self, entries: dict[str, PasswordHash] | None = None) -> None:
        self._entries: dict[str, PasswordHash] = dict(entries or {})
        self._dummy = self._make_dummy()

    @classmethod
    def load(cls, path: str | Path) -> PasswordFile:
        """Read a `mosquitto_passwd` file; AuthFileError (path:line) for a line that does not parse."""
        name = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthFileError(name, 0, f"cannot read: {exc}") from None
        entries: dict[str, PasswordHash] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            user, sep, hashed = line.partition(":")
            if not sep or not user:
                raise AuthFileError(name, number, "expected user:hash")
            try:
                entries[user] = PasswordHash.parse(hashed)
            except ValueError as exc:
                raise AuthFileError(name, number, f"user {user!r}: {exc}") from None
        return cls(entries)

    @property
    def users(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, user: object) -> bool:
        return user in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def check(self, user: str, password: str) -> bool:
        """True iff `user` is in the file and `password` is theirs; constant time in both cases."""
        entry = self._entries.get(user)
        if entry is None:
            self._dummy.matches(password)  # same work as a real user, result ignored
            return False
        return entry.matches(password)

    def scram_sha512(self, user: str) -> tuple[bytes, int, bytes] | None:
        """(salt, iterations, SaltedPassword) of a `$7$` entry; None for no such user or a `$6$` one."""
        entry = self._entries.get(user)
        if entry is None or entry.kind != 7 or len(entry.digest) != HASH_LEN:
            return None
        return entry.salt, entry.iterations, entry.digest

    def set(self, user: str, password: str, iterations: int = DEFAULT_ITERATIONS) -> None:
        if not user or ":" in user or "\n" in user:
            raise ValueError("a user name may not be empty nor contain ':' or a newline")
        self._entries[user] = PasswordHash.make(password, iterations)
        self._dummy = self._make_dummy()

    def delete(self, user: str) -> bool:
        found = self._entries.pop(user, None) is not None
        self._dummy = self._make_dummy()
        return found

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file + rename), mode 0600 like mosquitto_passwd's files should be."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        body = "".join(f"{user}:{entry.format()}\n" for user, entry in self._entries.items())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)

    def _make_dummy(self) -> PasswordHash:
        counts = Counter(e.iterations for e in self._entries.values() if e.kind == 7)
        iterations = counts.most_common(1)[0][0] if counts else DEFAULT_ITERATIONS
        return PasswordHash.make(os.urandom(16).hex(), iterations)
