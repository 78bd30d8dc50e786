# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A read chunk's plain PUBLISHes as `MqttMessage`s, allocated and filled in place, compiled
(`handlers.py` holds the pure twin, `publish_messages_py`; tests/test_speedups.py compares them).
"""

from cpython.object cimport PyObject

from store._capi cimport (
    PyObject_GC_UnTrack, PyUnicode_GET_LENGTH, PyUnicode_READ_CHAR, _AllocType
)
from store._slots cimport learn_slots, put_slot

from store._slots import MESSAGE_FIELDS as _FIELDS


cdef Py_ssize_t _off[7]
cdef object _slots_of = None  # the class whose slot offsets _off holds
cdef object _F = False


cdef bint _learn_slots(type cls) except -1:
    global _slots_of
    if not learn_slots(cls, _FIELDS, _off):
        return False
    _slots_of = cls
    return True


def publish_messages(list packets, Py_ssize_t i, object cid, object now_ms, object empty,
                     type cls):
    """From `packets[i]` on, the plain PUBLISHes (QoS 0/1, not retained, no properties, topic
    not `$...`) as `cls` messages received at `now_ms` from `cid`, until the first other one:
    (messages, the QoS 1 ones' packet ids, index of that one or len(packets)). Each message is
    allocated and its slots filled in place (a dataclass __init__ call was 450 of the 800 ns per
    message of the Python loop) and left untracked by the cyclic GC (only strs, bytes and ints)."""
    cdef Py_ssize_t n = len(packets)
    cdef list msgs = [], pids = []
    cdef tuple p  # a Publish (a tuple subclass: cast, not checked)
    cdef object topic, qos, retain, props, m
    cdef _AllocType* tp = <_AllocType*>cls
    cdef char* base
    cdef bint fast = cls is _slots_of or _learn_slots(cls)
    while i < n:
        p = <tuple>packets[i]
        topic = p[0]
        qos = p[2]
        retain = p[3]
        props = p[6]
        if (props is not empty or qos == 2 or retain or PyUnicode_GET_LENGTH(topic) == 0
                or PyUnicode_READ_CHAR(topic, 0) == 36):  # "$"
            break
        if fast:
            m = tp.tp_alloc(tp, 0)
            PyObject_GC_UnTrack(<void*>m)
            base = <char*><PyObject*>m
            put_slot(base, _off[0], topic)
            put_slot(base, _off[1], p[1])
            put_slot(base, _off[2], qos)
            put_slot(base, _off[3], cid)
            put_slot(base, _off[4], _F)
            put_slot(base, _off[5], None)
            put_slot(base, _off[6], now_ms)
        else:
            m = cls(topic, p[1], qos, cid, False, None, now_ms)
        msgs.append(m)
        if qos:
            pids.append(p[5])
        i += 1
    return msgs, pids, i
