# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The dispatcher's per-record loop, compiled (`lightqueue/index_batch.py` holds the pure twin,
`_index_batch_py`; the tests run both): built at install time with the other extensions.

`index_batch` walks one uncompressed batch (offset and key only; values and headers are
skipped, not decoded) and appends each entry to its queue's round buffer
(`lightqueue/_cblocks.pyx` writes and reads the blocks).
"""

from cpython.bytearray cimport (
    PyByteArray_AS_STRING,
    PyByteArray_FromStringAndSize,
    PyByteArray_GET_SIZE,
    PyByteArray_Resize,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

from store._records cimport HEADER_SIZE, _batch_count, _be, _record_end, _skip_bytes, _vget

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)


def index_batch(const uint8_t[::1] data, Py_ssize_t pos, Py_ssize_t size, int64_t base,
                int64_t c, int64_t end, Py_ssize_t n, Py_ssize_t budget, dict tcache,
                object targets_for, bytes ehead, int64_t stamp,
                list grown, object gate_key, str t, int p):
    """Index the records of the uncompressed batch at `data[pos:pos+size]` in [c, end): each
    target queue's entry (`ehead` + the offset, 16 bytes) is appended to its `buf`.

    Returns (offset where the budget ran out or -1, records indexed so far). Raises ValueError
    for records that do not parse (the caller counts the batch as corrupt)."""
    cdef const uint8_t* b = &data[0]
    cdef Py_ssize_t bend = pos + size, q0 = pos + HEADER_SIZE, rec_end
    cdef int64_t count, off, klen, i, nh, h
    cdef object key, targets
    cdef uint8_t entry[16]
    if PyBytes_GET_SIZE(ehead) != 8:
        raise ValueError("entry head is 8 bytes")
    memcpy(entry, PyBytes_AS_STRING(ehead), 8)
    if size < HEADER_SIZE or bend > data.shape[0]:
        raise ValueError("batch runs past the buffer")
    count = _batch_count(b, pos)
    # First walk: every record parses (as the pure path decodes them all before indexing any).
    for i in range(count):
        rec_end = _record_end(b, &q0, bend)
        q0 += 1
        _vget(b, &q0, rec_end)
        _vget(b, &q0, rec_end)
        q0 = _skip_bytes(b, q0, rec_end)  # key
        q0 = _skip_bytes(b, q0, rec_end)  # value
        nh = _vget(b, &q0, rec_end)
        if nh < 0:
            raise ValueError("negative header count")
        for h in range(nh):
            q0 = _skip_bytes(b, q0, rec_end)
            q0 = _skip_bytes(b, q0, rec_end)
        if q0 != rec_end:
            raise ValueError("record length mismatch")
    # Second walk: a run of records with the same key (a device's messages, as appended) goes
    # to its targets at once: one buffer resize and one `next` update per queue and run.
    cdef int64_t* offs = <int64_t*>malloc(<size_t>(count if count > 0 else 1) * sizeof(int64_t))
    cdef Py_ssize_t nrun = 0
    cdef const uint8_t* rkey = NULL
    cdef int64_t rklen = -2  # no run yet (-1 is a null key)
    if offs == NULL:
        raise MemoryError()
    targets = None
    try:
        q0 = pos + HEADER_SIZE
        for i in range(count):
            rec_end = _record_end(b, &q0, bend)  # (the first walk checked them all)
            q0 += 1  # attributes
            _vget(b, &q0, rec_end)  # timestamp delta
            off = base + _vget(b, &q0, rec_end)
            klen = _vget(b, &q0, rec_end)
            if klen > rec_end - q0:
                raise ValueError("record key runs past its record")
            if off < c:
                q0 = rec_end
                continue
            if off >= end:
                break
            if n >= budget:
                _run_to(targets, offs, nrun, entry, gate_key, t, p, stamp, grown)
                return off, n
            if klen != rklen or (klen > 0 and memcmp(b + q0, rkey, <size_t>klen) != 0):
                _run_to(targets, offs, nrun, entry, gate_key, t, p, stamp, grown)
                nrun = 0
                key = None if klen < 0 else PyBytes_FromStringAndSize(<char*>(b + q0), klen)
                targets = tcache.get(key)
                if targets is None:
                    targets = tcache[key] = targets_for(key)
                rkey = b + q0
                rklen = klen
            offs[nrun] = off
            nrun += 1
            q0 = rec_end
            n += 1
        _run_to(targets, offs, nrun, entry, gate_key, t, p, stamp, grown)
    finally:
        free(offs)
    return -1, n


cdef int _run_to(object targets, const int64_t* offs, Py_ssize_t nrun, const uint8_t* head,
                 object gate_key, str t, int p, int64_t stamp, list grown) except -1:
    """Append one run of offsets (ascending, same targets) to each target queue: its entries
    (`head` + offset) to `q.buf`, `(t, p, offset)` to `q.watch` if watched."""
    cdef object q, w, gate, ent
    cdef bytearray buf
    cdef Py_ssize_t j, j0, blen, k
    cdef int64_t floor
    cdef uint8_t* dst
    if nrun == 0:
        return 0
    for q in targets:
        j0 = 0
        if gate_key is not None:
            gate = q.gate
            if gate is not None:
                floor = gate.get(gate_key, 0)
                while j0 < nrun and offs[j0] < floor:
                    j0 += 1
                if j0 == nrun:
                    continue
        k = nrun - j0
        buf = q.buf
        if buf is None:
            buf = PyByteArray_FromStringAndSize(NULL, 16 * k)
            q.buf = buf
            blen = 0
        else:
            blen = PyByteArray_GET_SIZE(buf)
            PyByteArray_Resize(buf, blen + 16 * k)
        dst = <uint8_t*>PyByteArray_AS_STRING(buf) + blen
        for j in range(j0, nrun):
            memcpy(dst, head, 8)
            _be(dst + 8, <uint64_t>offs[j], 8)
            dst += 16
        w = q.watch
        if w is not None:
            for j in range(j0, nrun):
                # str and ints only, never in a cycle: no work for the cyclic GC (as above)
                ent = (t, p, offs[j])
                PyObject_GC_UnTrack(<void*>ent)
                w.append(ent)
        q.next += k
        if q.touched != stamp:
            q.touched = stamp
            grown.append(q)
    return 0
