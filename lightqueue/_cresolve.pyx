# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled halves of the resolver (`lightqueue/resolver.py` holds the pure twins): built at
install time with the other extensions (store.speedups explains).

* `resolve_cached` - `resolver.resolve_cached_py`: entries -> messages from the decoded-record
  cache, a plain PUBLISH record's `StoredMessage` allocated and its slots filled in place (the
  dataclass __init__ was most of the 1.1 us per message of `Resolver._message`);
* `cache_records` - `resolver.cache_records_py`: a decoded batch's records into that cache;
* `evict` - `resolver.evict_py`: its oldest records out, in the order they were decoded;
* `group_offsets`, `resolve_records` - their `_py` twins: a cold read, straight from the
  records read;
* `decode_records` - `resolver._decode_records_py`: the records of one uncompressed batch,
  the two headers of a plain MQTT PUBLISH read in place (what fills the cache above).

A subscriber far behind its queue (a QoS 1 reader of a fan-in) reads every message this way.
"""

from cpython.dict cimport PyDict_DelItem, PyDict_GetItem, PyDict_SetItem, PyDict_Size
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF

from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcmp

from store._records cimport HEADER_SIZE, _batch_count, _field, _record_end, _vget
from store._slots cimport learn_slots


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    char* PyBytes_AS_STRING(object o)
    Py_ssize_t PyBytes_GET_SIZE(object o)
    ctypedef struct _AllocType "PyTypeObject":
        object (*tp_alloc)(_AllocType*, Py_ssize_t)


# StoredMessage's fields, in __init__'s order: their slots are filled in place.
_FIELDS = ("topic", "payload", "qos", "client_id", "retain", "properties", "timestamp_ms",
           "log_topic", "partition", "offset")
cdef Py_ssize_t _off[10]
cdef object _slots_of = None  # the class whose slot offsets _off holds
cdef object _F = False
cdef bytes _EMPTY = b""


cdef bint _learn_slots(type cls) except -1:
    """StoredMessage's slot offsets into _off (store._slots); False: construct by calling `cls`."""
    global _slots_of
    if not learn_slots(cls, _FIELDS, _off):
        return False
    _slots_of = cls
    return True


cdef inline void _put(char* base, Py_ssize_t off, object v) noexcept:
    Py_INCREF(v)
    (<PyObject**>(base + off))[0] = <PyObject*>v


cdef object _build(tuple r, tuple et, dict topics, _AllocType* tp, bint fast, object message):
    """The message of record `r` at entry `et`: a plain PUBLISH whose topic mapping `topics`
    knows is allocated and its slots filled here, any other built by `message`."""
    cdef object cid = r[5], topic = None, value, v
    cdef PyObject* got
    cdef char* base
    if r[6] is None and type(cid) is bytes:
        got = PyDict_GetItem(topics, (et[0], r[1]))
        if got is not NULL:
            topic = <object>got
    if topic is None or not fast:
        return message(et[0], et[1], r)
    value = r[2]
    if value is None:
        value = _EMPTY
    cid = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(cid), PyBytes_GET_SIZE(cid), "replace")
    v = tp.tp_alloc(tp, 0)
    PyObject_GC_UnTrack(<void*>v)  # strs, bytes and ints only
    base = <char*><PyObject*>v
    _put(base, _off[0], topic)
    _put(base, _off[1], value)
    _put(base, _off[2], r[4])
    _put(base, _off[3], cid)
    _put(base, _off[4], _F)
    _put(base, _off[5], None)
    _put(base, _off[6], r[3])
    _put(base, _off[7], et[0])
    _put(base, _off[8], et[1])
    _put(base, _off[9], r[0])
    return v


