from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF

# The slot-offset reader shared by the compiled modules that fill dataclass slots in place
# (mqtt_proxy's _cqueue_cache, _chandlers and _cqos1_run, lightqueue/_cresolve.pyx,
# store/_cmqtt_batches.pyx): all may import store, not each other.
cdef bint learn_slots(type cls, tuple fields, Py_ssize_t* off, bint prefix=*) except -1
# The slot offsets of a MqttMessage-like class's first fields (MESSAGE_FIELDS), or NULL.
cdef Py_ssize_t* message_slots(type cls) except? NULL


# One slot of the object at `base` set to `v` (a new reference), as __init__ would.
cdef inline void put_slot(char* base, Py_ssize_t off, object v) noexcept:
    Py_INCREF(v)
    (<PyObject**>(base + off))[0] = <PyObject*>v
