"""Codec, sessions and retained messages on a real LevelDB."""

from __future__ import annotations

import json
import random
from pathlib import Path

import plyvel
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue import codec
from lightqueue.retained import RetainedStore
from lightqueue.session_store import SessionStore
from lightqueue.topic_trie import topic_matches
from store.mapping import MqttProperties

JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(JSONISH)
def test_codec_round_trip(v: object) -> None:
    assert codec.decode(codec.encode(v)) == v


def test_codec_rejects_unknown_format() -> None:
    with pytest.raises(codec.CodecError):
        codec.decode(b"\x09\x00")
    with pytest.raises(codec.CodecError):
        codec.decode(codec.encode("abc")[:-1])


@pytest.fixture
def db(tmp_path: Path) -> plyvel.DB:
    d = plyvel.DB(str(tmp_path / "lq"), create_if_missing=True)
    yield d
    d.close()


def session_state(cid: str) -> dict[str, object]:
    return {
        "client_id": cid,
        "expiry": 3600,
        "version": 5,
        "disconnected_at": 1764000000.25,
        "next_pid": 17,
        "qos2_in": [3, 9],
        "subs": [
            {"raw": "a/+/t", "filter": "a/+/t", "group": None, "qos": 1, "nl": False,
             "rap": True, "rh": 0, "sid": 7, "pos": 12345, "local": False},
            {"raw": "$share/g/b/#", "filter": "b/#", "group": "g", "qos": 2, "nl": False,
             "rap": False, "rh": 2, "sid": None, "pos": 0, "local": False},
        ],
        "inflight": [[5, "a/+/t", 12345, 1, b"\x32\x0a", False, "a/+/t"],
                     [6, "b/#", 2, 2, b"\x34\x0b", True, "$share/g/b/#"]],
        "will": {"topic": "w/" + cid, "payload": b"bye\x00", "qos": 1, "retain": True,
                 "delay": 5, "props": {"content_type": "text/plain"}},
    }  # fmt: skip


def test_sessions_round_trip_and_restart(tmp_path: Path) -> None:
    path = str(tmp_path / "lq")
    d = plyvel.DB(path, create_if_missing=True)
    s = SessionStore(d)
    s.put("c1", session_state("c1"))
    s.put_many([(f"c{i}", session_state(f"c{i}")) for i in range(2, 50)])
    s.delete("c7")
    assert s.get("c7") is None
    assert s.get("c1") == session_state("c1")
    s.flush()
    d.close()
    d = plyvel.DB(path)
    s = SessionStore(d)
    states = {st_["client_id"]: st_ for st_ in s.load_all()}
    assert set(states) == {f"c{i}" for i in range(1, 50)} - {"c7"}
    assert states["c42"] == session_state("c42")
    # Compact: a realistic session is well under its JSON size with payloads hex-encoded.
    enc = len(codec.encode(session_state("c1")))
    as_json = json.dumps(session_state("c1"), default=lambda b: b.hex())
    assert enc < len(as_json)
    d.close()


def test_retained_set_get_delete(db: plyvel.DB) -> None:
    r = RetainedStore(db)
    props = MqttProperties(content_type="x", user_properties=(("k", "v"),))
    r.set("a/b", b"1", 1, "c1", props, 1000, ("a", 0, 5))
    m = r.get("a/b", now_ms=2000)
    assert m is not None and m.payload == b"1" and m.retain and m.properties == props
    assert (m.log_topic, m.partition, m.offset) == ("a", 0, 5)
    r.set("a/b", b"", 0)  # empty payload clears
    assert r.get("a/b") is None


def test_retained_expiry(db: plyvel.DB) -> None:
    r = RetainedStore(db)
    r.set("e/1", b"x", 0, properties=MqttProperties(message_expiry=10), timestamp_ms=1000)
    assert r.match("e/#", now_ms=5000)
    assert r.match("e/#", now_ms=11_000) == []
    assert r.get("e/1") is None  # deleted on the expired lookup


