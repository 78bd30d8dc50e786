"""`lightgate passwd`: manage a `password_file` with `mosquitto_passwd`'s options.

    lightgate passwd [-c | -D] [-I ITERATIONS] FILE USER          # prompts for the password
    lightgate passwd [-c] -b [-I ITERATIONS] FILE USER PASSWORD   # batch (the password is visible
                                                                  # in the process list, as there)

`-c` creates (or overwrites) FILE; without it FILE must exist. `-D` deletes USER. Entries are `$7$`
(PBKDF2-HMAC-SHA512) with 4096 iterations by default, which `mosquitto_passwd` and Mosquitto read
too; the Kafka side derives SCRAM-SHA-512 from them (store/auth/passwords.py says why 4096).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Sequence
from pathlib import Path

from store.auth import AuthFileError, PasswordFile
from store.auth.passwords import DEFAULT_ITERATIONS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightgate passwd",
        description="Add, change or delete a user of a password_file (mosquitto_passwd format).",
    )
    p.add_argument("-c", dest="create", action="store_true", help="create FILE (overwrite it)")
    p.add_argument(
        "-b", dest="batch", action="store_true", help="take PASSWORD from the command line"
    )
    p.add_argument("-D", dest="delete", action="store_true", help="delete USER from FILE")
    p.add_argument(
        "-I",
        dest="iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"PBKDF2 iterations (default {DEFAULT_ITERATIONS}; Java Kafka clients need >= 4096)",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("user", metavar="USER")
    p.add_argument("password", metavar="PASSWORD", nargs="?")
    return p


def _fail(message: str) -> int:
    print(f"lightgate passwd: {message}", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.create and ns.delete:
        return _fail("-c and -D cannot be used together")
    if ns.batch and ns.delete:
        return _fail("-b and -D cannot be used together")
    if ns.batch != (ns.password is not None):
        return _fail("PASSWORD is given with -b, and only with it")
    if ns.iterations < 1:
        return _fail("-I: iterations must be >= 1")
    if not ns.user or ":" in ns.user:
        return _fail("a user name may not be empty nor contain ':'")
    path = Path(ns.file)
    if ns.create:
        pwfile = PasswordFile()
    else:
        if not path.exists():
            return _fail(f"{path}: no such file (use -c to create it)")
        try:
            pwfile = PasswordFile.load(path)
        except AuthFileError as exc:
            return _fail(str(exc))
    if ns.delete:
        if not pwfile.delete(ns.user):
            return _fail(f"user {ns.user!r} not found in {path}")
    else:
        password = ns.password if ns.batch else _prompt()
        if password is None:
            return 1
        pwfile.set(ns.user, password, ns.iterations)
    try:
        pwfile.save(path)
    except OSError as exc:
        return _fail(f"{path}: cannot write: {exc}")
    return 0


def _prompt() -> str | None:
    try:
        first = getpass.getpass("Password: ")
        second = getpass.getpass("Reenter password: ")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None
    if first != second:
        print("lightgate passwd: passwords do not match", file=sys.stderr)
        return None
    if not first:
        print("lightgate passwd: empty password", file=sys.stderr)
        return None
    return first


if __name__ == "__main__":
    sys.exit(main())
