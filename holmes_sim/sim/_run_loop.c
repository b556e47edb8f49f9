/* The inner loop of `holmes_sim.sim.environment.CountingEnvironment.run_until` in C: it takes
 * one calendar bucket's events in order, as the Python loop does (the same callbacks in the
 * same order, the same stops), without the interpreter's bytecode per event. Optional:
 * `environment.py` runs the Python loop when this extension was not built.
 *
 * take(bucket, ahead, counter) -> None or a failed event
 *   bucket:  list of events, taken from its start; events appended meanwhile are taken too
 *   ahead:   list; when it is not empty after an event, it is cleared and the loop stops
 *   counter: list whose item 0 (an int) is increased by the events taken
 * Per event: its `callbacks` are read and set to None, then each is called with the event;
 * an event whose `_ok` is false and that has no `_defused` stops the loop and is returned (the
 * caller raises its failure). The events taken leave the bucket, also when a callback raises.
 *
 * ABI: this interface's version, the module's `ABI`. `environment.py` uses the module only where
 * its `RUN_LOOP_ABI` is the same, else runs its Python code: a build left in place from other
 * sources is never called. Bump both when the interface changes: a function's or type's
 * arguments, results or meaning, or what it reads or sets on the objects given.
 */
#define ABI 1
#ifndef SOURCE_SHA256  /* setup.py defines it: this file's SHA-256, the module's
                          `SOURCE_SHA256` (`version.extension` compares the two) */
#define SOURCE_SHA256 ""
#endif
#include "_slots.h"

static PyObject *str_callbacks, *str_ok, *str_defused;

/* Slot offsets of `callbacks` and `_ok` for the last few types seen (0: not a plain slot). */
#define CACHE 8
static struct {
    PyTypeObject *type;  /* a strong reference, so that its address is not reused */
    Py_ssize_t callbacks, ok;
} cache[CACHE];
static int cache_next;

static int cache_last;  /* the entry found last (most events are of one type) */

static int lookup_slow(PyTypeObject *type);

static inline int lookup(PyTypeObject *type) {
    return cache[cache_last].type == type ? cache_last : (cache_last = lookup_slow(type));
}

static int lookup_slow(PyTypeObject *type) {
    for (int i = 0; i < CACHE; i++)
        if (cache[i].type == type)
            return i;
    int i = cache_next;
    cache_next = (cache_next + 1) % CACHE;
    Py_XDECREF(cache[i].type);
    Py_INCREF(type);
    cache[i].type = type;
    cache[i].callbacks = slot_offset(type, str_callbacks);
    cache[i].ok = slot_offset(type, str_ok);
    return i;
}

/* event.callbacks, set to None (a new reference, or NULL with an error). */
static PyObject *take_callbacks(PyObject *event, Py_ssize_t offset) {
    if (offset) {
        PyObject **slot = (PyObject **)((char *)event + offset);
        PyObject *callbacks = *slot;
        if (callbacks == NULL) {
            PyErr_SetObject(PyExc_AttributeError, str_callbacks);
            return NULL;
        }
        Py_INCREF(Py_None);
        *slot = Py_None;  /* the slot's reference moves to the caller */
        return callbacks;
    }
    PyObject *callbacks = PyObject_GetAttr(event, str_callbacks);
    if (callbacks != NULL && PyObject_SetAttr(event, str_callbacks, Py_None) < 0)
        Py_CLEAR(callbacks);
    return callbacks;
}

