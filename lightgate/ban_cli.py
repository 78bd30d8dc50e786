"""`lightgate ban list|add|remove`: a running gateway's bans, over its HTTP `/api/bans`.

Talks to the gateway that holds the bans (the core, which every MQTT proxy mirrors), so a ban
added here applies to the next CONNECT on every proxy and survives a restart. `add` and
`remove` send the admin bearer token: `--token-file`, else the environment variable
`LIGHTGATE_ADMIN_TOKEN`, else the config's `http_admin_token_file`.

Exit status: 0 done, 1 refused by the gateway (the reason is printed), 2 unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """The `ban` subcommand and its three actions."""
    ban = sub.add_parser(
        "ban",
        help="list, add or remove bans of a running gateway (client ids, addresses)",
        description="Bans refuse a client id or a source address at CONNECT (MQTT 5 0x8A "
        "Banned, 3.1.1 0x05). Flapping detection adds them too (flapping_max_disconnects).",
    )
    actions = ban.add_subparsers(dest="action", required=True, metavar="list|add|remove")
    for name, text in (
        ("list", "the bans in force"),
        ("add", "ban a client id or an address"),
        ("remove", "lift a ban"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("--config", help="TOML config file: host, http_port and the token file")
        p.add_argument("--url", help="the gateway's HTTP listener (default http://HOST:HTTP_PORT)")
        if name == "list":
            p.add_argument("--json", action="store_true", help="print the JSON the gateway gives")
            continue
        p.add_argument("--token-file", help="the admin bearer token (http_admin_token_file)")
        who = p.add_mutually_exclusive_group(required=True)
        who.add_argument("--client-id", help="the MQTT client id")
        who.add_argument("--address", help="the source IP address")
        if name == "add":
            p.add_argument("--duration", type=float, default=0, metavar="SECONDS",
                           help="how long (default 0: until removed)")  # fmt: skip
            p.add_argument("--reason", default="", help="kept with the ban, shown by list")


def _token(ns: argparse.Namespace, token_file: str) -> str | None:
    path = ns.token_file or ""
    if not path and os.environ.get("LIGHTGATE_ADMIN_TOKEN"):
        return os.environ["LIGHTGATE_ADMIN_TOKEN"].strip()
    path = path or token_file
    return Path(path).read_text().strip() if path else None


def _request(method: str, url: str, token: str | None, body: bytes | None = None) -> Any:
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    with opener.open(req, timeout=10) as r:
        return json.loads(r.read())


def _until(ban: dict[str, Any]) -> str:
    until = float(ban.get("until") or 0)
    if not until:
        return "until removed"
    left = until - time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(until))
    return f"until {stamp}Z ({max(0, left):.0f} s left)"


def main(ns: argparse.Namespace, base_url: str, token_file: str) -> int:
    url = base_url.rstrip("/") + "/api/bans"
    try:
        if ns.action == "list":
            bans = _request("GET", url, None)["bans"]
            if ns.json:
                print(json.dumps(bans, indent=1))
            elif not bans:
                print("no bans")
            for b in [] if ns.json else bans:
                print(f"{b['kind']:<9} {b['value']!r:<24} {_until(b)}  {b['reason']}")
            return 0
        kind, value = ("client_id", ns.client_id) if ns.client_id else ("address", ns.address)
        try:
            token = _token(ns, token_file)
        except OSError as exc:
            print(f"lightgate ban: the admin token: {exc}", file=sys.stderr)
            return 2
        if ns.action == "add":
            body = json.dumps({kind: value, "duration_s": ns.duration, "reason": ns.reason})
            ban = _request("POST", url, token, body.encode())
            print(f"banned {kind} {value!r} {_until(ban)}")
        else:
            query = urllib.parse.urlencode({kind: value})
            _request("DELETE", f"{url}?{query}", token)
            print(f"ban on {kind} {value!r} removed")
        return 0
    except urllib.error.HTTPError as exc:
        why = exc.read().decode(errors="replace").strip()
        print(f"lightgate ban: {exc.code} {why}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"lightgate ban: cannot reach {url}: {exc}", file=sys.stderr)
        return 2
