"""Users and ACLs in Mosquitto's own file formats, shared by the MQTT proxy and the Kafka server.

The store is the lowest component, so both protocol front ends can import this package; it is pure
(file parsing, hashing, topic-filter algebra) apart from reading the two files. `Security` holds the
current `PasswordFile` and `Acl`; servers keep a reference to one `Security` and read its attributes
at each operation, so `reload()` (SIGHUP) swaps the rules in place for every open connection.
"""

from __future__ import annotations


class AuthFileError(ValueError):
    """A password or ACL file that does not parse; `str()` is `path:line: what` for the log."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        self.message = message
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


from store.auth.acl import Acl, ClientAcl  # noqa: E402
from store.auth.passwords import PasswordFile  # noqa: E402
from store.auth.security import ConnectVerdict, Security  # noqa: E402

__all__ = ["Acl", "AuthFileError", "ClientAcl", "ConnectVerdict", "PasswordFile", "Security"]
