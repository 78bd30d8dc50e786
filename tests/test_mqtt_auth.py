"""Users and ACLs over MQTT with real clients (mosquitto_pub/sub, paho v3.1.1 and v5) against a real
`lightgate serve` with a `password_file` written by `lightgate passwd` and an `acl_file`.

One gateway serves the module's read-only cases; the reload cases start their own (both shapes).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_process import ROOT, GatewayProcess
from mqtt_helpers import V5, V311, Client, raw, read_packets

MOSQ = shutil.which("mosquitto_pub") is not None
needs_mosquitto = pytest.mark.skipif(not MOSQ, reason="mosquitto clients not installed")

ACL = """\
# no anonymous section: anonymous clients are refused anyway (password_file set, allow_anonymous auto)
user admin
topic readwrite #

user alice
topic readwrite room/#
topic deny room/secret/#
topic read news/#
topic read hist/#
topic deny hist/secret/#

user bob
topic read room/#
topic write room/bob

pattern readwrite dev/%u/%c/#
"""
USERS = {"admin": "adminpw", "alice": "alicepw", "bob": "bobpw"}


def passwd(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightgate", "passwd", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write_users(path: Path, users: dict[str, str]) -> None:
    first = True
    for user, pw in users.items():
        args = ["-c"] if first else []
        assert passwd(*args, "-b", str(path), user, pw).returncode == 0
        first = False


def start(tmp: Path, acl: str = ACL, *args: str) -> GatewayProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    write_users(tmp / "passwords", USERS)
    (tmp / "acl").write_text(acl)
    return GatewayProcess(
        tmp / "data",
        [
            "--kafka-port", "-1", "--ws-port", "-1",
            "--set", f"password_file={tmp / 'passwords'}",
            "--set", f"acl_file={tmp / 'acl'}",
            *args,
        ],
    ).start()  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    g = start(tmp_path_factory.mktemp("auth"))
    yield g
    g.stop()


def code(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


def sub_codes(codes: list[Any]) -> list[int]:
    return [code(c) for c in codes]


def user(gw: GatewayProcess, name: str, cid: str, version: int = V311) -> Client:
    return Client(gw.port("mqtt"), cid, version).connect(username=name, password=USERS[name])


def mosquitto(
    tool: str, port: int, *args: str, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- CONNECT -----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [V311, V5])
def test_connect_refusals_paho(gw: GatewayProcess, version: int) -> None:
    port = gw.port("mqtt")
    cases = [("alice", "wrong", 0x86), ("nobody", "alicepw", 0x86), (None, None, 0x87)]
    for name, pw, want in cases:
        c = Client(port, f"refused-{version}", version)
        c.connect(username=name, password=pw, expect_ok=False)
        # paho reports a v3 CONNACK 0x04 / 0x05 as the v5 codes 0x86 / 0x87.
        assert code(c.connack) == want, (name, c.connack)
        c.paho.loop_stop()
    ok = user(gw, "alice", f"ok-{version}", version)
    ok.disconnect()


@needs_mosquitto
def test_connect_refusals_mosquitto(gw: GatewayProcess) -> None:
    port = gw.port("mqtt")
    args = ["-t", "room/x", "-m", "m", "-q", "1"]
    wrong = mosquitto("mosquitto_pub", port, "-u", "alice", "-P", "nope", *args)
    assert wrong.returncode != 0 and "bad user name or password" in wrong.stderr.lower()  # 0x04
    unknown = mosquitto("mosquitto_pub", port, "-u", "mallory", "-P", "alicepw", *args)
    assert "bad user name or password" in unknown.stderr.lower()
    anon = mosquitto("mosquitto_pub", port, *args)
    assert anon.returncode != 0 and "not authori" in anon.stderr.lower()  # 0x05
    v5 = mosquitto("mosquitto_pub", port, "-V", "5", "-u", "alice", "-P", "nope", *args)
    assert v5.returncode != 0 and "bad user name or password" in v5.stderr.lower()  # 0x86
    ok = mosquitto("mosquitto_pub", port, "-u", "alice", "-P", "alicepw", *args)
    assert ok.returncode == 0, ok.stderr


def _s(text: str) -> bytes:
    return len(text).to_bytes(2, "big") + text.encode()


def test_packets_behind_connect_wait_for_the_password_check(gw: GatewayProcess) -> None:
    """The password is hashed off the event loop: a PUBLISH sent in the same write as CONNECT
    waits for the verdict, then is handled (or dropped with the refused connection)."""
    admin = user(gw, "admin", "pipe-admin", V5)
    admin.subscribe("room/pipe", 1)
    for password, want in (("alicepw", b"\x20\x02\x00\x00"), ("bad", b"\x20\x02\x00\x04")):
        body = b"\x00\x04MQTT\x04\xc2\x00\x3c" + _s("pipe") + _s("alice") + _s(password)
        connect = bytes([0x10, len(body)]) + body
        pub_body = _s("room/pipe") + b"\x00\x01" + password.encode()
        publish = bytes([0x32, len(pub_body)]) + pub_body
        s = raw(gw.port("mqtt"))
        s.sendall(connect + publish)
        if want.endswith(b"\x00"):
            assert read_packets(s, 2) == [want, b"\x40\x02\x00\x01"]  # CONNACK, PUBACK
        else:
            assert read_packets(s, 1) == [want]
            assert s.recv(10) == b""  # closed; the PUBLISH behind it went nowhere
        s.close()
    assert [m.payload for m in admin.expect(1)] == [b"alicepw"]
    admin.expect_none(0.5)
    admin.disconnect()


# -- SUBSCRIBE and PUBLISH -----------------------------------------------------------------------
@pytest.mark.parametrize("version", [V311, V5])
def test_subscribe_by_acl(gw: GatewayProcess, version: int) -> None:
    alice = user(gw, "alice", f"sub-alice-{version}", version)
    no = 0x87 if version == V5 else 0x80
    filters = [
        "room/#",  # overlaps a deny: granted, filtered at delivery
        "room/secret/#",  # entirely under a deny
        "other/#",  # outside every read rule
        "$share/g/room/secret/x",  # a shared subscription is checked on its real filter
        "$replay/-1h/room/secret/#",  # and a replay too
        "$share/g/news/#",
        "$SYS/#",  # no rule grants it
    ]
    got = [sub_codes(alice.subscribe(f, 1))[0] for f in filters]
    assert got == [1, no, no, no, no, 1, no]
    alice.disconnect()


@pytest.mark.parametrize("version", [V311, V5])
def test_publish_without_write_is_dropped(gw: GatewayProcess, version: int) -> None:
    admin = user(gw, "admin", f"pub-admin-{version}", V5)
    admin.subscribe("room/#", 1)
    bob = user(gw, "bob", f"pub-bob-{version}", version)
    reasons: dict[int, int] = {}
    on_publish = bob.paho.on_publish

    def record(c: Any, ud: Any, mid: int, rc: Any = None, props: Any = None) -> None:
        reasons[mid] = code(rc)
        on_publish(c, ud, mid, rc, props)

    bob.paho.on_publish = record
    denied = bob.publish(f"room/d{version}", b"no", 1)  # read-only for bob
    denied2 = bob.publish(f"room/e{version}", b"no2", 2)
    allowed = bob.publish("room/bob", b"yes", 1)
    # v3: acknowledged (0x00) and dropped; v5: 0x87 Not authorized.
    assert reasons[denied] == (0x87 if version == V5 else 0)
    # QoS 2 v5: PUBREC 0x87 ends the exchange; paho sends a PUBREL anyway and reports the
    # PUBCOMP's 0x92 (packet identifier not found). v3: PUBREC, PUBREL, PUBCOMP as usual.
    assert reasons[denied2] == (0x92 if version == V5 else 0)
    assert reasons[allowed] == 0
    assert [(m.topic, m.payload) for m in admin.expect(1)] == [("room/bob", b"yes")]
    admin.expect_none(0.5)
    # Never stored: the log has no trace of it either.
    replay = user(gw, "admin", f"pub-replay-{version}", V5)
    replay.subscribe(f"$replay/-1h/room/d{version}", 1)
    replay.subscribe(f"$replay/-1h/room/e{version}", 1)
    replay.expect_none(0.5)
    for c in (admin, bob, replay):
        c.disconnect()


def test_denied_topics_filtered_live_retained_and_replayed(gw: GatewayProcess) -> None:
    """A granted filter that overlaps a deny: the denied topics never reach the client, whether
    live, retained or replayed from the log (a replay only partly readable included)."""
    admin = user(gw, "admin", "filt-admin", V5)
    admin.publish("hist/open/r", b"retained-ok", 1, retain=True)
    admin.publish("hist/secret/r", b"retained-secret", 1, retain=True)
    admin.publish("hist/open/h", b"history-ok", 1)
    admin.publish("hist/secret/h", b"history-secret", 1)
    v3 = user(gw, "alice", "filt-alice3", V311)
    v5 = user(gw, "alice", "filt-alice5", V5)
    for c in (v3, v5):
        assert sub_codes(c.subscribe("hist/#", 1)) == [1]
        assert [m.payload for m in c.expect(1)] == [b"retained-ok"]
        c.expect_none(0.3)
    replay = user(gw, "alice", "filt-replay", V5)
    assert sub_codes(replay.subscribe("$replay/-1h/hist/#", 1)) == [1]
    got = sorted(m.payload for m in replay.expect(2))
    assert got == [b"history-ok", b"retained-ok"]
    replay.expect_none(0.3)
    for i in range(3):
        admin.publish(f"hist/secret/live{i}", b"live-secret", 1)
        admin.publish(f"hist/open/live{i}", f"live-{i}".encode(), 0)
    for c in (v3, v5, replay):
        assert [m.payload for m in c.expect(3)] == [b"live-0", b"live-1", b"live-2"]
        c.expect_none(0.3)
    for c in (admin, v3, v5, replay):
        c.disconnect()


def test_shared_group_skips_what_no_member_may_read(gw: GatewayProcess) -> None:
    """`$share/g/hist/#` overlaps a deny: the group hands out the readable messages and passes
    over the denied ones (no member may read them) instead of stalling on them."""
    admin = user(gw, "admin", "sh-admin", V5)
    members = [user(gw, "alice", f"sh-{i}", V5) for i in range(2)]
    for m in members:
        assert sub_codes(m.subscribe("$share/g/hist/#", 1)) == [1]
    for i in range(4):
        admin.publish(f"hist/secret/s{i}", b"secret", 1)
        admin.publish(f"hist/open/s{i}", f"open-{i}".encode(), 1)
    got: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(got) < 4 and time.monotonic() < deadline:
        for m in members:
            while not m.messages.empty():
                got.append(m.messages.get().payload)
        time.sleep(0.05)
    assert sorted(got) == [b"open-0", b"open-1", b"open-2", b"open-3"]
    for m in members:
        m.expect_none(0.3)
    for c in (admin, *members):
        c.disconnect()


@needs_mosquitto
def test_patterns_with_mosquitto_clients(gw: GatewayProcess) -> None:
    """`pattern readwrite dev/%u/%c/#`: each device writes and reads its own branch only."""
    port = gw.port("mqtt")
    bob = ["-u", "bob", "-P", "bobpw"]

    def sub(creds: list[str], cid: str, n: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), *creds, "-i", cid,
             "-t", "dev/#" if cid == "watch" else f"dev/bob/{cid}/#", "-q", "1", "-v",
             "-C", str(n), "-W", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    own = sub(bob, "dev1", 1)
    watch = sub(["-u", "admin", "-P", "adminpw"], "watch", 2)
    time.sleep(1.5)
    for creds, cid in ((bob, "dev2"), (["-u", "alice", "-P", "alicepw"], "dev4")):
        other = mosquitto("mosquitto_sub", port, *creds, "-i", cid, "-t", "dev/bob/dev1/#",
                          "-C", "1", "-W", "3")  # fmt: skip
        assert "denied" in (other.stdout + other.stderr).lower(), (cid, other)
    spoof = mosquitto("mosquitto_pub", port, *bob, "-i", "dev2", "-t", "dev/bob/dev1/x",
                      "-m", "spoof", "-q", "1")  # fmt: skip
    assert spoof.returncode == 0  # v3: acknowledged and dropped
    mine = mosquitto("mosquitto_pub", port, *bob, "-i", "dev3", "-t", "dev/bob/dev3/t",
                     "-m", "own", "-q", "1")  # fmt: skip
    assert mine.returncode == 0, mine.stderr
    admin = mosquitto("mosquitto_pub", port, "-u", "admin", "-P", "adminpw", "-t",
                      "dev/bob/dev1/t", "-m", "mine", "-q", "1")  # fmt: skip
    assert admin.returncode == 0, admin.stderr
    assert own.communicate(timeout=30)[0].strip() == "dev/bob/dev1/t mine"
    assert watch.communicate(timeout=30)[0].split("\n")[:2] == [
        "dev/bob/dev3/t own",
        "dev/bob/dev1/t mine",
    ]


# -- reload -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["serve", "split"])
def test_sighup_reload_keeps_connections(tmp_path: Path, shape: str) -> None:
    args = ["--set", "mqtt_processes=1"] if shape == "split" else []
    g = start(tmp_path, ACL, *args)
    try:
        port = g.port("mqtt")
        admin = user(g, "admin", "rl-admin", V5)
        bob = user(g, "bob", "rl-bob", V5)
        assert sub_codes(bob.subscribe("room/#", 1)) == [1]
        assert sub_codes(bob.subscribe("news/#", 1)) == [0x87]
        admin.publish("room/secret/a", b"before", 1)
        assert [m.payload for m in bob.expect(1)] == [b"before"]
        # New rules: bob loses room/secret, gains news and write on room/x; alice is removed.
        acl = ACL.replace(
            "user bob\n", "user bob\ntopic deny room/secret/#\ntopic readwrite news/#\n"
        )
        acl = acl.replace("topic write room/bob", "topic write room/x")
        (tmp_path / "acl").write_text(acl)
        write_users(tmp_path / "passwords", {k: v for k, v in USERS.items() if k != "alice"})
        g.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while sub_codes(bob.subscribe("news/#", 1)) != [1]:
            assert time.monotonic() < deadline, "the reload never took effect"
            time.sleep(0.2)
        admin.publish("room/secret/a", b"after", 1)  # bob's open subscription now filters it
        admin.publish("news/n", b"news", 1)
        bob.publish("room/x", b"from-bob", 1)
        assert sorted(m.payload for m in bob.expect(2)) == [b"from-bob", b"news"]
        bob.expect_none(0.5)
        assert not bob.disconnected.is_set() and not admin.disconnected.is_set()
        gone = Client(port, "rl-alice").connect(
            username="alice", password="alicepw", expect_ok=False
        )
        assert code(gone.connack) == 0x86
        gone.paho.loop_stop()
        # A file that does not parse: refused with path:line, the current rules stay.
        (tmp_path / "acl").write_text(acl + "topic wrte room/#\n")
        g.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        bad_line = f"{tmp_path / 'acl'}:{acl.count(chr(10)) + 1}: unknown access 'wrte'"
        deadline = time.monotonic() + 20
        while bad_line not in g.log_text():
            assert time.monotonic() < deadline, g.log_text()[-2000:]
            time.sleep(0.2)
        bob.publish("room/x", b"still", 1)
        assert [m.payload for m in bob.expect(1)] == [b"still"]
        assert g.proc.poll() is None  # type: ignore[union-attr]
        for c in (admin, bob):
            c.disconnect()
    finally:
        g.stop()


# -- the anonymous default ------------------------------------------------------------------------
def test_non_loopback_gateway_refuses_anonymous(tmp_path: Path) -> None:
    """`host = 0.0.0.0` and no password_file: allow_anonymous (auto) is false."""
    g = GatewayProcess(
        tmp_path / "data", ["--host", "0.0.0.0", "--kafka-port", "-1", "--ws-port", "-1"]
    ).start()
    try:
        c = Client(g.port("mqtt"), "anon", V5).connect(expect_ok=False)
        assert code(c.connack) == 0x87
        c.paho.loop_stop()
        if MOSQ:
            r = mosquitto("mosquitto_pub", g.port("mqtt"), "-t", "t", "-m", "m")
            assert r.returncode != 0 and "not authori" in r.stderr.lower()
    finally:
        g.stop()


# -- lightgate passwd -----------------------------------------------------------------------------
def test_passwd_cli(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    assert passwd("-b", str(path), "a", "x").returncode == 1  # no -c: the file must exist
    assert passwd("-c", "-b", str(path), "alice", "one").returncode == 0
    assert passwd("-b", "-I", "5000", str(path), "bob", "two").returncode == 0
    prompted = passwd(str(path), "carol", stdin="three\nthree\n")  # getpass falls back to stdin
    assert prompted.returncode == 0, prompted.stderr
    mismatch = passwd(str(path), "dave", stdin="four\nfive\n")
    assert mismatch.returncode == 1 and "do not match" in mismatch.stderr
    assert passwd("-D", str(path), "alice").returncode == 0
    assert passwd("-D", str(path), "alice").returncode == 1
    assert passwd("-c", "-D", str(path), "bob").returncode == 1
    lines = path.read_text().splitlines()
    assert [line.split(":")[0] for line in lines] == ["bob", "carol"]
    assert lines[0].startswith("bob:$7$5000$") and lines[1].startswith("carol:$7$4096$")
    if shutil.which("mosquitto"):  # Mosquitto itself takes the file
        conf = tmp_path / "mosquitto.conf"
        conf.write_text(
            f"listener 0 127.0.0.1\npassword_file {path}\nallow_anonymous false\nuser root\n"
        )
        _mosquitto_accepts(conf, path)


def _mosquitto_accepts(conf: Path, path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf.write_text(conf.read_text().replace("listener 0 ", f"listener {port} "))
    broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            r = mosquitto("mosquitto_pub", port, "-u", "carol", "-P", "three", "-t", "t", "-m", "m")
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.returncode == 0, r.stderr
        bad = mosquitto("mosquitto_pub", port, "-u", "carol", "-P", "four", "-t", "t", "-m", "m")
        assert bad.returncode != 0
    finally:
        broker.terminate()
        broker.wait(10)


def test_serve_refuses_a_bad_acl_file(tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    acl.write_text("user alice\ntopic wrte room/#\n")
    proc = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(tmp_path / "data"),
         "--mqtt-port", "0", "--ws-port", "-1", "--kafka-port", "-1", "--http-port", "-1",
         "--set", f"acl_file={acl}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"lightgate: {acl}:2: unknown access 'wrte'" in proc.stderr
