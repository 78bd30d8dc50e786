# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled half of `store/mapping.py` (which holds the pure twins; the tests compare them):

* `murmur2` - `murmur2_py`: Kafka's key hash (a device event per connect and disconnect is
  partitioned by client id);
* `untrack` - `_keep_tracked`: fan-in's messages off the cyclic GC's lists (Python cannot
  untrack an object; without this the collector just does more work).
"""

from libc.stdint cimport int32_t, uint8_t, uint32_t


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)
    bint PyObject_GC_IsTracked(object op)


def murmur2(const uint8_t[::1] data):
    """Kafka's `Utils.murmur2` (signed 32-bit result), bit for bit."""
    cdef Py_ssize_t length = data.shape[0], n4 = length & ~3, i
    cdef uint32_t m = 0x5BD1E995, k
    cdef uint32_t h = <uint32_t>0x9747B28C ^ <uint32_t>length
    for i in range(0, n4, 4):
        k = (<uint32_t>data[i] | (<uint32_t>data[i + 1] << 8) | (<uint32_t>data[i + 2] << 16)
             | (<uint32_t>data[i + 3] << 24))
        k *= m
        k ^= k >> 24
        k *= m
        h = (h * m) ^ k
    cdef Py_ssize_t extra = length & 3
    if extra == 3:
        h ^= <uint32_t>data[n4 + 2] << 16
    if extra >= 2:
        h ^= <uint32_t>data[n4 + 1] << 8
    if extra >= 1:
        h ^= data[n4]
        h *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return <int32_t>h


def untrack(list objs):
    """Take `objs` off the cyclic garbage collector's lists (see store.mapping.untrack_messages:
    only for objects that cannot be part of a reference cycle)."""
    cdef object o
    for o in objs:
        if PyObject_GC_IsTracked(o):
            PyObject_GC_UnTrack(<void*>o)
