"""store/bans.py on its own: the sliding window of flapping detection, expiry, persistence, and
mqtt_proxy/connection/limits.py's PublishLimit (messages and bytes, debt, whole chunks)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mqtt_proxy.codec import Publish
from mqtt_proxy.connection.limits import PublishLimit
from store.bans import Ban, BanList, decode_bans, encode_bans


def test_flapping_window_slides() -> None:
    bans = BanList(max_disconnects=3, window_s=10, ban_s=60)
    assert bans.disconnected("a", "10.0.0.1", now=0) is None
    assert bans.disconnected("a", "10.0.0.1", now=5) is None
    # The first disconnect left the window: still two within 10 s.
    assert bans.disconnected("a", "10.0.0.1", now=10.5) is None
    ban = bans.disconnected("a", "10.0.0.1", now=12)
    assert ban is not None and (ban.kind, ban.value, ban.until) == ("client_id", "a", 72)
    assert bans.banned("a", "10.0.0.2", now=20) is ban
    assert bans.banned("b", "10.0.0.1", now=20) is None  # the address was not banned
    assert bans.banned("a", "", now=72) is None  # over, and dropped
    assert bans.in_force(now=72) == []


def test_flapping_off_and_address_bans() -> None:
    off = BanList(max_disconnects=0)
    assert all(off.disconnected("a", "x", now=t) is None for t in range(100))
    both = BanList(max_disconnects=2, window_s=60, ban_s=30, ban_address=True)
    both.disconnected("a", "10.0.0.9", now=0)
    both.disconnected("a", "10.0.0.9", now=1)
    assert sorted(b.kind for b in both.in_force(now=2)) == ["address", "client_id"]
    hit = both.banned("other", "10.0.0.9", now=2)
    assert hit is not None and hit.kind == "address"


def test_first_refusal_once_per_ban() -> None:
    bans = BanList()
    ban = bans.add("client_id", "a", 0)
    assert bans.first_refusal(ban) and not bans.first_refusal(ban)
    bans.remove("client_id", "a")
    again = bans.add("client_id", "a", 0)
    assert bans.first_refusal(again)  # a new ban is logged again


def test_bans_persist_and_expired_ones_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "bans.json"
    bans = BanList(path)
    bans.add("client_id", "forever", 0, "manual")
    bans.add("address", "10.1.1.1", 3600, "timed")
    bans.add("client_id", "gone", 0.001)
    reread = BanList(path)
    # Read as of a moment past the short ban's end (a fast machine rereads within 1 ms).
    kept = {(b.kind, b.value, b.reason) for b in reread.in_force(time.time() + 1)}
    assert kept == {("client_id", "forever", "manual"), ("address", "10.1.1.1", "timed")}
    assert not list(tmp_path.glob("*.tmp"))
    assert reread.remove("client_id", "forever") and not reread.remove("client_id", "forever")
    assert [b.value for b in BanList(path).in_force(time.time() + 1)] == ["10.1.1.1"]


def test_bad_input_is_refused(tmp_path: Path) -> None:
    bans = BanList()
    for kind, value, duration in (("user", "a", 0), ("client_id", "", 0), ("address", "x", -1)):
        with pytest.raises(ValueError):
            bans.add(kind, value, duration)
    bad = tmp_path / "bans.json"
    bad.write_text(json.dumps([{"kind": "nope", "value": "a"}]))
    with pytest.raises(ValueError, match="cannot read the bans"):
        BanList(bad)


def test_mirror_replace_and_wire() -> None:
    core, mirror = BanList(), BanList()
    core.listeners.append(lambda bans: mirror.replace(decode_bans(encode_bans(bans))))
    core.add("client_id", "a", 0)
    assert mirror.banned("a", "") == Ban("client_id", "a", 0.0, "", mirror.in_force()[0].created)
    core.remove("client_id", "a")
    assert mirror.banned("a", "") is None


def _pub(size: int) -> Publish:
    return Publish("t", b"x" * size)


def test_publish_limit_messages_and_bytes() -> None:
    lim = PublishLimit(2, 0, now=0)
    assert lim.take(1, 0) and lim.take(1, 0) and not lim.take(1, 0)
    assert lim.take(1, 0.5)  # one token back after half a second at 2/s
    by = PublishLimit(0, 100, now=0)
    assert by.take(250, 0)  # larger than a second's worth: passes, the bucket owes 150
    assert not by.take(1, 1.0)  # still in debt after 1 s (-150 + 100)
    assert by.take(1, 1.6)
    assert by.wait_for(1, 10, 1.6) > 0


def test_publish_limit_whole_chunks() -> None:
    lim = PublishLimit(10, 1000, now=0)
    assert lim.take_all([_pub(10)] * 8, 0)  # room for all: one batch
    assert not lim.take_all([_pub(10)] * 8, 0)  # two tokens left: packet by packet instead
    assert lim.msgs is not None and lim.msgs.tokens == pytest.approx(2)
    assert lim.holds(10, 1000) and not lim.holds(11, 10) and not lim.holds(2, 1001)
