# cython: language_level=3
"""Where a slots dataclass keeps each field, for compiled code that fills or reads the slots
directly instead of calling __init__ or getattr (a message object per delivered message: the
dataclass __init__ and seven attribute reads were most of their cost; docs/performance-history.md).
`learn_slots` is cimported by mqtt_proxy's compiled modules and lightqueue._cresolve
(store.speedups explains the extensions); it has no pure twin: without it those modules are not
used.
"""


cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        Py_ssize_t offset

cdef extern from "Python.h":
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member


cdef bint learn_slots(type cls, tuple fields, Py_ssize_t* off, bint prefix=False) except -1:
    """Read the slot offsets of `cls` into `off` (a dataclass with slots=True and exactly
    `fields`, nothing run at __init__ but the assignments); False: construct by calling `cls`.
    `prefix`: only read, so `fields` need only be its first fields and __init__ may do more."""
    import dataclasses
    import types
    if not dataclasses.is_dataclass(cls) or (not prefix and hasattr(cls, "__post_init__")):
        return False
    names = tuple(f.name for f in dataclasses.fields(cls))
    if (names[:len(fields)] if prefix else names) != fields:
        return False
    for i, name in enumerate(fields):
        d = cls.__dict__.get(name)
        if type(d) is not types.MemberDescriptorType:  # a slot of this very class
            return False
        off[i] = (<PyMemberDescrObject*>d).d_member.offset
    return True


# MqttMessage's fields, in __init__'s order: `_chandlers.publish_messages` fills their slots in
# place; `_cqueue_cache.fill_cache` and `_cmqtt_batches.build_records` read them in place from a
# MqttMessage or a StoredMessage (whose first fields they are): seven attribute lookups were half
# of fill_cache's time per message, and of build_records' (a generic getattr each).
MESSAGE_FIELDS = ("topic", "payload", "qos", "client_id", "retain", "properties", "timestamp_ms")
cdef Py_ssize_t _roff[2][7]
cdef object _rcls0 = None, _rcls1 = None  # the classes whose offsets _roff holds
cdef set _rno = set()  # classes read by attribute (not a slots dataclass with these fields)


cdef Py_ssize_t* message_slots(type cls) except? NULL:
    """The slot offsets of `cls`'s first fields (MESSAGE_FIELDS), or NULL: read by attribute."""
    global _rcls0, _rcls1
    if cls is _rcls0:
        return _roff[0]
    if cls is _rcls1:
        return _roff[1]
    if cls not in _rno:
        if _rcls0 is None and learn_slots(cls, MESSAGE_FIELDS, _roff[0], True):
            _rcls0 = cls
            return _roff[0]
        if (_rcls0 is not None and _rcls1 is None
                and learn_slots(cls, MESSAGE_FIELDS, _roff[1], True)):
            _rcls1 = cls
            return _roff[1]
        _rno.add(cls)
    return NULL
