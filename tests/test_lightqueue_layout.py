"""The light-queue DB's entry layout: compact blocks per round, and layout-1 and layout-2 DBs
converted at open."""

from __future__ import annotations

from pathlib import Path

import plyvel
import pytest
from lightqueue_helpers import flushed, msg, open_all

import lightqueue.db as lqdb
from lightqueue.db import QueueDB
from lightqueue.keys import (
    G_LAYOUT,
    KIND_EXACT,
    LAYOUT_VERSION,
    P_ENTRY,
    P_TOPIC,
    VOID_TID,
    block_count,
    decode_meta,
    encode_block_py,
    encode_meta,
    entry_key,
    entry_key_seq,
    entry_prefix,
    meta_key,
    pack_entry,
    pack_u32,
    read_entries_py,
)


def _layout_1_db(path: Path) -> None:
    """A DB as layout 1 wrote it: one key per entry (uvarint topic id, uvarint partition,
    minimal big-endian offset; b"" void)."""
    db = plyvel.DB(str(path), create_if_missing=True)
    db.put(G_LAYOUT, pack_u32(1))
    db.put(P_TOPIC + b"a", pack_u32(0))
    db.put(P_TOPIC + b"b", pack_u32(200))  # a two-byte uvarint id
    db.put(meta_key("a/b"), encode_meta(3, KIND_EXACT, 0, 0))
    db.put(entry_key(3, 0), b"\x00\x00\x07")  # a-0 @ 7
    db.put(entry_key(3, 1), b"")  # void
    db.put(entry_key(3, 2), b"\xc8\x01\x02" + (2**40 + 5).to_bytes(6, "big"))  # b-2 @ 2**40+5
    db.put(entry_key(3, 3), b"\x00\x01\x00")  # a-1 @ 0
    db.close()


WANT = [("a", 0, 7), None, ("b", 2, 2**40 + 5), ("a", 1, 0), None]


def _check(path: Path) -> None:
    qdb = QueueDB(path)
    try:
        assert qdb.db.get(G_LAYOUT) == pack_u32(LAYOUT_VERSION)
        assert qdb.db.get(lqdb.G_CONVERTED) is None
        assert qdb.queues["a/b"].next == 4  # from the last entry, as before
        got = read_entries_py(qdb.db.iterator(prefix=entry_prefix(3)), 0, 5, qdb.topic_names)
        assert got == WANT
    finally:
        qdb.close()
    QueueDB(path).close()  # converted once: opens as the current layout


