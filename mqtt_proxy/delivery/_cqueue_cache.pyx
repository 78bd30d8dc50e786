# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled half of the delivery cache (`queue_cache.py` holds the pure twins): the fields of
a cached message (`CachedBase`, which `CachedMsg` extends; twin `_CachedFields`) and the loops
that fill and trim a queue's cache (`fill_cache`, `cached_end`, `evict_oldest`; twins
`fill_cache_py`, `cached_end_py`, `evict_oldest_py`). Built at install time with the other
extensions; tests/test_speedups.py compares each with its twin.
"""

cimport cython
from cpython.object cimport PyObject, PyTypeObject
from libc.stdint cimport int64_t

from store._capi cimport PyDict_Next, PyLong_AsSsize_t, PyObject_GC_UnTrack
from store._slots cimport message_slots

from store._slots import MESSAGE_FIELDS as _FIELDS


cdef tuple _NOARGS = ()


@cython.no_gc
cdef class CachedBase:
    """A resolved message as delivery keeps it; `CachedMsg` adds the encoding methods. A C
    struct read in place by `qos0_run`, and never tracked by the cyclic GC: it holds strs,
    bytes, ints, immutable properties and its dict of encoded templates, never a cycle (a
    fan-in's cache holds thousands of them, which every collection would walk)."""

    def __init__(self, topic, payload, int qos, bint retain, client_id, props, int64_t ts_ms):
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.client_id = client_id
        self.props = props
        self.ts_ms = ts_ms
        self.expire_at_ms = _expire_at(props, ts_ms)


cdef inline object _expire_at(object props, int64_t ts_ms):
    if props is None:
        return None
    expiry = props.message_expiry
    if expiry is None:
        return None
    return ts_ms + expiry * 1000


def fill_cache(type cls, list msgs, dict cache, Py_ssize_t seq, str internal, str probe,
               tuple raw_types):
    """cache[seq + i] = msgs[i] itself when its type is one of `raw_types` and it carries no
    properties (what QoS 0 and 1 runs read, in place), else cls(msgs[i]); None for a missing
    message or one on an internal topic (`internal`, except the probes' `probe`). `cls` is
    CachedMsg, a subclass of CachedBase: a heap type, so its instances are GC objects; they
    are untracked here (see CachedBase)."""
    cdef CachedBase c
    cdef PyTypeObject* t = <PyTypeObject*>cls
    cdef Py_ssize_t* off = NULL
    cdef char* base
    cdef PyObject* f[7]
    cdef Py_ssize_t i
    cdef object mtype = None
    cdef bint raw = False
    if not issubclass(cls, CachedBase):
        raise TypeError(f"{cls!r} is not a CachedBase")
    cdef Py_UCS4 first = internal[0]
    for m in msgs:
        if m is None:
            cache[seq] = None
            seq += 1
            continue
        if type(m) is not mtype:
            mtype = type(m)
            off = message_slots(mtype)
            raw = off is not NULL and mtype in raw_types
        if off is not NULL:
            base = <char*><PyObject*>m
            for i in range(7):
                f[i] = (<PyObject**>(base + off[i]))[0]
                if f[i] is NULL:  # an unset slot: let the attribute raise
                    getattr(m, _FIELDS[i])
            topic = <object>f[0]
        else:
            topic = m.topic
        if (
            len(<str>topic) and (<str>topic)[0] == first
            and topic.startswith(internal) and not topic.startswith(probe)
        ):
            cache[seq] = None
        elif raw and f[5] == <PyObject*>None:
            cache[seq] = m
        else:
            c = <CachedBase>t.tp_new(cls, <PyObject*>_NOARGS, NULL)
            PyObject_GC_UnTrack(<void*>c)
            c.topic = topic
            if off is not NULL:
                c.payload = <object>f[1]
                c.qos = <object>f[2]
                c.client_id = <object>f[3]
                c.retain = <object>f[4]
                props = <object>f[5]
                c.ts_ms = <object>f[6]
            else:
                c.payload = m.payload
                c.qos = m.qos
                c.retain = m.retain
                c.client_id = m.client_id
                props = m.properties
                c.ts_ms = m.timestamp_ms
            c.props = props
            c.expire_at_ms = _expire_at(props, c.ts_ms)
            cache[seq] = c
        seq += 1


def cached_end(dict cache, Py_ssize_t pos, Py_ssize_t limit):
    """The first sequence from `pos` (below `limit`) that `cache` does not hold, or `limit`:
    `queue_cache.cached_end_py`, without a Python step per sequence (~3 % of fan-in)."""
    while pos < limit and pos in cache:
        pos += 1
    return pos


def evict_oldest(dict cache, Py_ssize_t over, Py_ssize_t start):
    """Of the `over` oldest keys of `cache` (insertion order), delete those below `start`:
    `queue_cache.evict_oldest_py`, without a Python step per key (~3 % of fan-in)."""
    cdef Py_ssize_t pos = 0, n = 0
    cdef PyObject* key
    cdef PyObject* val
    cdef list gone = []
    while n < over and PyDict_Next(cache, &pos, &key, &val):
        n += 1
        if PyLong_AsSsize_t(<object>key) < start:
            gone.append(<object>key)
    for k in gone:
        del cache[k]
