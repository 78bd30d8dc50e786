# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled `Parser._walk` (parser.py): the same walk, with C integers and byte reads.

Built at install time when a C compiler is there (setup.py); `parser.py` uses it unless
`LIGHTGATE_NO_EXTENSIONS=1`. Behaviour, errors and messages are those of `Parser._walk`, which
stays the reference: the codec tests run against both (tests/conftest.py, `codec_impl`).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcmp
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM


cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        object (*tp_alloc)(PyTypeObject*, Py_ssize_t)
    void PyObject_GC_UnTrack(void* op)

from ._decode import DECODERS, REQUIRED_FLAGS
from .errors import RemoteProtocolError as _E
from .packets import Puback, Publish
from .parser import _TOPICS_LAX, _TOPICS_STRICT, _topic
from .properties import EMPTY_PROPERTIES, decode_properties

cdef object _Publish = Publish
cdef object _Puback = Puback
cdef object _EMPTY = EMPTY_PROPERTIES
cdef dict _decoders = DECODERS
cdef object _flags_for = REQUIRED_FLAGS
cdef dict _strict_cache = _TOPICS_STRICT
cdef dict _lax_cache = _TOPICS_LAX
cdef object _T = True
cdef object _F = False


cdef inline object _set(object t, Py_ssize_t i, object v):
    Py_INCREF(v)  # PyTuple_SET_ITEM steals a reference
    PyTuple_SET_ITEM(t, i, v)


cdef object _puback(unsigned int pid):
    """Puback(pid) as `_ack_decoder` makes it: (pid, reason 0, no properties)."""
    cdef PyTypeObject* tp = <PyTypeObject*>_Puback
    cdef object t = tp.tp_alloc(tp, 3)
    _set(t, 0, pid)
    _set(t, 1, 0)
    _set(t, 2, _EMPTY)
    PyObject_GC_UnTrack(<void*>t)  # ints and the shared empty properties: no cycle
    return t


cdef object _publish(object topic, object payload, unsigned int qos, object retain, object dup,
                     unsigned int pid, object props):
    """A `Publish` (a tuple subclass) allocated and filled in place: what tuple.__new__(Publish,
    (...)) makes, without the argument tuple, the call and the copy."""
    cdef PyTypeObject* tp = <PyTypeObject*>_Publish
    cdef object t = tp.tp_alloc(tp, 7)
    _set(t, 0, topic)
    _set(t, 1, payload)
    _set(t, 2, qos)
    _set(t, 3, retain)
    _set(t, 4, dup)
    _set(t, 5, pid)
    _set(t, 6, props)
    return t


