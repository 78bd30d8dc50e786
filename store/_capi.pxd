# CPython C-API declarations the compiled hot loops share (declarations only, nothing to
# build): one place instead of the same extern block at the top of each module. Each module
# cimports the names it uses.
from cpython.object cimport PyObject


cdef extern from "Python.h":
    int PyDict_Next(object d, Py_ssize_t* pos, PyObject** key, PyObject** value)
    Py_ssize_t PyLong_AsSsize_t(object o) except? -1
    const char* PyUnicode_AsUTF8AndSize(object s, Py_ssize_t* size) except NULL
    void PyObject_GC_UnTrack(void* op)
    Py_ssize_t PyUnicode_GET_LENGTH(object s)
    Py_UCS4 PyUnicode_READ_CHAR(object s, Py_ssize_t i)
    # tp_alloc of an exact tuple or slotted type, without its __new__ (the objects are filled in
    # place); under its own name, so modules that cimport cpython's PyTypeObject do not clash.
    ctypedef struct _AllocType "PyTypeObject":
        object (*tp_alloc)(_AllocType*, Py_ssize_t)
