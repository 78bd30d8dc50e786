# Writing a PUBLISH in C: inline helpers of the compiled runs that build packets straight into a
# buffer (_ccohorts.pyx, _cqos1_run.pyx). Header only: nothing is built.
from libc.stdint cimport uint8_t
from libc.string cimport memcpy


cdef inline Py_ssize_t _varint_size(Py_ssize_t v) noexcept:
    if v < 128:
        return 1
    if v < 16384:
        return 2
    if v < 2097152:
        return 3
    return 4


cdef inline uint8_t* _head(uint8_t* p, uint8_t first, Py_ssize_t rl, const char* t,
                           Py_ssize_t tlen) noexcept:
    """A PUBLISH's fixed header and topic name at `p`; returns where the rest goes."""
    p[0] = first
    p += 1
    while rl >= 128:
        p[0] = (rl & 0x7F) | 0x80
        rl >>= 7
        p += 1
    p[0] = rl
    p[1] = tlen >> 8
    p[2] = tlen & 0xFF
    p += 3
    memcpy(p, t, tlen)
    return p + tlen
