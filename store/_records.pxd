# Reading Kafka RecordBatch v2 records in C (store/record_batch.py has the format): inline helpers
# shared by the compiled readers that walk records in place (lightqueue/_cindex.pyx,
# lightqueue/_cresolve.pyx) and the builder (store/_cmqtt_batches.pyx). Header only: nothing is built.
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint64_t

cdef enum:
    HEADER_SIZE = 61
    ATTRIBUTES_OFFSET = 21


cdef inline uint64_t _uvget(const uint8_t* b, Py_ssize_t* pos, Py_ssize_t end) except? 0xFFFFFFFFFFFFFFFF:
    """An unsigned LEB128 varint (a light-queue entry's topic id and partition)."""
    cdef uint64_t v = 0
    cdef int shift = 0
    cdef uint8_t x
    while True:
        if pos[0] >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        x = b[pos[0]]
        pos[0] += 1
        v |= <uint64_t>(x & 0x7F) << shift
        if not (x & 0x80):
            return v
        shift += 7


cdef inline int64_t _vget(const uint8_t* b, Py_ssize_t* pos, Py_ssize_t end) except? -1:
    """A zigzag varint (Kafka's record fields)."""
    cdef uint64_t v = _uvget(b, pos, end)
    return <int64_t>(v >> 1) ^ -(<int64_t>(v & 1))


cdef inline uint8_t* _be(uint8_t* p, uint64_t v, int n) noexcept:
    """`v` as `n` big-endian bytes at `p`; returns the position after them."""
    cdef int i
    for i in range(n - 1, -1, -1):
        p[i] = <uint8_t>(v & 0xFF)
        v >>= 8
    return p + n


cdef inline Py_ssize_t _skip_bytes(const uint8_t* b, Py_ssize_t q, Py_ssize_t end) except -1:
    """Past one varint-length-prefixed field (-1 = null) that must end by `end`."""
    cdef int64_t n = _vget(b, &q, end)
    if n > end - q or n < -1:
        raise ValueError("record field runs past its record")
    return q + (n if n > 0 else 0)


cdef inline int64_t _batch_count(const uint8_t* b, Py_ssize_t pos) noexcept:
    """The record count of the batch at `pos` (its header's last field)."""
    return (<int64_t>b[pos + 57] << 24) | (b[pos + 58] << 16) | (b[pos + 59] << 8) | b[pos + 60]


cdef inline Py_ssize_t _record_end(const uint8_t* b, Py_ssize_t* q, Py_ssize_t bend) except -1:
    """Past a record's length: where the record ends, which must be inside its batch."""
    cdef int64_t length = _vget(b, q, bend)
    if length < 1 or length > bend - q[0]:
        raise ValueError("record runs past its batch")
    return q[0] + length


cdef inline object _field(const uint8_t* b, Py_ssize_t* q, Py_ssize_t end):
    """One varint-length-prefixed field as bytes (None for -1), ending by `end`."""
    cdef int64_t n = _vget(b, q, end)
    cdef object out
    if n < -1 or n > end - q[0]:
        raise ValueError("record field runs past its record")
    if n < 0:
        return None
    out = PyBytes_FromStringAndSize(<char*>(b + q[0]), n)
    q[0] += n
    return out
