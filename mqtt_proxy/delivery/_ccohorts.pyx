# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A QoS 0 cohort's run of PUBLISH packets written straight into one buffer, compiled
(`cohorts.py` holds the pure twin, `qos0_run_py`; tests/test_speedups.py compares them).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

from mqtt_proxy.delivery._cpublish cimport _head, _varint_size
from mqtt_proxy.delivery._cqueue_cache cimport CachedBase, _fields, _Msg
from store._capi cimport PyUnicode_AsUTF8AndSize


def qos0_run(dict cache, Py_ssize_t start, Py_ssize_t end, int64_t now_ms, bint v5,
             tuple sub_ids, bint rap, object observe, Py_ssize_t nsubs, object upgrade):
    """(the QoS 0 PUBLISH packets of cache[start:end] joined, their count), or (None, 0); the
    receive-to-write latency observed once per run of equal timestamps (times `nsubs`). Same
    bytes and observations as `cohorts.qos0_run_py`: one buffer, no packet object per message
    (a message carrying properties or subscription ids is encoded by its own `qos0`, a raw one
    after `upgrade(cache, seq)` made it a CachedMsg)."""
    cdef list parts = []  # a cache entry encoded here, or the bytes of one packet
    cdef Py_ssize_t total = 0, n = 0, seq, tlen, plen, rl, same = 0
    cdef int64_t ts0 = 0, ts
    cdef bint simple = not sub_ids
    cdef bint r
    cdef _Msg m
    cdef const char* t
    for seq in range(start, end):
        o = cache[seq]
        if o is None:
            continue
        _fields(o, &m)
        exp = <object>m.expire_at_ms
        if exp is not None and now_ms >= <int64_t>exp:
            continue
        r = m.retain and rap
        if simple and (not v5 or m.raw or (<CachedBase>o).props is None) and (
                type(<object>m.payload) is bytes):
            d = <object>m.data0
            if type(d) is bytes and not v5 and not r:
                parts.append(d)
                total += PyBytes_GET_SIZE(d)
            else:
                PyUnicode_AsUTF8AndSize(<object>m.topic, &tlen)
                rl = 2 + tlen + v5 + PyBytes_GET_SIZE(<object>m.payload)
                total += 1 + _varint_size(rl) + rl
                parts.append(o)
        else:
            if m.raw:
                o = upgrade(cache, seq)
            d = o.qos0(r, v5, sub_ids, now_ms)
            if type(d) is not bytes:  # the copy loop below tells packets from messages by type
                d = bytes(d)
            parts.append(d)
            total += PyBytes_GET_SIZE(d)
        n += 1
        ts = m.ts_ms
        if ts != ts0:
            if same:
                observe(now_ms - ts0, same * nsubs)
            ts0 = ts
            same = 0
        same += 1
    if same:
        observe(now_ms - ts0, same * nsubs)
    if n == 0:
        return None, 0
    out = PyBytes_FromStringAndSize(NULL, total)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(out)
    for o in parts:
        if type(o) is bytes:
            plen = PyBytes_GET_SIZE(o)
            memcpy(p, PyBytes_AS_STRING(o), plen)
            p += plen
            continue
        _fields(o, &m)
        t = PyUnicode_AsUTF8AndSize(<object>m.topic, &tlen)
        plen = PyBytes_GET_SIZE(<object>m.payload)
        rl = 2 + tlen + v5 + plen
        p = _head(p, 0x31 if (m.retain and rap) else 0x30, rl, t, tlen)
        if v5:
            p[0] = 0
            p += 1
        memcpy(p, PyBytes_AS_STRING(<object>m.payload), plen)
        p += plen
    return out, n