def walk(object parser, bytes buf, list out):
    """Walk `buf`, appending packets to `out`; return the index of the unparsed tail."""
    cdef const unsigned char* b = <const unsigned char*>PyBytes_AS_STRING(buf)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(buf), pos = 0, s, end, i, p, rl, shift, maxsize
    cdef unsigned int b0, x, t, qos, pid
    cdef object version = parser.version
    cdef int ver = -1 if version is None else <int>version
    maxsize = parser.max_packet_size
    cdef bint strict = parser.strict_utf8
    cdef dict cache = _strict_cache if strict else _lax_cache
    cdef object topic, tb, props, pkt, decode, payload
    # The last topic's bytes and str: a chunk's PUBLISHes mostly repeat one topic (a device's),
    # compared in place instead of a bytes object and a dict lookup per message.
    cdef object last_topic = None
    cdef const unsigned char* last_tb = NULL
    cdef Py_ssize_t last_len = 0
    while n - pos >= 2:
        b0 = b[pos]
        rl = b[pos + 1]
        if rl < 0x80:
            s = pos + 2
        else:
            rl &= 0x7F
            i = pos + 2
            shift = 7
            while True:
                if i >= n:
                    return pos  # varint incomplete
                x = b[i]
                rl |= (<Py_ssize_t>(x & 0x7F)) << shift
                i += 1
                if not x & 0x80:
                    if not x:
                        raise _E("remaining length not minimally encoded")
                    break
                if i - pos >= 5:
                    raise _E("remaining length longer than 4 bytes")
                shift += 7
            s = i
        end = s + rl
        if end - pos > maxsize:
            raise _E(f"packet of {end - pos} bytes > maximum packet size {maxsize}", 0x95)
        if end > n:
            if end - pos > 65536:  # large and incomplete: gather chunks, join once
                parser._need = end - pos
            return pos
        t = b0 >> 4
        if t == 3:
            if ver < 0:
                raise _E("PUBLISH before CONNECT", 0x82)
            qos = (b0 >> 1) & 3
            if s + 2 > end:
                raise _E("PUBLISH ends before the topic name")
            p = s + 2 + ((b[s] << 8) | b[s + 1])
            if p > end:
                raise _E("PUBLISH topic runs past the end of the packet")
            if p - s - 2 == last_len and last_len and memcmp(b + s + 2, last_tb, last_len) == 0:
                topic = last_topic
            else:
                tb = PyBytes_FromStringAndSize(<const char*>(b + s + 2), p - s - 2)
                topic = cache.get(tb)
                if topic is None:
                    if p > s + 2:
                        topic = _topic(tb, strict)
                    elif ver == 5:
                        topic = ""
                    else:
                        raise _E("empty topic name", 0x90)
                last_topic = topic
                last_tb = b + s + 2
                last_len = p - s - 2
            if qos:
                if qos == 3:
                    raise _E("PUBLISH QoS 3 [MQTT-3.3.1-4]")
                if p + 2 > end:
                    raise _E("PUBLISH ends before the packet id")
                pid = (b[p] << 8) | b[p + 1]
                if not pid:
                    raise _E("PUBLISH packet id 0 [MQTT-2.2.1-3]")
                p += 2
            else:
                pid = 0
                if b0 & 8:
                    raise _E("DUP set on a QoS 0 PUBLISH [MQTT-3.3.1-2]")
            if ver == 5:
                if p < end and not b[p]:  # empty property block, the common case
                    props = _EMPTY
                    p += 1
                else:
                    props, p = decode_properties(buf, p, end, 3, strict)
                if not topic and props.topic_alias is None:
                    raise _E("empty topic name without topic alias", 0x82)
            else:
                props = _EMPTY
            payload = PyBytes_FromStringAndSize(<const char*>(b + p), end - p)
            pkt = _publish(topic, payload, qos, _T if b0 & 1 else _F, _T if b0 & 8 else _F,
                           pid, props)
            # Strings, bytes, ints and the properties: never in a reference cycle, so the
            # cyclic GC need not scan it (one per message: most of what its young
            # collections walked in fan-in; CPython untracks such tuples itself, but only
            # once a collection has scanned them).
            PyObject_GC_UnTrack(<void*>pkt)
            out.append(pkt)
        else:
            decode = _decoders.get(t)
            if decode is None or (t == 15 and ver != 5):
                raise _E(f"reserved packet type {t}")
            if b0 & 0x0F != _flags_for[t]:
                raise _E(f"reserved flags 0x{b0 & 0x0F:X} on packet type {t} [MQTT-2.2.2-2]")
            if ver < 0:
                if t != 1:
                    raise _E(f"packet type {t} before CONNECT", 0x82)
                pkt = decode(b0, buf, s, end, 0, strict)
                version = parser.version = pkt.protocol_level
                ver = <int>version
            elif t == 4 and end - s == 2 and (b[s] or b[s + 1]):
                # The plain PUBACK (no reason code, nonzero id) of a QoS 1 subscriber: what
                # the decoder makes of it, allocated in place.
                pkt = _puback((b[s] << 8) | b[s + 1])
            else:
                pkt = decode(b0, buf, s, end, ver, strict)
            out.append(pkt)
        pos = end
    return pos