@pytest.mark.parametrize("chunk", [100_000, 1, 3])
def test_layout_1_entries_convert_to_blocks(
    tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout-1 DB opens with the same entries, as one-entry blocks, however many entries
    each conversion batch takes."""
    monkeypatch.setattr(lqdb, "CONVERT_CHUNK", chunk)
    _layout_1_db(tmp_path / "lq")
    _check(tmp_path / "lq")


def test_layout_1_conversion_cut_short_resumes(tmp_path: Path) -> None:
    """Killed after its first batch: the entries up to the recorded key are blocks already (a
    block can also be a well-formed layout-1 value: reading it as one again would corrupt it);
    the next open converts only the rest."""
    path = tmp_path / "lq"
    _layout_1_db(path)
    db = plyvel.DB(str(path))
    db.put(entry_key(3, 0), encode_block_py(pack_entry(0, 0, 7)))
    db.put(entry_key(3, 1), encode_block_py(pack_entry(VOID_TID, 0, 0)))
    db.put(entry_key(3, 2), encode_block_py(pack_entry(200, 2, 2**40 + 5)))
    db.put(lqdb.G_CONVERTED, entry_key(3, 2))
    db.close()
    _check(path)


def _layout_2_db(path: Path) -> None:
    """A DB as layout 2 wrote it: blocks of 16-byte entries."""
    db = plyvel.DB(str(path), create_if_missing=True)
    db.put(G_LAYOUT, pack_u32(2))
    db.put(P_TOPIC + b"a", pack_u32(0))
    db.put(P_TOPIC + b"b", pack_u32(200))
    db.put(meta_key("a/b"), encode_meta(3, KIND_EXACT, 0, 0))
    db.put(entry_key(3, 0), pack_entry(0, 0, 7) + pack_entry(VOID_TID, 0, 0))
    db.put(entry_key(3, 2), pack_entry(200, 2, 2**40 + 5) + pack_entry(0, 1, 0))
    db.close()


@pytest.mark.parametrize("cut", [False, True])
def test_layout_2_blocks_convert(tmp_path: Path, cut: bool) -> None:
    """A layout-2 DB opens with the same entries, in compact blocks (half the keys converted
    before a kill: the next open converts only the other half)."""
    path = tmp_path / "lq"
    _layout_2_db(path)
    if cut:
        db = plyvel.DB(str(path))
        db.put(entry_key(3, 0), encode_block_py(pack_entry(0, 0, 7) + pack_entry(VOID_TID, 0, 0)))
        db.put(lqdb.G_CONVERTED, entry_key(3, 0))
        db.close()
    _check(path)
    db = plyvel.DB(str(path))
    assert [block_count(v) for _, v in db.iterator(prefix=entry_prefix(3))] == [2, 2]
    db.close()


async def test_a_round_writes_one_block_per_queue(tmp_path: Path) -> None:
    """Fan-in's shape: a round of many messages on a few topics, one wildcard subscriber. Each
    queue the round grew gets one key (not one per entry), and reads from any sequence,
    including inside a block, return the entries in order."""
    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.acquire_filter("d/+")
    store.append_mqtt([msg(f"d/{i % 3}", b"%d" % i) for i in range(300)])
    await flushed(store)
    lq.dispatcher.catch_up()
    store.append_mqtt([msg(f"d/{i % 3}", b"%d" % i) for i in range(300, 330)])
    await flushed(store)
    lq.dispatcher.catch_up()
    q = lq.qdb.queues["d/+"]
    blocks = list(lq.qdb.db.iterator(prefix=entry_prefix(q.qid)))
    assert [(entry_key_seq(k), block_count(v)) for k, v in blocks] == [(0, 300), (300, 30)]
    # 100 entries of one topic at offsets 3 apart: one byte each, plus the first entry's head
    assert len(lq.qdb.db.get(entry_key(lq.qdb.queues["d/0"].qid, 0))) < 100 + 20
    assert sum(1 for _ in lq.qdb.db.iterator(prefix=P_ENTRY)) == 2 * 4  # 3 topics + filter
    for first in (0, 1, 150, 299, 300, 317):
        res = lq.read("d/+", first, 20)
        payloads = [m.payload for m in lq.resolve(res.entries) if m]
        assert payloads == [b"%d" % i for i in range(first, min(first + 20, 330))]
    await lq.close()
    await store.close()


async def test_a_clean_close_lets_the_next_open_trust_the_queue_ends(tmp_path: Path) -> None:
    """A clean close writes every queue's exact end and a mark; the next open reads no queue's
    last entry (one seek per queue: most of a restart with a million topics) and finds the same
    ends. Without the mark (a crash: the LevelDB closed without it) the ends are read from the
    entries, and are the same too; the mark never outlives the open that used it."""
    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.acquire_filter("d/+")
    for _ in range(3):  # several rounds: the `m` records lag behind the entries
        store.append_mqtt([msg(f"d/{i % 50}", b"%d" % i) for i in range(500)])
        await flushed(store)
        lq.dispatcher.catch_up()
    ends = {n: (q.start, q.next) for n, q in lq.qdb.queues.items()}
    assert ends["d/+"] == (0, 1500) and ends["d/7"] == (0, 30)
    q = lq.qdb.queues["d/+"]
    assert decode_meta(lq.qdb.db.get(q.mkey))[3] < 1500  # the `m` record alone is behind
    await lq.close()
    await store.close()
    path = tmp_path / lqdb.LIGHTQUEUE_DIR
    qdb = QueueDB(path)
    assert qdb.opened_clean
    assert {n: (q.start, q.next) for n, q in qdb.queues.items()} == ends
    qdb.raw.close()  # not `close()`: as after a kill -9
    qdb = QueueDB(path)
    assert not qdb.opened_clean
    assert {n: (q.start, q.next) for n, q in qdb.queues.items()} == ends
    qdb.raw.close()
