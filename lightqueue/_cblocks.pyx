# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled halves of the light-queue block format (`lightqueue/keys.py` holds the pure twins and
the layout): built at install time with the other extensions (store.speedups explains).

* `put_blocks` - `lightqueue.keys.put_blocks_py`: a round's entries of each queue it grew as one
  LevelDB key (block) per queue;
* `read_entries` - `lightqueue.keys.read_entries_py`: a light queue's entries from a LevelDB
  iterator of its blocks (the reader of a subscriber behind its pushed entries);
* `encode_block` / `decode_block` - their `_py` twins: 16-byte entries <-> a layout-3 block value
  (the format is described in lightqueue/keys.py, "Block values").
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport INT64_MAX, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

DEF HEAD_SCAN = 16  # lightqueue.keys.HEAD_SCAN


cdef inline void _put_be64(uint8_t* p, uint64_t v) noexcept:
    cdef int i
    for i in range(7, -1, -1):
        p[i] = <uint8_t>(v & 0xFF)
        v >>= 8


cdef inline uint32_t _be32(const uint8_t* p) noexcept:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t _be64(const uint8_t* p) noexcept:
    return (<uint64_t>_be32(p) << 32) | _be32(p + 4)


cdef inline Py_ssize_t _put_uv(uint8_t* p, uint64_t v) noexcept:
    cdef Py_ssize_t n = 0
    while v >= 0x80:
        p[n] = <uint8_t>(v | 0x80)
        v >>= 7
        n += 1
    p[n] = <uint8_t>v
    return n + 1


cdef inline Py_ssize_t _get_uv(const uint8_t* p, Py_ssize_t pos, Py_ssize_t n,
                               uint64_t* v) except -1:
    cdef uint64_t r = 0
    cdef int shift = 0
    cdef uint8_t b
    while True:
        if pos >= n or shift > 63:
            raise ValueError("truncated block")
        b = p[pos]
        pos += 1
        r |= <uint64_t>(b & 0x7F) << shift
        if b < 0x80:
            v[0] = r
            return pos
        shift += 7


cdef bytes _encode(const uint8_t* src, Py_ssize_t cnt):
    """`cnt` 16-byte entries as a layout-3 block value (keys.encode_block_py, byte for byte)."""
    # at most 10 (count) + per entry 1 + 10 + 8 + 10 bytes
    cdef uint8_t* out = <uint8_t*>malloc(10 + 29 * cnt + 16 * cnt)
    if out == NULL:
        raise MemoryError()
    cdef uint64_t* heads = <uint64_t*>(out + 10 + 29 * cnt)
    cdef int64_t* last = <int64_t*>(out + 10 + 29 * cnt + 8 * cnt)
    cdef Py_ssize_t nh = 0, i, j, x, prev = -1, o
    cdef uint64_t head, off, z
    cdef int64_t d
    cdef bint new
    try:
        o = _put_uv(out, <uint64_t>cnt)
        for i in range(cnt):
            head = _be64(src + 16 * i)
            off = _be64(src + 16 * i + 8)
            x = -1
            if prev >= 0 and heads[prev] == head:
                x = prev
            else:
                for j in range(nh if nh < HEAD_SCAN else HEAD_SCAN):
                    if heads[j] == head:
                        x = j
                        break
            new = x < 0
            if new:
                x = nh
                heads[nh] = head
                last[nh] = -1
                nh += 1
            d = <int64_t>(off - <uint64_t>last[x] - 1)
            z = (<uint64_t>d) << 1 if d >= 0 else ((<uint64_t>(-(d + 1))) << 1) | 1
            if x < 7 and not new and z < (<uint64_t>1 << 57):
                o += _put_uv(out + o, (z << 3) | <uint64_t>x)
            else:
                out[o] = 7
                o += 1
                o += _put_uv(out + o, <uint64_t>x)
                if new:
                    _put_be64(out + o, head)
                    o += 8
                o += _put_uv(out + o, z)
            last[x] = <int64_t>off
            prev = x
        return PyBytes_FromStringAndSize(<char*>out, o)
    finally:
        free(out)