def resolve_cached(list entries, dict cache, dict topics, type cls, object message):
    """(messages aligned with `entries`, {(log topic, partition): [offsets not in `cache`]}).
    A cached record tuple is replaced in `cache` by its message: a plain PUBLISH whose topic
    mapping `topics` knows is built here, any other by `message(log topic, partition, record)`."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(entries)
    cdef list out = [None] * n
    cdef dict missing = {}
    cdef list g = None
    cdef object e, v, gt = None, gp = None
    cdef tuple et
    cdef PyObject* got
    cdef _AllocType* tp = <_AllocType*>cls
    cdef bint fast = cls is _slots_of or _learn_slots(cls)
    for i in range(n):
        e = <object>PyList_GET_ITEM(entries, i)
        if e is None:
            continue
        got = PyDict_GetItem(cache, e)
        if got is NULL:
            et = <tuple>e
            if g is None or et[0] != gt or et[1] != gp:  # a new partition, usually once a read
                gt = et[0]
                gp = et[1]
                g = missing.setdefault((gt, gp), [])
            g.append(et[2])
            continue
        v = <object>got
        if type(v) is tuple:
            v = _build(<tuple>v, <tuple>e, topics, tp, fast, message)
            PyDict_SetItem(cache, e, v)
        out[i] = v
    return out, missing


def cache_records(list recs, dict cache, object order, object t, object p):
    """Each record tuple of `recs` into `cache` under (t, p, offset), unless already there
    (decoded, or already asked for as a message), its key appended to `order` (a deque).
    Returns len(recs)."""
    cdef object r, k
    append = order.append
    for r in recs:
        k = (t, p, (<tuple>r)[0])
        if PyDict_GetItem(cache, k) is NULL:
            PyDict_SetItem(cache, k, r)
            append(k)
    return len(recs)


def evict(dict cache, object order, Py_ssize_t keep):
    """Drop the oldest keys of `order` (a deque) from `cache` until it holds at most `keep`; a
    key no longer in `cache` is skipped."""
    popleft = order.popleft
    while PyDict_Size(cache) > keep and len(order):
        k = popleft()
        if PyDict_GetItem(cache, k) is not NULL:
            PyDict_DelItem(cache, k)


def group_offsets(list entries):
    """{(log topic, partition): [offsets]} of the entries (None skipped), in entry order."""
    cdef dict groups = {}
    cdef list g = None
    cdef object e, gt = None, gp = None
    cdef tuple et
    for e in entries:
        if e is None:
            continue
        et = <tuple?>e
        if g is None or et[0] != gt or et[1] != gp:
            gt = et[0]
            gp = et[1]
            g = groups.setdefault((gt, gp), [])
        g.append(et[2])
    return groups


def resolve_records(list entries, dict recs, dict topics, type cls, object message):
    """Messages aligned with `entries`, each built from the record at its offset in
    `recs[(log topic, partition)]` (record tuples, offsets ascending); None where none is
    (void entry, record gone). A cursor per partition moves forward with the entries (a
    queue's entries are in offset order per partition), so nothing is looked up by key."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(entries), k, np = len(recs), lo, hi, mid, pos, m
    cdef list out = [None] * n, keys = list(recs), runs = [recs[key] for key in keys]
    cdef list run
    cdef tuple et, key
    cdef object e
    cdef long long want
    cdef Py_ssize_t* cur = <Py_ssize_t*>PyMem_Malloc((np + 1) * sizeof(Py_ssize_t))
    cdef _AllocType* tp = <_AllocType*>cls
    cdef bint fast = cls is _slots_of or _learn_slots(cls)
    if cur is NULL:
        raise MemoryError()
    try:
        for k in range(np):
            cur[k] = 0
        k = 0
        for i in range(n):
            e = <object>PyList_GET_ITEM(entries, i)
            if e is None:
                continue
            et = <tuple?>e
            if k >= np or not _same(<tuple>keys[k], et):
                k = 0
                while k < np and not _same(<tuple>keys[k], et):
                    k += 1
                if k == np:
                    continue
            run = <list?>runs[k]
            m = PyList_GET_SIZE(run)
            want = et[2]
            pos = cur[k]
            if pos > 0 and _off_of(run, pos - 1) >= want:  # behind the cursor: search again
                lo = 0
                hi = pos
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if _off_of(run, mid) < want:
                        lo = mid + 1
                    else:
                        hi = mid
                pos = lo
            while pos < m and _off_of(run, pos) < want:
                pos += 1
            cur[k] = pos
            if pos < m and _off_of(run, pos) == want:
                out[i] = _build(<tuple?>PyList_GET_ITEM(run, pos), et, topics, tp, fast,
                                message)
        return out
    finally:
        PyMem_Free(cur)


cdef inline bint _same(tuple key, tuple et) except -1:
    return (key[0] is et[0] or key[0] == et[0]) and key[1] == et[1]


cdef inline long long _off_of(list run, Py_ssize_t j) except? -1:
    return (<tuple?>PyList_GET_ITEM(run, j))[0]


# --- decoding a batch's records ------------------------------------------------------------------

cdef bytes _H_QOS_NAME = b"mqtt.qos"
cdef bytes _H_CID_NAME = b"mqtt.client_id"


def decode_records(const uint8_t[::1] data, Py_ssize_t pos, Py_ssize_t size, int64_t lat,
                   int64_t lo=-1, int64_t hi=0x7FFFFFFFFFFFFFFF):
    """The records of the uncompressed batch at `data[pos:pos+size]` with offsets in [lo, hi],
    as tuples (offset, key, value, timestamp, qos, client id, headers): a record with exactly
    the two headers of a plain MQTT PUBLISH (mqtt.qos "0"-"2", mqtt.client_id not null) has its
    QoS and client id bytes and headers None; any other has qos -1, client id None and its
    headers as [(name str, value bytes | None)]. `lat` >= 0 (LogAppendTime) is every record's
    timestamp. Records before `lo` are stepped over by their length, none after `hi` is read: a
    reader far behind wants a few hundred records of a batch of thousands
    (docs/performance-history.md).
    Raises ValueError for records that do not parse; nothing is returned then."""
    cdef const uint8_t* b = &data[0]
    cdef Py_ssize_t bend = pos + size, q0 = pos + HEADER_SIZE, rec_end, hq
    cdef int64_t count, i, nh, h, base, first_ts, ts, off
    cdef object key, value, cid, hname, hval
    cdef list out = [], hl
    cdef int qos
    if size < HEADER_SIZE or bend > data.shape[0]:
        raise ValueError("batch runs past the buffer")
    base = 0
    first_ts = 0
    for i in range(8):
        base = (base << 8) | b[pos + i]
        first_ts = (first_ts << 8) | b[pos + 27 + i]
    count = _batch_count(b, pos)
    for i in range(count):
        rec_end = _record_end(b, &q0, bend)
        q0 += 1  # attributes
        ts = _vget(b, &q0, rec_end)
        off = base + _vget(b, &q0, rec_end)
        if off < lo:
            q0 = rec_end
            continue
        if off > hi:
            break
        key = _field(b, &q0, rec_end)
        value = _field(b, &q0, rec_end)
        nh = _vget(b, &q0, rec_end)
        if nh < 0:
            raise ValueError("negative header count")
        qos = -1
        cid = None
        hl = None
        if nh == 2:
            # The common case, read in place: b"mqtt.qos" + one digit, b"mqtt.client_id" + bytes.
            hq = q0
            if (_vget(b, &hq, rec_end) == 8 and hq + 8 <= rec_end
                    and memcmp(b + hq, PyBytes_AS_STRING(_H_QOS_NAME), 8) == 0):
                hq += 8
                if _vget(b, &hq, rec_end) == 1 and hq < rec_end and 0x30 <= b[hq] <= 0x32:
                    qos = b[hq] - 0x30
                    hq += 1
                    if (_vget(b, &hq, rec_end) == 14 and hq + 14 <= rec_end
                            and memcmp(b + hq, PyBytes_AS_STRING(_H_CID_NAME), 14) == 0):
                        hq += 14
                        cid = _field(b, &hq, rec_end)
                        if cid is not None:
                            q0 = hq
                    if cid is None:
                        qos = -1
        if qos < 0:
            hl = []
            for h in range(nh):
                hname = _field(b, &q0, rec_end)
                if hname is None:
                    raise ValueError("null header name")
                hval = _field(b, &q0, rec_end)
                hl.append(((<bytes>hname).decode("utf-8"), hval))
        if q0 != rec_end:
            raise ValueError("record length mismatch")
        out.append((off, key, value, lat if lat >= 0 else first_ts + ts, qos, cid, hl))
    return out
