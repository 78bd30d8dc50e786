"""store.auth: password files (mosquitto_passwd interop both ways), the ACL parser and its topic algebra.

Pure tests (no gateway); `mosquitto_passwd` writes and checks files when it is installed.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.auth import Acl, AuthFileError, ConnectVerdict, PasswordFile, Security
from store.auth.acl import covers, intersect, matches

MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")


# -- password files --------------------------------------------------------------------------------
def test_roundtrip_and_scram(tmp_path: Path) -> None:
    pw = PasswordFile()
    pw.set("alice", "s3cret")
    pw.set("bob", "other", iterations=5000)
    path = tmp_path / "pw"
    pw.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    back = PasswordFile.load(path)
    assert back.users == ["alice", "bob"]
    assert back.check("alice", "s3cret") and not back.check("alice", "s3cre")
    assert not back.check("carol", "s3cret")
    salt, iterations, salted = back.scram_sha512("bob")  # type: ignore[misc]
    assert iterations == 5000
    assert salted == hashlib.pbkdf2_hmac("sha512", b"other", salt, 5000, 64)  # SCRAM's Hi()
    assert back.scram_sha512("nobody") is None
    assert back.scram_sha512("alice")[1] == 4096  # type: ignore[index]  # Java clients need >= 4096
    assert back.delete("alice") and not back.delete("alice")
    assert back.users == ["bob"]


@pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd not installed")
def test_mosquitto_passwd_files_load(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    run = [MOSQUITTO_PASSWD]
    subprocess.run([*run, "-c", "-b", str(path), "alice", "apw"], check=True)  # $7$, 101 rounds
    subprocess.run([*run, "-H", "sha512", "-b", str(path), "old", "opw"], check=True)  # $6$
    pw = PasswordFile.load(path)
    assert pw.check("alice", "apw") and not pw.check("alice", "x")
    assert pw.check("old", "opw") and not pw.check("old", "apw")
    assert pw.scram_sha512("alice")[1] == 101  # type: ignore[index]
    assert pw.scram_sha512("old") is None  # salted SHA-512 is no SCRAM salted password


@pytest.mark.skipif(MOSQUITTO_PASSWD is None, reason="mosquitto_passwd not installed")
def test_our_files_edited_by_mosquitto_passwd(tmp_path: Path) -> None:
    """mosquitto_passwd reads (and keeps) our entries: it rewrites the file with one user more."""
    path = tmp_path / "pw"
    pw = PasswordFile()
    pw.set("ours", "opw")
    pw.save(path)
    subprocess.run([MOSQUITTO_PASSWD, "-b", str(path), "theirs", "tpw"], check=True)
    back = PasswordFile.load(path)
    assert back.check("ours", "opw") and back.check("theirs", "tpw")


def test_bad_password_files(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    cases = {
        "alice:plaintext\n": "not a $7$ or $6$",
        "# comment\n\nalice\n": "expected user:hash",
        "a:$7$x$AAAA$AAAA\n": "bad iteration count",
        "a:$7$10$!!!$AAAA\n": "bad base64 salt",
    }
    for text, what in cases.items():
        path.write_text(text)
        with pytest.raises(AuthFileError) as err:
            PasswordFile.load(path)
        assert str(err.value).startswith(f"{path}:{text.count(chr(10))}:"), err.value
        assert what in str(err.value)
    with pytest.raises(AuthFileError, match="cannot read"):
        PasswordFile.load(tmp_path / "missing")


def test_missing_user_costs_a_hash() -> None:
    """A user not in the file costs one derivation, like a wrong password (no user oracle)."""
    pw = PasswordFile()
    pw.set("alice", "right", iterations=20000)  # slow enough to measure on a busy machine
    pw.set("bob", "x", iterations=20000)

    def timed(user: str) -> float:
        runs = []
        for _ in range(9):
            t = time.perf_counter()
            pw.check(user, "wrong")
            runs.append(time.perf_counter() - t)
        return min(runs)  # the least disturbed run: other processes share the machine

    wrong, missing = timed("alice"), timed("nobody")
    assert 0.4 < missing / wrong < 2.5, (wrong, missing)


def test_security_verdicts(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    pw = PasswordFile()
    pw.set("dev", "pw")
    pw.save(path)
    sec = Security.load(password_file=str(path), allow_anonymous=False)
    assert sec.check_connect("dev", b"pw") is ConnectVerdict.OK
    assert sec.check_connect("dev", b"no") is ConnectVerdict.BAD_CREDENTIALS
    assert sec.check_connect("dev", None) is ConnectVerdict.BAD_CREDENTIALS
    assert sec.check_connect("who", b"pw") is ConnectVerdict.BAD_CREDENTIALS
    assert sec.check_connect(None, None) is ConnectVerdict.NOT_AUTHORIZED
    # No password file: Mosquitto's rule, a user name is a label, taken only when anonymous is on.
    assert Security(allow_anonymous=True).check_connect("x", None) is ConnectVerdict.OK
    assert Security(allow_anonymous=False).check_connect("x", b"y") is ConnectVerdict.NOT_AUTHORIZED


def test_reload_is_all_or_nothing(tmp_path: Path) -> None:
    pwpath, aclpath = tmp_path / "pw", tmp_path / "acl"
    pw = PasswordFile()
    pw.set("a", "1")
    pw.save(pwpath)
    aclpath.write_text("user a\ntopic read x/#\n")
    sec = Security.load(password_file=str(pwpath), acl_file=str(aclpath))
    seen: list[int] = []
    sec.on_reload(lambda: seen.append(sec.generation))
    aclpath.write_text("user a\ntopic write x/#\n")
    assert sec.reload() == [] and seen == [1]
    assert sec.acl.can_write("x/1", "a", "c")
    aclpath.write_text("user a\ntopic wrte x/#\n")
    pw.set("b", "2")
    pw.save(pwpath)
    errors = sec.reload()
    assert errors == [f"{aclpath}:2: unknown access 'wrte' (read, write, readwrite or deny)"]
    assert sec.acl.can_write("x/1", "a", "c") and "b" not in sec.passwords  # type: ignore[operator]
    assert seen == [1]


# -- ACL syntax and semantics ----------------------------------------------------------------------
ACL = """
# anonymous clients
topic read public/#
topic status