cdef Py_ssize_t _decode(const uint8_t* v, Py_ssize_t vlen, uint8_t** res) except -1:
    """A layout-3 block value as 16-byte entries in a malloc'ed `res[0]` (the caller frees it);
    returns the entry count. ValueError if `v` is not a block."""
    cdef uint64_t n, tag, x, z
    cdef Py_ssize_t pos = _get_uv(v, 0, vlen, &n), i, nh = 0
    if n > <uint64_t>vlen:  # every entry takes a byte at least
        raise ValueError("block count larger than the block")
    cdef uint8_t* out = <uint8_t*>malloc(16 * n + 16 * n + 1)
    if out == NULL:
        raise MemoryError()
    cdef uint64_t* heads = <uint64_t*>(out + 16 * n)
    cdef int64_t* last = <int64_t*>(out + 16 * n + 8 * n)
    cdef int64_t off
    try:
        for i in range(<Py_ssize_t>n):
            pos = _get_uv(v, pos, vlen, &tag)
            x = tag & 7
            if x == 7:
                if tag != 7:
                    raise ValueError("bad escape")
                pos = _get_uv(v, pos, vlen, &x)
                if x == <uint64_t>nh:
                    if pos + 8 > vlen:
                        raise ValueError("truncated head")
                    heads[nh] = _be64(v + pos)
                    last[nh] = -1
                    nh += 1
                    pos += 8
                pos = _get_uv(v, pos, vlen, &z)
            else:
                z = tag >> 3
            if x >= <uint64_t>nh:
                raise ValueError("head index out of range")
            off = last[x] + 1  # 0 .. 2**63 - 1 here
            if z & 1:
                if (z >> 1) + 1 > <uint64_t>off:
                    raise ValueError("offset out of range")
                off -= <int64_t>((z >> 1) + 1)
            else:
                if z >> 1 > <uint64_t>(INT64_MAX - off):
                    raise ValueError("offset out of range")
                off += <int64_t>(z >> 1)
            last[x] = off
            _put_be64(out + 16 * i, heads[x])
            _put_be64(out + 16 * i + 8, <uint64_t>off)
        if pos != vlen:
            raise ValueError("trailing bytes after the block's entries")
    except BaseException:
        free(out)
        raise
    res[0] = out
    return <Py_ssize_t>n


def encode_block(const uint8_t[::1] raw):
    """16-byte entries -> a layout-3 block value."""
    if raw.shape[0] == 0:
        return _encode(NULL, 0)
    return _encode(&raw[0], raw.shape[0] // 16)


def decode_block(bytes v):
    """A layout-3 block value -> its 16-byte entries (ValueError if it is not one)."""
    cdef uint8_t* raw = NULL
    cdef Py_ssize_t n = _decode(<const uint8_t*>PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v), &raw)
    try:
        return PyBytes_FromStringAndSize(<char*>raw, 16 * n)
    finally:
        free(raw)


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
            val = _encode(<const uint8_t*>src + 16 * i, cnt)
            put(key, val)
            i += cnt


def read_entries(object it, int64_t first, int64_t end, list names):
    """A light queue's entries [first, end) from a LevelDB iterator of its blocks (starting at
    the block that holds `first`, or after it): the (log topic, partition, offset) tuple per
    sequence, None for a void entry, a retired topic id ("" in `names`) or a sequence no block
    holds (entries are dense; stay aligned)."""
    cdef list out = []
    cdef uint8_t* raw = NULL
    try:
        _read(it, first, end, names, out, &raw)
    finally:
        free(raw)
    return out


cdef int _read(object it, int64_t first, int64_t end, list names, list out,
               uint8_t** raw) except -1:
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
        free(raw[0])
        raw[0] = NULL
        cnt = _decode(<const uint8_t*>PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v), raw)
        vb = raw[0]
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
    return 0
