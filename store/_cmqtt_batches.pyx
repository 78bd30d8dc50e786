# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled half of the MQTT batch builder (`store/mqtt_batches.py` holds the pure twins;
the tests run both):

* `build_records` - `_build_records_py`: one uncompressed RecordBatch v2 of MQTT messages (the
  bytes aiokafka's builder and `record_batch.build_batch` write), a message's fields read from
  its slots;
* `group_by_slot` - `group_by_slot_py`: an append's partition groups and each message's key.

Built at install time (setup.py, optional: a machine without a C compiler gets the pure-Python
path); `LIGHTGATE_NO_EXTENSIONS=1` makes `store.twins.twin` choose the twins. The record helpers
it shares with lightqueue's compiled readers are inline in `store/_records.pxd`.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bytearray cimport (
    PyByteArray_AS_STRING,
    PyByteArray_FromStringAndSize,
    PyByteArray_GET_SIZE,
    PyByteArray_Resize,
)
from cpython.unicode cimport PyUnicode_AsUTF8String
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

from cpython.object cimport PyObject

from store._records cimport ATTRIBUTES_OFFSET, HEADER_SIZE, _be
from store._slots cimport message_slots

import crc32c as _crc32c

from store.mapping import headers_for as _headers_for

cdef object _crc = _crc32c.crc32c
cdef object _QOS_B = (b"0", b"1", b"2")
cdef bytes _H_QOS = b"mqtt.qos"
cdef bytes _H_CID = b"mqtt.client_id"


# --- varints (zig-zag, as Kafka's records) ----------------------------------------------------

cdef inline Py_ssize_t _vsize(int64_t value) noexcept:
    cdef uint64_t v = <uint64_t>((value << 1) ^ (value >> 63))
    cdef Py_ssize_t n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


cdef inline uint8_t* _vput(uint8_t* p, int64_t value) noexcept:
    cdef uint64_t v = <uint64_t>((value << 1) ^ (value >> 63))
    while v >= 0x80:
        p[0] = <uint8_t>((v & 0x7F) | 0x80)
        p += 1
        v >>= 7
    p[0] = <uint8_t>v
    return p + 1


# --- building -----------------------------------------------------------------------------------

cdef inline Py_ssize_t _hsize(list hl):
    cdef Py_ssize_t body = _vsize(len(hl)), hsz
    cdef object h
    for h in hl:
        hsz = PyBytes_GET_SIZE(h[0])
        body += _vsize(hsz) + hsz
        if h[1] is None:
            body += 1
        else:
            hsz = PyBytes_GET_SIZE(h[1])
            body += _vsize(hsz) + hsz
    return body


cdef inline uint8_t* _bput(uint8_t* p, bytes b) noexcept:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    p = _vput(p, n)
    memcpy(p, PyBytes_AS_STRING(b), n)
    return p + n


cdef inline bint _slots_set(char* mb, Py_ssize_t* off) noexcept:
    """Every field slot of the message at `mb` holds a value (an unset one: read by attribute,
    which raises as the pure path does)."""
    cdef int i
    for i in range(1, 7):
        if (<PyObject**>(mb + off[i]))[0] is NULL:
            return False
    return True


def group_by_slot(object messages, object route):
    """`mqtt_batches.group_by_slot_py`, compiled: the partition groups of an append (slot ->
    indexes into `messages`, in order) and each message's key. Routes once per topic; a run of
    one topic (a device's messages, as read) costs no dict lookup."""
    cdef dict groups = {}, seen = {}
    cdef list keys = [], g
    cdef tuple e = None
    cdef list ms = messages if type(messages) is list else list(messages)
    cdef Py_ssize_t i, n = len(ms)
    cdef object m, topic, last = None, mtype = None
    cdef Py_ssize_t* off = NULL
    cdef PyObject* t
    for i in range(n):
        m = ms[i]
        if type(m) is not mtype:
            mtype = type(m)
            off = message_slots(mtype)
        t = NULL
        if off is not NULL:
            t = (<PyObject**>(<char*><PyObject*>m + off[0]))[0]
        topic = <object>t if t is not NULL else m.topic
        if topic is not last:
            e = seen.get(topic)
            if e is None:  # route once per topic and call (devices repeat their topics)
                slot, key = route(topic)
                g = groups.get(slot)
                if g is None:
                    g = groups[slot] = []
                e = seen[topic] = (key, g)
            last = topic
        keys.append(e[0])
        (<list>e[1]).append(i)
    return groups, keys