static int call_each(PyObject *callbacks, PyObject *event) {
    if (PyList_CheckExact(callbacks)) {  /* by index: it may grow while it is called */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(callbacks); i++) {
            PyObject *callback = PyList_GET_ITEM(callbacks, i);
            Py_INCREF(callback);
            PyObject *r = PyObject_CallOneArg(callback, event);
            Py_DECREF(callback);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
        }
        return 0;
    }
    PyObject *it = PyObject_GetIter(callbacks), *callback;
    if (it == NULL)
        return -1;
    while ((callback = PyIter_Next(it)) != NULL) {
        PyObject *r = PyObject_CallOneArg(callback, event);
        Py_DECREF(callback);
        if (r == NULL) {
            Py_DECREF(it);
            return -1;
        }
        Py_DECREF(r);
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

/* 1 if the event failed and nothing defused it, 0 if not, -1 on an error. */
static int failed(PyObject *event, Py_ssize_t offset) {
    int ok;
    if (offset) {
        PyObject *value = *(PyObject **)((char *)event + offset);
        if (value == Py_True)
            return 0;
        if (value == NULL) {
            PyErr_SetObject(PyExc_AttributeError, str_ok);
            return -1;
        }
        ok = PyObject_IsTrue(value);
    } else {
        PyObject *value = PyObject_GetAttr(event, str_ok);
        if (value == NULL)
            return -1;
        ok = PyObject_IsTrue(value);
        Py_DECREF(value);
    }
    if (ok)
        return ok < 0 ? -1 : 0;
    int defused = PyObject_HasAttr(event, str_defused);
    return !defused;
}

/* Take events from the bucket's start; the number taken in *taken; the failed event (a new
 * reference) in *failure. 0, or -1 with an error. */
static int run(PyObject *bucket, PyObject *ahead, Py_ssize_t *taken, PyObject **failure) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bucket); i++) {
        PyObject *event = PyList_GET_ITEM(bucket, i);
        Py_INCREF(event);
        *taken = i + 1;
        int c = lookup(Py_TYPE(event));
        PyObject *callbacks = take_callbacks(event, cache[c].callbacks);
        if (callbacks == NULL) {
            Py_DECREF(event);
            return -1;
        }
        int status;
        if (PyTuple_CheckExact(callbacks) && PyTuple_GET_SIZE(callbacks) == 0) {
            status = 0;  /* none to call */
        } else if ((PyList_CheckExact(callbacks) && PyList_GET_SIZE(callbacks) == 1) ||
                (PyTuple_CheckExact(callbacks) && PyTuple_GET_SIZE(callbacks) == 1)) {
            PyObject *callback = PySequence_Fast_GET_ITEM(callbacks, 0);
            Py_INCREF(callback);
            PyObject *r = PyObject_CallOneArg(callback, event);
            Py_DECREF(callback);
            status = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        } else {
            status = call_each(callbacks, event);
        }
        Py_DECREF(callbacks);
        if (status == 0) {
            c = lookup(Py_TYPE(event));
            status = failed(event, cache[c].ok);
        }
        if (status != 0) {
            if (status > 0)
                *failure = event;
            else
                Py_DECREF(event);
            return status > 0 ? 0 : -1;
        }
        Py_DECREF(event);
        if (!PyList_CheckExact(ahead)) {
            PyErr_SetString(PyExc_TypeError, "take: ahead must be a list");
            return -1;
        }
        if (PyList_GET_SIZE(ahead)) {
            return PyList_SetSlice(ahead, 0, PyList_GET_SIZE(ahead), NULL);
        }
    }
    return 0;
}

static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
            !PyList_CheckExact(args[2]) || PyList_GET_SIZE(args[2]) != 1) {
        PyErr_SetString(PyExc_TypeError, "take(bucket, ahead, counter): three lists expected");
        return NULL;
    }
    PyObject *bucket = args[0], *counter = args[2], *failure = NULL;
    Py_INCREF(bucket);
    Py_ssize_t taken = 0;
    int status = run(bucket, args[1], &taken, &failure);
    PyObject *type, *value, *traceback;  /* the events taken leave the bucket, also on an error */
    PyErr_Fetch(&type, &value, &traceback);
    int kept = PyList_SetSlice(bucket, 0, taken, NULL);
    PyObject *count = PyLong_FromSsize_t(taken), *total = NULL;
    if (count != NULL) {
        total = PyNumber_Add(PyList_GET_ITEM(counter, 0), count);
        Py_DECREF(count);
    }
    if (total != NULL)
        PyList_SetItem(counter, 0, total);  /* steals total */
    Py_DECREF(bucket);
    if (status < 0 || type != NULL) {
        Py_XDECREF(failure);
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    if (kept < 0 || total == NULL) {
        Py_XDECREF(failure);
        return NULL;
    }
    if (failure != NULL)
        return failure;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(bucket, ahead, counter): process a calendar bucket's events in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_run_loop",
                                    "The calendar's run loop in C.", -1, methods};

PyMODINIT_FUNC PyInit__run_loop(void) {
    str_callbacks = PyUnicode_InternFromString("callbacks");
    str_ok = PyUnicode_InternFromString("_ok");
    str_defused = PyUnicode_InternFromString("_defused");
    if (str_callbacks == NULL || str_ok == NULL || str_defused == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI", ABI) < 0
                  || PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0))
        Py_CLEAR(m);
    return m;
}
