"""Kafka listener state under DATA/kafka/: committed offsets and idempotent-producer state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from store.kafka import offsets as offsets_mod
from store.kafka.offsets import CommittedOffset, OffsetStore
from store.kafka.producers import ProducerStateManager
from store.record_batch import build_batch, parse_header

OUT_OF_ORDER, INVALID_EPOCH = 45, 47


async def test_offsets_survive_reopen_torn_tail_and_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(offsets_mod, "_COMPACT_LINES", 5)
    s = OffsetStore(tmp_path)
    await s.commit("g", [("t", 0, CommittedOffset(10, -1, "m"))])
    await s.commit(
        "g", [("t", 0, CommittedOffset(11, 3, None)), ("t", 1, CommittedOffset(7, -1, ""))]
    )
    s._fd, fd = -1, s._fd  # simulate a crash: no close(), no compaction
    os.write(fd, b'["g", "t", 0, 99')  # a torn line
    os.close(fd)
    s2 = OffsetStore(tmp_path)
    assert s2.get("g", "t", 0) == CommittedOffset(11, 3, None)
    assert s2.partitions("g") == {
        ("t", 0): CommittedOffset(11, 3, None),
        ("t", 1): CommittedOffset(7, -1, ""),
    }
    for i in range(6):  # crosses the compaction threshold
        await s2.commit("h", [("t", 0, CommittedOffset(i, -1, None))])
    assert (tmp_path / "offsets.journal").stat().st_size < 100
    s2.close()
    s3 = OffsetStore(tmp_path)
    assert s3.get("h", "t", 0) == CommittedOffset(5, -1, None) and s3.groups() == {"g", "h"}
    s3.close()


def batch(pid: int, epoch: int, seq: int, n: int = 1, base: int = 0) -> bytes:
    recs = [(1000, None, b"v", [])] * n
    return bytes(build_batch(recs, base, producer_id=pid, producer_epoch=epoch, base_sequence=seq))


def test_sequence_rules_and_duplicate_window(tmp_path: Path) -> None:
    m = ProducerStateManager(tmp_path)
    pid = m.new_producer_id()
    offset = 0
    for seq in range(0, 12, 2):  # six batches of two records
        h = parse_header(batch(pid, 0, seq, 2))
        assert m.check("t", 0, h) == (0, None)
        m.record("t", 0, h, offset)
        offset += 2
    assert m.check("t", 0, parse_header(batch(pid, 0, 10, 2)))[1] == 10  # last: duplicate
    assert m.check("t", 0, parse_header(batch(pid, 0, 2, 2)))[1] == 2  # 5th from last
    assert m.check("t", 0, parse_header(batch(pid, 0, 0, 2)))[0] == OUT_OF_ORDER  # evicted
    assert m.check("t", 0, parse_header(batch(pid, 0, 13, 1)))[0] == OUT_OF_ORDER  # gap
    assert m.check("t", 0, parse_header(batch(pid, 1, 5, 1)))[0] == OUT_OF_ORDER  # new epoch
    assert m.check("t", 0, parse_header(batch(pid, 1, 0, 1))) == (0, None)
    m.record("t", 0, parse_header(batch(pid, 1, 0, 1)), offset)
    assert m.check("t", 0, parse_header(batch(pid, 0, 12, 1)))[0] == INVALID_EPOCH
    assert m.check("t", 0, parse_header(batch(999, 0, 77, 1))) == (0, None)  # unknown: any seq
    assert m.check("t", 0, parse_header(batch(-1, -1, -1, 1))) == (0, None)  # not idempotent


def test_sequence_wraps_at_int32_max(tmp_path: Path) -> None:
    m = ProducerStateManager(tmp_path)
    h = parse_header(batch(5, 0, 2**31 - 2, 2))
    m.record("t", 0, h, 0)
    assert m.check("t", 0, parse_header(batch(5, 0, 0, 1))) == (0, None)
    assert m.check("t", 0, parse_header(batch(5, 0, 1, 1)))[0] == OUT_OF_ORDER


def test_recover_drops_state_past_a_shorter_log_and_never_reissues_ids(tmp_path: Path) -> None:
    m = ProducerStateManager(tmp_path)
    pid = m.new_producer_id()
    log = [batch(pid, 0, 0, 1, base=0), batch(pid, 0, 1, 1, base=1)]
    for i, b in enumerate(log):
        m.record("t", 0, parse_header(b), i)
    m.record("t", 0, parse_header(batch(pid, 0, 2, 1)), 2)  # appended, then lost in a crash
    m.snapshot()

    m2 = ProducerStateManager(tmp_path)
    data = b"".join(log)
    n = m2.recover({"t": 1}, lambda t, p: 2, lambda t, p: 0, lambda t, p, o, mb: data)
    assert n == 0  # the snapshot already covered the log; nothing to replay
    # the lost batch is not a duplicate: its retry is stored again
    assert m2.check("t", 0, parse_header(batch(pid, 0, 2, 1))) == (0, None)
    assert m2.check("t", 0, parse_header(batch(pid, 0, 1, 1)))[1] == 1
    assert m2.new_producer_id() > pid

    (tmp_path / "producers.json").unlink()
    m3 = ProducerStateManager(tmp_path)  # no snapshot: everything from the log
    assert m3.recover({"t": 1}, lambda t, p: 2, lambda t, p: 0, lambda t, p, o, mb: data) == 2
    assert m3.check("t", 0, parse_header(batch(pid, 0, 1, 1)))[1] == 1
    assert m3.new_producer_id() > pid
