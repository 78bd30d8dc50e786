"""Recovery at open: the dispatcher's checkpoints against the commitlog as it is now.

1. Checkpoint beyond the log end: the commitlog lost its unflushed tail in an OS crash, and its
   offsets will be reused by new records. Entries pointing at lost offsets become *void* (value
   b"", resolved to None) so sequence numbers stay dense and stored positions keep their meaning;
   the checkpoint drops to the log end.
2. Checkpoint below the log start: retention deleted records never indexed; skip to log start.
"""

from __future__ import annotations

import logging

from lightqueue.db import QueueDB
from lightqueue.keys import (
    P_ENTRY,
    VOID_ENTRY,
    block_entries,
    checkpoint_key,
    encode_block_py,
    pack_entry,
    pack_u64,
)
from store import UnknownTopicOrPartitionError
from store.backend import LogBackend

log = logging.getLogger("lightgate.lightqueue.dispatch")


def repair_checkpoints(qdb: QueueDB, store: LogBackend) -> dict[tuple[str, int], tuple[int, int]]:
    """Clamp checkpoints to [log start, log end]; void entries past a truncated log end.

    Returns {(topic, partition): (old checkpoint, new checkpoint)} for what changed.
    """
    changed: dict[tuple[str, int], tuple[int, int]] = {}
    truncated: dict[tuple[int, int], int] = {}
    for (t, p), c in list(qdb.checkpoints.items()):
        try:
            end = store.high_watermark(t, p)
            start = store.log_start_offset(t, p)
        except UnknownTopicOrPartitionError:
            end = start = 0
        if c > end:
            truncated[(qdb.topic_ids[t], p)] = end
            changed[(t, p)] = (c, end)
        elif c < start:
            changed[(t, p)] = (c, start)
    if not changed:
        return changed
    db = qdb.db
    wb = db.write_batch(sync=True)
    voided = 0
    if truncated:
        log.warning("commitlog shorter than the light-queue checkpoint: %s", changed)
        for k, v in db.iterator(prefix=P_ENTRY):
            ents = block_entries(v)
            hit = 0
            for i, e in enumerate(ents):
                if e is not None:
                    cut = truncated.get((e[0], e[1]))
                    if cut is not None and e[2] >= cut:
                        ents[i] = None
                        hit += 1
            if hit:
                raw = b"".join(VOID_ENTRY if e is None else pack_entry(*e) for e in ents)
                wb.put(k, encode_block_py(raw))
                voided += hit
    for (t, p), (_old, new) in changed.items():
        qdb.checkpoints[(t, p)] = new
        wb.put(checkpoint_key(qdb.topic_ids[t], p), pack_u64(new))
    wb.write()
    if voided:
        log.warning("voided %d light-queue entries whose records the log lost", voided)
    return changed
