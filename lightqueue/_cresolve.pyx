# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled halves of the resolver (`lightqueue/resolver.py` holds the pure twins): built at
install time with the other extensions (store.speedups explains).

* `resolve_cached` - `resolver.resolve_cached_py`: entries -> messages from the decoded-record
  cache, a plain PUBLISH record's `StoredMessage` allocated and its slots filled in place (the
  dataclass __init__ was most of the 1.1 us per message of `Resolver._message`);
* `cache_records` - `resolver.cache_records_py`: a decoded batch's records into that cache;
* `evict` - `resolver.evict_py`: its oldest records out, in the order they were decoded.

A subscriber far behind its queue (a QoS 1 reader of a fan-in) reads every message this way.
"""

from cpython.dict cimport PyDict_DelItem, PyDict_GetItem, PyDict_SetItem, PyDict_Size
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF

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
