# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A 3.1.1 QoS 1 reader's run of PUBLISHes, each built in one allocation with its `Inflight`
record filled in place, compiled (`qos1_run.py` holds the pure twin, `qos1_run_py`;
tests/test_speedups.py compares them).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

from mqtt_proxy.delivery._cpublish cimport _head, _varint_size
from mqtt_proxy.delivery._cqueue_cache cimport _fields, _Msg
from store._capi cimport PyObject_GC_UnTrack, PyUnicode_AsUTF8AndSize, _AllocType
from store._slots cimport learn_slots, put_slot


# Inflight's fields, in __init__'s order: its slots are filled in place.
_IFIELDS = ("queue", "seq", "qos", "data", "released", "filter_raw")
cdef Py_ssize_t _ioff[6]
cdef object _islots_of = None  # the class whose slot offsets _ioff holds
cdef object _F = False


cdef bint _learn_islots(type cls) except -1:
    global _islots_of
    if not learn_slots(cls, _IFIELDS, _ioff):
        return False
    _islots_of = cls
    return True


def qos1_run(dict cache, Py_ssize_t seq, Py_ssize_t end, dict pending, dict inflight,
             Py_ssize_t room, int pid, int64_t now_ms, object queue, object filter_raw,
             type icls, object observe, list out, int sub_qos, bint rap):
    """Same packets, records and observations as `cohorts.qos1_run_py`: each PUBLISH built
    here in one allocation, its `Inflight` allocated and its slots filled in place."""
    cdef Py_ssize_t nbytes = 0, same = 0, tlen, plen, rl, total, guard
    cdef int64_t ts0 = 0, ts
    cdef bint blocked = False, fast = icls is _islots_of or _learn_islots(icls)
    cdef int q
    cdef _Msg c
    cdef const char* t
    cdef uint8_t* p
    cdef object o, data, inf, key, pid_o
    cdef _AllocType* tp = <_AllocType*>icls
    cdef char* base
    while seq < end:
        o = cache[seq]
        key = seq
        if o is None or key in pending:
            seq += 1
            continue
        _fields(o, &c)
        exp = <object>c.expire_at_ms
        if exp is not None and now_ms >= <int64_t>exp:
            seq += 1
            continue
        q = c.qos if c.qos < sub_qos else sub_qos
        if q != 1 or (rap and c.retain) or type(<object>c.payload) is not bytes:
            break
        t = PyUnicode_AsUTF8AndSize(<object>c.topic, &tlen)
        plen = PyBytes_GET_SIZE(<object>c.payload)
        rl = 4 + tlen + plen
        if tlen > 65535 or rl > 268435455:
            break  # the general path reports it
        if room <= 0:
            blocked = True
            break
        guard = 0
        while pid in inflight:
            pid = pid + 1 if pid < 65535 else 1
            guard += 1
            if guard > 65535:
                raise RuntimeError("no free packet id")
        total = 1 + _varint_size(rl) + rl
        data = PyBytes_FromStringAndSize(NULL, total)
        p = _head(<uint8_t*>PyBytes_AS_STRING(data), 0x32, rl, t, tlen)
        p[0] = pid >> 8
        p[1] = pid & 0xFF
        memcpy(p + 2, PyBytes_AS_STRING(<object>c.payload), plen)
        pid_o = pid
        if fast:
            inf = tp.tp_alloc(tp, 0)
            PyObject_GC_UnTrack(<void*>inf)  # strs, bytes, ints and a bool
            base = <char*><PyObject*>inf
            put_slot(base, _ioff[0], queue)
            put_slot(base, _ioff[1], key)
            put_slot(base, _ioff[2], 1)
            put_slot(base, _ioff[3], data)
            put_slot(base, _ioff[4], _F)
            put_slot(base, _ioff[5], filter_raw)
        else:
            inf = icls(queue, key, 1, data, False, filter_raw)
        inflight[pid_o] = inf
        pending[key] = pid_o
        out.append(data)
        nbytes += total
        room -= 1
        pid = pid + 1 if pid < 65535 else 1
        ts = c.ts_ms
        if ts != ts0:
            if same:
                observe(now_ms - ts0, same)
            ts0 = ts
            same = 0
        same += 1
        seq += 1
    if same:
        observe(now_ms - ts0, same)
    return seq, pid, nbytes, blocked
