# The compiled fields of a cached message (`CachedBase`, defined in _cqueue_cache.pyx beside
# queue_cache.py) and the reader of a cache entry's fields in place (`_fields`), shared with the
# compiled runs that read them (_ccohorts.pyx, _cqos1_run.pyx): inline, so each run reads a
# field as directly as when they were one module.
from cpython.object cimport PyObject
from libc.stdint cimport int64_t

from store._slots cimport message_slots


cdef class CachedBase:
    cdef public object topic
    cdef public object payload
    cdef public int qos
    cdef public bint retain
    cdef public object client_id
    cdef public object props
    cdef public int64_t ts_ms
    cdef public object expire_at_ms
    cdef public object templates
    cdef public object data0
    cdef public object alias0


cdef struct _Msg:
    # A cached entry's fields as the runs read them (borrowed: the cache holds the object).
    PyObject* topic
    PyObject* payload
    PyObject* expire_at_ms  # None for a raw message (it carries no properties)
    PyObject* data0  # None for a raw message
    bint retain
    bint raw
    int qos
    int64_t ts_ms


cdef inline int _fields(object o, _Msg* m) except -1:
    """A cache entry (not None): a CachedBase, or a raw message `fill_cache` kept as it is (a
    slots class without properties)."""
    cdef CachedBase c
    cdef Py_ssize_t* off
    cdef char* base
    if isinstance(o, CachedBase):
        c = <CachedBase>o
        m.topic = <PyObject*>c.topic
        m.payload = <PyObject*>c.payload
        m.expire_at_ms = <PyObject*>c.expire_at_ms
        m.data0 = <PyObject*>c.data0
        m.retain = c.retain
        m.qos = c.qos
        m.ts_ms = c.ts_ms
        m.raw = False
        return 0
    off = message_slots(type(o))
    if off is NULL:
        raise TypeError(f"{type(o)!r} in a delivery cache")
    base = <char*><PyObject*>o
    m.topic = (<PyObject**>(base + off[0]))[0]
    m.payload = (<PyObject**>(base + off[1]))[0]
    m.qos = <int><object>(<PyObject**>(base + off[2]))[0]
    m.retain = <bint><object>(<PyObject**>(base + off[4]))[0]
    m.ts_ms = <int64_t><object>(<PyObject**>(base + off[6]))[0]
    m.expire_at_ms = <PyObject*>None
    m.data0 = <PyObject*>None
    m.raw = True
    return 0