def build_records(object messages, list idxs, Py_ssize_t j0, list keys, int64_t now_ms,
                  dict cids, Py_ssize_t max_bytes):
    """Build one batch of `messages[idxs[j]]` for j from j0 while under `max_bytes`.

    Returns (batch bytearray, j after the last message taken, max timestamp). One pass into a
    growing C buffer; no Python object per record but the ones read from the message."""
    cdef Py_ssize_t total = len(idxs), j = j0, nbytes = 0, body, cap = 65536, used = HEADER_SIZE
    cdef Py_ssize_t i, need
    cdef int64_t ts, first_ts = 0, max_ts = 0, delta, klen, vlen
    cdef object m, key, payload, cid, h, qb, out, crc, qos, client_id, retain, props, ts_obj
    cdef object mtype = None
    cdef Py_ssize_t* off = NULL
    cdef char* mb
    cdef list hl
    cdef uint8_t* buf = <uint8_t*>malloc(cap)
    cdef uint8_t* p
    cdef uint8_t* nb
    if buf == NULL:
        raise MemoryError()
    try:
        while j < total and nbytes < max_bytes:
            i = idxs[j]
            m = messages[i]
            if type(m) is not mtype:
                mtype = type(m)
                off = message_slots(mtype)
            if off is not NULL and _slots_set(<char*><PyObject*>m, off):
                # read in place (a generic getattr per field was ~40 % of this loop)
                mb = <char*><PyObject*>m
                payload = <object>(<PyObject**>(mb + off[1]))[0]
                qos = <object>(<PyObject**>(mb + off[2]))[0]
                client_id = <object>(<PyObject**>(mb + off[3]))[0]
                retain = <object>(<PyObject**>(mb + off[4]))[0]
                props = <object>(<PyObject**>(mb + off[5]))[0]
                ts_obj = <object>(<PyObject**>(mb + off[6]))[0]
            else:
                payload = m.payload
                qos = m.qos
                client_id = m.client_id
                retain = m.retain
                props = m.properties
                ts_obj = m.timestamp_ms
            ts = ts_obj or now_ms
            if j == j0:
                first_ts = ts
            if ts > max_ts:
                max_ts = ts
            key = keys[i]
            if type(payload) is not bytes:
                payload = bytes(payload)
            hl = None
            if props is None and not retain:
                cid = cids.get(client_id)
                if cid is None:
                    cid = cids[client_id] = PyUnicode_AsUTF8String(client_id)
                qb = _QOS_B[qos]
                # 2 headers: mqtt.qos (8 bytes), mqtt.client_id (14 bytes)
                need = 1 + 1 + 8 + 1 + 1 + 1 + 14 + _vsize(PyBytes_GET_SIZE(cid))
                need += PyBytes_GET_SIZE(cid)
            else:
                hl = [(PyUnicode_AsUTF8String(h[0]), h[1]) for h in _headers_for(m)]
                need = _hsize(hl)
            delta = ts - first_ts
            klen = -1 if key is None else PyBytes_GET_SIZE(key)
            vlen = PyBytes_GET_SIZE(payload)
            body = 1 + _vsize(delta) + _vsize(j - j0) + _vsize(klen) + (klen if klen > 0 else 0)
            body += _vsize(vlen) + vlen + need
            if used + body + 10 > cap:
                while used + body + 10 > cap:
                    cap *= 2
                nb = <uint8_t*>realloc(buf, cap)
                if nb == NULL:
                    raise MemoryError()
                buf = nb
            p = _vput(buf + used, body)
            p[0] = 0
            p = _vput(p + 1, delta)
            p = _vput(p, j - j0)
            if key is None:
                p = _vput(p, -1)
            else:
                p = _bput(p, key)
            p = _bput(p, payload)
            if hl is None:
                p = _vput(p, 2)
                p = _bput(p, _H_QOS)
                p = _bput(p, qb)
                p = _bput(p, _H_CID)
                p = _bput(p, cid)
            else:
                p = _vput(p, len(hl))
                for h in hl:
                    p = _bput(p, h[0])
                    if h[1] is None:
                        p = _vput(p, -1)
                    else:
                        p = _bput(p, h[1])
            used = p - buf
            nbytes += vlen + (klen if klen > 0 else 0) + 40
            j += 1
        count = j - j0
        p = buf
        p = _be(p, 0, 8)  # base offset
        p = _be(p, <uint64_t>(used - 12), 4)  # batch length
        p = _be(p, <uint64_t>-1, 4)  # partition leader epoch
        p[0] = 2  # magic
        p += 1
        p = _be(p, 0, 4)  # crc, below
        p = _be(p, 0, 2)  # attributes
        p = _be(p, <uint64_t>(count - 1), 4)  # last offset delta
        p = _be(p, <uint64_t>first_ts, 8)
        p = _be(p, <uint64_t>max_ts, 8)
        p = _be(p, <uint64_t>-1, 8)  # producer id
        p = _be(p, 0xFFFF, 2)  # producer epoch
        p = _be(p, <uint64_t>-1, 4)  # base sequence
        p = _be(p, <uint64_t>count, 4)
        out = PyByteArray_FromStringAndSize(<char*>buf, used)
    finally:
        free(buf)
    crc = _crc(memoryview(out)[ATTRIBUTES_OFFSET:])
    _be(<uint8_t*>PyByteArray_AS_STRING(out) + 17, <uint64_t>crc, 4)
    return out, j, max_ts
