# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled halves of the light-queue block format (`lightqueue/keys.py` holds the pure twins and
the layout): built at install time with the other extensions (store.speedups explains).

* `put_blocks` - `lightqueue.keys.put_blocks_py`: a round's entries of each queue it grew as one
  LevelDB key (block) per queue;
* `read_entries` - `lightqueue.keys.read_entries_py`: a light queue's entries from a LevelDB
  iterator of its blocks (the reader of a subscriber behind its pushed entries).
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy


cdef inline void _put_be64(uint8_t* p, uint64_t v) noexcept:
    cdef int i
    for i in range(7, -1, -1):
        p[i] = <uint8_t>(v & 0xFF)
        v >>= 8


cdef inline uint32_t _be32(const uint8_t* p) noexcept:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t _be64(const uint8_t* p) noexcept:
    return (<uint64_t>_be32(p) << 32) | _be32(p + 4)


def put_blocks(list queues, object put, Py_ssize_t block_max):
    """Each queue's entries of this round (`q.buf`, ending at `q.next`) as blocks of at most
    `block_max` entries under `q.kpfx` + the first sequence; `q.buf` is reset to None."""
    cdef object q, buf
    cdef bytes kp, key, val
    cdef Py_ssize_t n, i, cnt, kl
    cdef int64_t first
    cdef char* src
    for q in queues:
        buf = q.buf
        if buf is None:
            continue
        q.buf = None
        n = PyByteArray_GET_SIZE(buf) // 16
        first = q.next - n
        kp = q.kpfx
        kl = PyBytes_GET_SIZE(kp)
        src = PyByteArray_AS_STRING(buf)
        i = 0
        while i < n:
            cnt = n - i if n - i < block_max else block_max
            key = PyBytes_FromStringAndSize(NULL, kl + 8)
            memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(kp), kl)
            _put_be64(<uint8_t*>PyBytes_AS_STRING(key) + kl, <uint64_t>(first + i))
            val = PyBytes_FromStringAndSize(src + 16 * i, 16 * cnt)
            put(key, val)
            i += cnt


def read_entries(object it, int64_t first, int64_t end, list names):
    """A light queue's entries [first, end) from a LevelDB iterator of its blocks (starting at
    the block that holds `first`, or after it): the (log topic, partition, offset) tuple per
    sequence, None for a void entry, a retired topic id ("" in `names`) or a sequence no block
    holds (entries are dense; stay aligned)."""
    cdef list out = []
    cdef int64_t expect = first, seq, s, cnt, i
    cdef const uint8_t* kb
    cdef const uint8_t* vb
    cdef uint32_t tid, part
    cdef uint64_t off
    cdef Py_ssize_t nnames = len(names), j
    cdef bytes k, v
    cdef object name
    for k, v in it:
        kb = <const uint8_t*>PyBytes_AS_STRING(k)
        if PyBytes_GET_SIZE(k) < 13:
            raise ValueError("not an entry key")
        seq = 0
        for j in range(5, 13):
            seq = (seq << 8) | kb[j]
        cnt = PyBytes_GET_SIZE(v) // 16
        vb = <const uint8_t*>PyBytes_AS_STRING(v)
        i = expect - seq if expect > seq else 0
        while i < cnt:
            s = seq + i
            if s >= end:
                break
            while expect < s:
                out.append(None)
                expect += 1
            expect += 1
            tid = _be32(vb + 16 * i)
            part = _be32(vb + 16 * i + 4)
            off = _be64(vb + 16 * i + 8)
            i += 1
            if tid >= nnames:
                out.append(None)
                continue
            name = names[tid]
            out.append((name, part, off) if name else None)
        if seq + cnt >= end:
            break
    while expect < end:
        out.append(None)
        expect += 1
    return out