user alice
topic readwrite alice/#
topic deny alice/private/#
topic write shared/in
user bob smith
topic read shared/#

pattern readwrite devices/%c/#
pattern read users/%u/#
pattern deny shared/secret
"""


def test_acl_semantics() -> None:
    acl = Acl.parse(ACL)
    anon, alice, bob = (None, "c0"), ("alice", "c1"), ("bob smith", "c2")
    assert acl.can_read("public/x", *anon) and not acl.can_write("public/x", *anon)
    assert acl.can_read("status", *anon) and acl.can_write("status", *anon)  # no word: readwrite
    assert not acl.can_read("public/x", *alice)  # the anonymous section is not for users
    assert acl.can_write("alice/a/b", *alice) and acl.can_read("alice", *alice)
    assert not acl.can_read("alice/private/k", *alice)  # deny wins over the earlier allow
    assert acl.can_write("shared/in", *alice) and not acl.can_read("shared/in", *alice)
    assert acl.can_read("shared/x", *bob)  # a user name with a space: the rest of the line
    assert not acl.can_read("shared/secret", *bob)  # a deny pattern applies to everyone
    # Patterns: %c and %u, for every client; %u never for anonymous ones.
    assert acl.can_write("devices/c0/t", *anon) and not acl.can_write("devices/c1/t", *anon)
    assert acl.can_read("users/alice/inbox", *alice) and not acl.can_read("users/bob/x", *alice)
    assert not acl.can_read("users//x", None, "c0")
    # A client id with a wildcard or a slash cannot widen its own pattern.
    assert not acl.can_write("devices/a/b/t", None, "a/b")
    assert not acl.can_write("devices/x/t", None, "+")
    # `$` topics only through rules that start with `$`.
    assert not Acl.parse("topic #\n").can_read("$SYS/x", None, "c")
    assert Acl.parse("topic read $SYS/#\n").can_read("$SYS/x", None, "c")


def test_acl_subscribe_and_subtree() -> None:
    acl = Acl.parse(ACL)
    alice = ("alice", "c1")
    assert acl.can_subscribe("alice/#", *alice)  # overlaps a deny: granted, filtered at delivery
    assert acl.can_subscribe("#", *alice)  # some topics under it are readable
    assert not acl.can_subscribe("alice/private/#", *alice)  # entirely under a deny
    assert not acl.can_subscribe("alice/private/+/x", *alice)
    assert not acl.can_subscribe("other/#", *alice)  # outside every read rule
    assert not acl.can_subscribe("shared/in", *alice)  # write-only
    assert acl.can_subscribe("+/c1/#", *alice)  # reaches devices/c1/... through the pattern
    # covers_subtree: every topic at or under the prefix (Kafka log topics).
    assert acl.covers_subtree("devices/c1", "write", *alice)
    assert acl.covers_subtree("alice/public", "read", *alice)
    assert not acl.covers_subtree("alice", "read", *alice)  # alice/private is denied
    assert not acl.covers_subtree("shared", "read", "bob smith", "c2")  # shared/secret denied
    assert not acl.covers_subtree("public", "write", None, "c")
    assert Acl.allow_all().covers_subtree("anything", "write", None, "c")


def test_acl_parse_errors() -> None:
    bad = {
        "topic wrte a/b": "unknown access 'wrte'",
        "topic read": "invalid topic filter 'read'",  # one word is a topic; "read" is valid...
        "topic read a/#/b": "invalid topic filter 'a/#/b'",
        "topic read a+": "invalid topic filter 'a+'",
        "user": "missing user name",
        "topc read a": "unknown keyword 'topc'",
    }
    for line, what in bad.items():
        if line == "topic read":
            assert Acl.parse(line).can_read("read", None, "c")  # Mosquitto: topic "read", rw
            continue
        with pytest.raises(AuthFileError) as err:
            Acl.parse(f"# header\n{line}\n", "acl.conf")
        assert str(err.value).startswith("acl.conf:2: ") and what in str(err.value), err.value


# -- the topic algebra against brute force ---------------------------------------------------------
LEVELS = ["a", "b", "$x"]
UNIVERSE = [t for n in range(1, 5) for t in itertools.product(["a", "b", "c", "$x"], repeat=n)]
filters = st.lists(st.sampled_from([*LEVELS, "+"]), min_size=0, max_size=3).flatmap(
    lambda head: st.sampled_from([(*head, "#"), tuple(head)] if head else [("#",)])
)


@settings(max_examples=400, deadline=None)
@given(filters, filters)
def test_intersect_and_covers_are_exact(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    both = [t for t in UNIVERSE if matches(a, t) and matches(b, t)]
    i = intersect(a, b)
    if i is None:
        assert both == []
    else:
        assert [t for t in UNIVERSE if matches(i, t)] == both
    in_b = [t for t in UNIVERSE if matches(b, t)]
    assert covers(a, b) == all(matches(a, t) for t in in_b)


@settings(max_examples=200, deadline=None)
@given(st.lists(filters, min_size=1, max_size=3), st.lists(filters, max_size=2), filters)
def test_subscribe_never_refuses_a_readable_filter(
    reads: list[tuple[str, ...]], denies: list[tuple[str, ...]], sub: tuple[str, ...]
) -> None:
    """can_subscribe is refused only when no topic the filter matches is readable."""
    text = "".join(f"topic read {'/'.join(r)}\n" for r in reads)
    text += "".join(f"topic deny {'/'.join(d)}\n" for d in denies)
    acl = Acl.parse(text)
    readable = [t for t in UNIVERSE if matches(sub, t) and acl.can_read("/".join(t), None, "c")]
    if readable:
        assert acl.can_subscribe("/".join(sub), None, "c")
    if acl.for_client(None, "c").reads_all("/".join(sub)):
        assert all(acl.can_read("/".join(t), None, "c") for t in UNIVERSE if matches(sub, t))


# -- configuration ---------------------------------------------------------------------------------
def test_allow_anonymous_tri_state(tmp_path: Path) -> None:
    from lightgate.config import ConfigError
    from lightgate.config_load import load_config
    from lightgate.security import allow_anonymous, build_security

    toml = tmp_path / "gw.toml"
    toml.write_text("allow_anonymous = true\n")  # a TOML boolean is taken
    assert load_config(toml, env={}).allow_anonymous == "true"
    assert load_config(env={"LIGHTGATE_ALLOW_ANONYMOUS": "0"}).allow_anonymous == "false"
    with pytest.raises(ConfigError, match="allow_anonymous"):
        load_config(env={}, overrides={"allow_anonymous": "maybe"})
    auto = load_config(env={})
    assert auto.allow_anonymous == "auto" and allow_anonymous(auto)  # 127.0.0.1, no users
    assert allow_anonymous(load_config(env={}, overrides={"host": "localhost"}))
    assert not allow_anonymous(load_config(env={}, overrides={"host": "0.0.0.0"}))
    pw = tmp_path / "pw"
    PasswordFile().save(pw)
    with_users = load_config(env={}, overrides={"password_file": str(pw)})
    assert not allow_anonymous(with_users)
    forced = load_config(env={}, overrides={"host": "0.0.0.0", "allow_anonymous": "true"})
    assert allow_anonymous(forced)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(env={}, overrides={"acl_file": str(tmp_path / "missing")})
    bad = tmp_path / "acl"
    bad.write_text("user a\ntopic wrte x\n")
    with pytest.raises(ConfigError, match=f"{bad}:2: unknown access 'wrte'"):
        build_security(load_config(env={}, overrides={"acl_file": str(bad)}))
