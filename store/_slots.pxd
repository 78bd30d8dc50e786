# The slot-offset reader shared by the compiled modules that fill dataclass slots in place
# (mqtt_proxy/_cdelivery.pyx, lightqueue/_cresolve.pyx, store/_speedups.pyx): both may import store, not each other.
cdef bint learn_slots(type cls, tuple fields, Py_ssize_t* off, bint prefix=*) except -1
# The slot offsets of a MqttMessage-like class's first fields (MESSAGE_FIELDS), or NULL.
cdef Py_ssize_t* message_slots(type cls) except? NULL
