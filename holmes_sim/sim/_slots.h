/* Slot offsets of Python classes with `__slots__`, shared by the engine's C loops
 * (`_run_loop.c`, `_agenda_entries.c`): reading a slot at its offset skips the attribute
 * look-up, as CPython's member descriptors do. */
#ifndef HOLMES_SIM_SLOTS_H
#define HOLMES_SIM_SLOTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* The offset of `type`'s writable object slot `name`, or 0 where it is not one. */
static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *descr = _PyType_Lookup(type, name);
    if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY))
            return m->offset;
    }
    return 0;
}

/* obj.<name> (a new reference, or NULL with an error), read at its slot's offset where `obj`
 * is of the type `*type` last seen here (`*offset` its slot's offset, 0 where it is not a
 * slot; both kept by the caller and updated for a new type), else by attribute look-up. */
static inline PyObject *slot_value(PyObject *obj, PyObject *name, PyTypeObject **type,
                                   Py_ssize_t *offset) {
    if (Py_TYPE(obj) != *type) {
        Py_INCREF(Py_TYPE(obj));  /* a strong reference, so that its address is not reused */
        Py_XDECREF(*type);
        *type = Py_TYPE(obj);
        *offset = slot_offset(*type, name);
    }
    if (*offset) {
        PyObject *value = *(PyObject **)((char *)obj + *offset);
        if (value == NULL)
            PyErr_SetObject(PyExc_AttributeError, name);
        Py_XINCREF(value);
        return value;
    }
    return PyObject_GetAttr(obj, name);
}

#endif
