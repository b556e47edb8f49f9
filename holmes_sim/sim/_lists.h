/* List items read and replaced at a position, as Python indexes a list, for the engine's C
 * code that keeps per-message lists (`_pipeline_messages.c`, `_entity_steps.c`). */
#ifndef HOLMES_SIM_LISTS_H
#define HOLMES_SIM_LISTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* 0 if 0 <= i < len(list), else -1 with an IndexError. */
static inline int check_index(PyObject *list, Py_ssize_t i) {
    if (i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return -1;
    }
    return 0;
}

/* The position of item `k` (an int, negative from the end) of `list`, or -1 with an error. */
static inline Py_ssize_t position(PyObject *list, PyObject *k) {
    Py_ssize_t i = PyNumber_AsSsize_t(k, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred())
        return -1;
    if (i < 0)
        i += PyList_GET_SIZE(list);
    return check_index(list, i) < 0 ? -1 : i;
}

/* list[i] = value (borrowed; i a valid position). */
static inline void store(PyObject *list, Py_ssize_t i, PyObject *value) {
    PyObject *old = PyList_GET_ITEM(list, i);
    Py_INCREF(value);
    PyList_SET_ITEM(list, i, value);
    Py_XDECREF(old);
}

#endif
