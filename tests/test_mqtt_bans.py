"""Bans and flapping detection (store/bans.py, docs/security.md "Bans and flapping detection").

A real `lightgate serve` (one process, and with MQTT proxies in their own processes, where the
core holds the bans), raw CONNECTs to read the exact CONNACK codes, the HTTP API with and without
the admin token, and the `lightgate ban` CLI as an operator runs it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gateway_process import GatewayProcess
from mqtt_raw import connect_packet

Factory = Callable[..., GatewayProcess]
TOKEN = "0123456789abcdef0123456789abcdef"
BANNED_V5 = 0x8A
NOT_AUTHORIZED_V3 = 0x05


def _connack(port: int, cid: str, level: int = 5, disconnect: bool = True) -> int:
    """CONNECT with a raw socket; the CONNACK's code; then DISCONNECT (a clean disconnect still
    counts for flapping detection) unless refused."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(connect_packet(cid.encode(), level=level))
        data = b""
        while len(data) < 4:
            chunk = s.recv(64)
            assert chunk, f"closed without CONNACK: {data!r}"
            data += chunk
        assert data[0] == 0x20, data
        code = data[3]
        if code == 0 and disconnect:
            s.sendall(b"\xe0\x00")
            s.recv(64)  # the gateway closes after our DISCONNECT
        return code


