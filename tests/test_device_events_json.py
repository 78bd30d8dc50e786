"""The device event's value is what `json.dumps` of its dict writes, byte for byte (the
hand-written formatter skips building the dict on the connect path)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mqtt_proxy.device_events import event_json


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["connect", "disconnect"]),
    st.text(),
    st.integers(0, 2**53),
    st.text(),
    st.text(),
)
def test_event_json_is_json_dumps(event: str, cid: str, ts: int, reason: str, remote: str) -> None:
    want = {"event": event, "client_id": cid, "ts": ts, "reason": reason, "remote": remote}
    got = event_json(event, cid, ts, reason, remote)
    assert got == json.dumps(want, separators=(",", ":")).encode()
    assert json.loads(got) == want
