"""Users and ACLs in Mosquitto's own file formats, shared by the MQTT proxy and the Kafka server.

The store is the lowest component, so both protocol front ends can import this package; it is pure
(file parsing, hashing, topic-filter algebra) apart from reading the two files. `Security` holds the
current `PasswordFile` and `Acl`; servers keep a reference to one `Security` and read its attributes
at each operation, so `reload()` (SIGHUP) swaps the rules in place for every open connection.
"""

from __future__ import annotations

from store.auth.acl import Acl, ClientAcl
from store.auth.errors import AuthFileError
from store.auth.passwords import PasswordFile
from store.auth.security import ConnectVerdict, Security

__all__ = ["Acl", "AuthFileError", "ClientAcl", "ConnectVerdict", "PasswordFile", "Security"]