def _http(gw: GatewayProcess, method: str, path: str, token: str | None = None,
          body: dict[str, Any] | None = None) -> tuple[int, Any]:  # fmt: skip
    url = f"http://127.0.0.1:{gw.port('http')}{path}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _cli(gw: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    url = f"http://127.0.0.1:{gw.port('http')}"
    return subprocess.run(
        [sys.executable, "-m", "lightgate", "ban", *args, "--url", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "admin.token"
    p.write_text(TOKEN + "\n")
    return p


def _flapping_gw(factory: Factory, token_file: Path, *extra: str) -> GatewayProcess:
    return factory(
        None, "--set", "flapping_max_disconnects=3", "--set", "flapping_window_s=60",
        "--set", "flapping_ban_s=600", "--set", f"http_admin_token_file={token_file}", *extra,
    )  # fmt: skip


@pytest.mark.parametrize("processes", [0, 2], ids=["serve", "two-proxies"])
def test_flapping_client_banned_and_unbanned_over_http(
    gateway_factory: Factory, token_file: Path, processes: int
) -> None:
    """Three disconnects within the window ban the client id, counted by the core whichever
    proxy each connection reached; the ban refuses v5 (0x8A) and 3.1.1 (0x05) alike, logs its
    first refusal only, and lifting it needs the admin token."""
    gw = _flapping_gw(gateway_factory, token_file, "--set", f"mqtt_processes={processes}")
    port = gw.port("mqtt")
    for _ in range(3):
        assert _connack(port, "flappy") == 0
    assert _connack(port, "flappy") == BANNED_V5
    assert _connack(port, "flappy", level=4) == NOT_AUTHORIZED_V3
    for _ in range(4):  # every proxy has the core's list
        assert _connack(port, "flappy") == BANNED_V5
    assert _connack(port, "calm") == 0  # others are not concerned
    status, listed = _http(gw, "GET", "/api/bans")
    assert status == 200
    (ban,) = listed["bans"]
    assert (ban["kind"], ban["value"]) == ("client_id", "flappy")
    assert ban["reason"].startswith("flapping: 3 disconnects") and ban["until"] > 0
    log = gw.log_text()
    # Once per ban (per proxy: each logs the first refusal it gives): not once per refusal.
    assert 1 <= log.count("refused: banned client_id 'flappy'") <= max(1, processes), log
    # Lifting it: refused without the token or with a wrong one.
    assert _http(gw, "DELETE", "/api/bans?client_id=flappy")[0] == 401
    assert _http(gw, "DELETE", "/api/bans?client_id=flappy", token="x" * 32)[0] == 401
    assert _connack(port, "flappy", disconnect=False) == BANNED_V5
    status, _ = _http(gw, "DELETE", "/api/bans?client_id=flappy", token=TOKEN)
    assert status == 200
    assert _http(gw, "GET", "/api/bans")[1] == {"bans": []}
    # Lifted, the count starts afresh: three more disconnects before the next ban.
    for _ in range(3):
        assert _connack(port, "flappy", disconnect=False) == 0
    assert _connack(port, "flappy") == BANNED_V5


def test_flapping_bans_the_address_too(gateway_factory: Factory, token_file: Path) -> None:
    gw = _flapping_gw(gateway_factory, token_file, "--set", "flapping_ban_address=true")
    port = gw.port("mqtt")
    for _ in range(3):
        assert _connack(port, "flappy2") == 0
    assert _connack(port, "someone-else") == BANNED_V5  # same address (127.0.0.1)
    kinds = sorted(b["kind"] for b in _http(gw, "GET", "/api/bans")[1]["bans"])
    assert kinds == ["address", "client_id"]
    assert _http(gw, "DELETE", "/api/bans?address=127.0.0.1", token=TOKEN)[0] == 200
    assert _connack(port, "someone-else") == 0
    assert _connack(port, "flappy2") == BANNED_V5


def test_ban_cli_add_list_remove_and_persist(
    gateway_factory: Factory, token_file: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    gw = gateway_factory(data, "--set", f"http_admin_token_file={token_file}")
    port = gw.port("mqtt")
    refused = _cli(gw, "add", "--client-id", "dev-1")  # no token: 401
    assert refused.returncode == 1 and "401" in refused.stderr, refused
    done = _cli(gw, "add", "--client-id", "dev-1", "--reason", "stolen key",
                "--token-file", str(token_file))  # fmt: skip
    assert done.returncode == 0, done
    assert "banned client_id 'dev-1' until removed" in done.stdout
    assert _connack(port, "dev-1") == BANNED_V5
    assert _connack(port, "dev-2") == 0
    listed = _cli(gw, "list")
    assert listed.returncode == 0 and "'dev-1'" in listed.stdout and "stolen key" in listed.stdout
    # Bans persist across a restart.
    gw.stop()
    gw2 = gateway_factory(data, "--set", f"http_admin_token_file={token_file}")
    assert _connack(gw2.port("mqtt"), "dev-1") == BANNED_V5
    as_json = json.loads(_cli(gw2, "list", "--json").stdout)
    assert [(b["value"], b["reason"]) for b in as_json] == [("dev-1", "stolen key")]
    removed = _cli(gw2, "remove", "--client-id", "dev-1", "--token-file", str(token_file))
    assert removed.returncode == 0, removed
    assert _connack(gw2.port("mqtt"), "dev-1") == 0
    missing = _cli(gw2, "remove", "--client-id", "dev-1", "--token-file", str(token_file))
    assert missing.returncode == 1 and "404" in missing.stderr


def test_timed_ban_ends_by_itself(gateway_factory: Factory, token_file: Path) -> None:
    import time

    gw = gateway_factory(None, "--set", f"http_admin_token_file={token_file}")
    status, ban = _http(gw, "POST", "/api/bans", TOKEN, {"client_id": "brief", "duration_s": 1})
    assert status == 201 and ban["until"] > 0
    assert _connack(gw.port("mqtt"), "brief") == BANNED_V5
    time.sleep(1.2)
    assert _connack(gw.port("mqtt"), "brief") == 0


def test_state_changes_refused_without_a_token_configured(gateway: GatewayProcess) -> None:
    """No `http_admin_token_file`: the HTTP port cannot change state at all (403), whatever
    the request carries; reading the list stays open, like /metrics."""
    assert _http(gateway, "GET", "/api/bans") == (200, {"bans": []})
    status, _ = _http(gateway, "POST", "/api/bans", TOKEN, {"client_id": "x"})
    assert status == 403
    assert _http(gateway, "DELETE", "/api/bans?client_id=x", TOKEN)[0] == 403
    assert _cli(gateway, "add", "--client-id", "x").returncode == 1


def test_bad_ban_requests(gateway_factory: Factory, token_file: Path) -> None:
    gw = gateway_factory(None, "--set", f"http_admin_token_file={token_file}")
    for body in (
        {},
        {"client_id": "a", "address": "1.2.3.4"},
        {"client_id": "a", "duration_s": -1},
    ):
        assert _http(gw, "POST", "/api/bans", TOKEN, body)[0] == 400, body
    assert _http(gw, "DELETE", "/api/bans", TOKEN)[0] == 400
