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

#endif
