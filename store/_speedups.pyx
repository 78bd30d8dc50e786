# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled hot loops of the store side of MQTT fan-in (the pure-Python twins are the reference).

Built at install time (setup.py, optional: a machine without a C compiler gets the pure-Python
path); `LIGHTGATE_NO_EXTENSIONS=1` makes `store.speedups.load` ignore it. Each function here has
a pure-Python twin with the same signature and results, and the tests run both:

* `build_records` - `store.mqtt_batches._build_records_py`: one uncompressed RecordBatch v2 of
  MQTT messages (the bytes aiokafka's builder and `record_batch.build_batch` write);
* `index_batch` - `lightqueue.dispatcher._index_batch_py`: the dispatcher's per-record loop over
  one uncompressed batch (offset and key only; values and headers are skipped, not decoded),
  appending each entry to its queue's round buffer (`lightqueue/_cblocks.pyx` writes and reads
  the blocks);
* `murmur2` - `store.mapping.murmur2_py`: Kafka's key hash (a device event per connect and
  disconnect is partitioned by client id);
* `decode_records` - `lightqueue.resolver._decode_records_py`: the records of one uncompressed
  batch, the two headers of a plain MQTT PUBLISH read in place;
* `untrack` - no twin (Python cannot untrack an object; the collector just does more work).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bytearray cimport (
    PyByteArray_AS_STRING,
    PyByteArray_FromStringAndSize,
    PyByteArray_GET_SIZE,
    PyByteArray_Resize,
)
from cpython.unicode cimport PyUnicode_AsUTF8String
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy

from cpython.object cimport PyObject

from store._slots cimport message_slots

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)
    bint PyObject_GC_IsTracked(object op)

import crc32c as _crc32c

from store.mapping import headers_for as _headers_for

cdef object _crc = _crc32c.crc32c
cdef object _QOS_B = (b"0", b"1", b"2")
cdef bytes _H_QOS = b"mqtt.qos"
cdef bytes _H_CID = b"mqtt.client_id"

DEF HEADER_SIZE = 61
DEF ATTRIBUTES_OFFSET = 21


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
    cdef int i
    for i in range(n - 1, -1, -1):
        p[i] = <uint8_t>(v & 0xFF)
        v >>= 8
    return p + n


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


# --- indexing -----------------------------------------------------------------------------------

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


# --- Kafka's murmur2 --------------------------------------------------------------------------

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


# --- reading ------------------------------------------------------------------------------------

cdef bytes _H_QOS_NAME = b"mqtt.qos"
cdef bytes _H_CID_NAME = b"mqtt.client_id"


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


def decode_records(const uint8_t[::1] data, Py_ssize_t pos, Py_ssize_t size, int64_t lat,
                   int64_t lo=-1, int64_t hi=0x7FFFFFFFFFFFFFFF):
    """The records of the uncompressed batch at `data[pos:pos+size]` with offsets in [lo, hi],
    as tuples (offset, key, value, timestamp, qos, client id, headers): a record with exactly
    the two headers of a plain MQTT PUBLISH (mqtt.qos "0"-"2", mqtt.client_id not null) has its
    QoS and client id bytes and headers None; any other has qos -1, client id None and its
    headers as [(name str, value bytes | None)]. `lat` >= 0 (LogAppendTime) is every record's
    timestamp. Records before `lo` are stepped over by their length, none after `hi` is read: a
    reader far behind wants a few hundred records of a batch of thousands
    (docs/performance-history.md).
    Raises ValueError for records that do not parse; nothing is returned then."""
    cdef const uint8_t* b = &data[0]
    cdef Py_ssize_t bend = pos + size, q0 = pos + HEADER_SIZE, rec_end, hq
    cdef int64_t count, i, nh, h, base, first_ts, ts, off
    cdef object key, value, cid, hname, hval
    cdef list out = [], hl
    cdef int qos
    if size < HEADER_SIZE or bend > data.shape[0]:
        raise ValueError("batch runs past the buffer")
    base = 0
    first_ts = 0
    for i in range(8):
        base = (base << 8) | b[pos + i]
        first_ts = (first_ts << 8) | b[pos + 27 + i]
    count = _batch_count(b, pos)
    for i in range(count):
        rec_end = _record_end(b, &q0, bend)
        q0 += 1  # attributes
        ts = _vget(b, &q0, rec_end)
        off = base + _vget(b, &q0, rec_end)
        if off < lo:
            q0 = rec_end
            continue
        if off > hi:
            break
        key = _field(b, &q0, rec_end)
        value = _field(b, &q0, rec_end)
        nh = _vget(b, &q0, rec_end)
        if nh < 0:
            raise ValueError("negative header count")
        qos = -1
        cid = None
        hl = None
        if nh == 2:
            # The common case, read in place: b"mqtt.qos" + one digit, b"mqtt.client_id" + bytes.
            hq = q0
            if (_vget(b, &hq, rec_end) == 8 and hq + 8 <= rec_end
                    and memcmp(b + hq, PyBytes_AS_STRING(_H_QOS_NAME), 8) == 0):
                hq += 8
                if _vget(b, &hq, rec_end) == 1 and hq < rec_end and 0x30 <= b[hq] <= 0x32:
                    qos = b[hq] - 0x30
                    hq += 1
                    if (_vget(b, &hq, rec_end) == 14 and hq + 14 <= rec_end
                            and memcmp(b + hq, PyBytes_AS_STRING(_H_CID_NAME), 14) == 0):
                        hq += 14
                        cid = _field(b, &hq, rec_end)
                        if cid is not None:
                            q0 = hq
                    if cid is None:
                        qos = -1
        if qos < 0:
            hl = []
            for h in range(nh):
                hname = _field(b, &q0, rec_end)
                if hname is None:
                    raise ValueError("null header name")
                hval = _field(b, &q0, rec_end)
                hl.append(((<bytes>hname).decode("utf-8"), hval))
        if q0 != rec_end:
            raise ValueError("record length mismatch")
        out.append((off, key, value, lat if lat >= 0 else first_ts + ts, qos, cid, hl))
    return out



# --- the cyclic garbage collector ------------------------------------------------------------------



def untrack(list objs):
    """Take `objs` off the cyclic garbage collector's lists (see store.mapping.untrack_messages:
    only for objects that cannot be part of a reference cycle)."""
    cdef object o
    for o in objs:
        if PyObject_GC_IsTracked(o):
            PyObject_GC_UnTrack(<void*>o)
