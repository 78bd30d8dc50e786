"""The error of a password or ACL file, in a leaf of its own: the parsers raise it and the
package re-exports it, and neither imports the other for it."""

from __future__ import annotations


class AuthFileError(ValueError):
    """A password or ACL file that does not parse; `str()` is `path:line: what` for the log."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        self.message = message
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")