def test_retained_wildcard_lookup_matches_brute_force(db: plyvel.DB) -> None:
    r = RetainedStore(db)
    rnd = random.Random(7)
    words = ["a", "b", "c", "", "$SYS", "dd", "a\x01", "ab"]
    topics = {"/".join(rnd.choice(words) for _ in range(rnd.randint(1, 4))) for _ in range(400)}
    topics = {t for t in topics if t}
    for t in topics:
        r.set(t, t.encode() or b"-", 0)
    filts = [
        "#",
        "+",
        "+/+",
        "a/#",
        "+/b/#",
        "$SYS/#",
        "+/+/+/+",
        "/#",
        "a/+",
        "ab/+/c",
        "a\x01/#",
        "",
        "a/b/c/dd",
    ]
    for f in filts:
        if not f:
            continue
        got = sorted(m.topic for m in r.match(f))
        assert got == sorted(t for t in topics if topic_matches(f, t)), f


def test_retained_pages_resume_where_they_stopped(db: plyvel.DB) -> None:
    """Read page by page (each resuming after the previous cursor), every filter yields exactly
    what one whole lookup yields, in key order, and the last page says there is no more."""
    r = RetainedStore(db)
    rnd = random.Random(11)
    words = ["a", "b", "c", "", "$SYS", "dd", "a\x01", "ab"]
    topics = {"/".join(rnd.choice(words) for _ in range(rnd.randint(1, 4))) for _ in range(400)}
    for t in topics - {""}:
        r.set(t, b"x", 0)
    for f in ["#", "+", "+/+", "a/#", "+/b/#", "$SYS/#", "+/+/+/+", "/#", "a/+", "+/a/+"]:
        whole = [m.topic for m in r.match(f)]
        for limit in (1, 3, 7, 50):
            paged: list[str] = []
            after = None
            pages = 0
            while True:
                msgs, after = r.page(f, after, limit)
                assert len(msgs) <= limit
                paged += [m.topic for m in msgs]
                pages += 1
                if after is None:
                    break
                assert msgs, (f, limit)  # a page that says "more" carries something
            assert paged == whole, (f, limit)
            assert pages >= len(whole) // limit


def test_retained_lookup_does_not_scan(db: plyvel.DB) -> None:
    r = RetainedStore(db)
    for i in range(2000):
        r.set(f"plant{i}/line/temp", b"1", 0)
        r.set(f"plant{i}/line/hum", b"1", 0)
    r.set("plant7/line/temp/x", b"1", 0)
    assert [m.topic for m in r.match("plant7/+/temp")] == ["plant7/line/temp"]
    assert r.count_keys_visited("plant7/+/temp") < 10
    # `+` at level 0 visits each first level once (seek past its subtree), not each topic.
    got = r.match("+/line/hum")
    assert len(got) == 2000
    assert r.count_keys_visited("+/line/hum") < 2000 * 3


async def test_bridge_positions_are_state_kept_by_rebuild(tmp_path: Path) -> None:
    """A bridge's committed positions live under their own prefix (not among the sessions the
    proxy restores) and `rebuild_queues` copies them, as it copies sessions."""
    from lightqueue_helpers import open_all

    from lightqueue.rebuild import rebuild_queues

    data = tmp_path / "data"
    store, lq = await open_all(data)
    lq.bridges.put_many("centre", [("sensors/#", 42), ("cmd/a", 7)])
    lq.bridges.put_many("other", [("sensors/#", 3)])
    lq.sessions.put("c1", {"client_id": "c1"})
    assert [s["client_id"] for s in lq.sessions.load_all()] == ["c1"]
    lq.bridges.forget("other")
    await lq.close()
    await store.close()
    await rebuild_queues(data, store_config=None)
    store, lq = await open_all(data)
    assert lq.bridges.get("centre", "sensors/#") == 42
    assert lq.bridges.get("centre", "cmd/a") == 7
    assert lq.bridges.get("other", "sensors/#") is None
    assert lq.bridges.get("centre", "unknown") is None
    await lq.close()
    await store.close()
