/* The common op of an entity's schedule (`holmes_sim.sim.engine._Simulation._entity`) in C:
 * its input's receive and wait with their rows, one compute timeout, its rows and its send,
 * step after step, the same stores, calls and rows in the same order as the Python loop,
 * resumed by its events without a Python frame. Optional: the engine runs the Python loop
 * when this extension was not built.
 *
 * Steps(env, steps, durations, routes, base, messages, rows, ids, events, send, codes)
 *   env:       the `CountingEnvironment` (its `_now`, `normal` buckets and `new_bucket`)
 *   steps:     the stage's steps (`_stage_steps`), 9-tuples; durations: (compute s, TP s)
 *              pairs; routes: the sends' routes; base: what the replica adds to message ids
 *   messages:  (state, arrival, sent_at, POSTED, send, post) of `PipelineMessages`
 *   rows:      the trace's bytearray; ids: (entity index, stream index) of its compute rows
 *   events:    (compute event, input event): fired slotted events it reuses
 *   send:      the process generator's `send`, resumed with a step's index (or -1) where the
 *              steps reach an op they leave to it (a special op) or their end
 *   codes:     kind codes (bubble, wait-pp, TP)
 * Steps.go() runs from the current step: None when it waits (the generator then yields
 * `environment.DETACHED`), else the index of the special op it left (the steps go on after
 * it), or -1 at the end. A Steps object is the callback of the events it waits for.
 *
 * ABI: this interface's version, the module's `ABI`. `entity_steps.py` uses the module only
 * where its `ENTITY_STEPS_ABI` is the same, else runs its Python code: a build left in place
 * from other sources is never called. Bump both when the interface changes: a function's or
 * type's arguments, results or meaning, or what it reads or sets on the objects given.
 */
#define ABI 1
#ifndef SOURCE_SHA256  /* setup.py defines it: this file's SHA-256, the module's
                          `SOURCE_SHA256` (`version.extension` compares the two) */
#define SOURCE_SHA256 ""
#endif
#include "_slots.h"
#include "_rows.h"
#include "_lists.h"

enum { IDLE, INPUT, COMPUTE };

typedef struct {
    PyObject_HEAD
    PyObject *env, *steps, *durations, *routes, *state, *arrival, *sent_at, *posted, *send_msg,
        *post_msg, *rows, *eid, *cst, *timeout, *waiter, *gen_send, *bubble, *wait_pp, *tp_code,
        *calendar, *new_bucket, *resume, *t0, *start;
    Py_ssize_t base, i, k;
    int phase;
    vectorcallfunc vectorcall;
} Steps;

#define N_FIELDS 24
static PyObject *str_now, *str_normal, *str_new_bucket, *str_callbacks, *zero_f;
static PyTypeObject *event_type;  /* the last event type seen, and its `callbacks` slot offset */
static Py_ssize_t callbacks_offset;
static PyTypeObject *env_type;  /* the last environment type seen, and its `_now` slot offset */
static Py_ssize_t now_offset;

static PyObject **fields(Steps *self) { return &self->env; }

static int traverse(Steps *self, visitproc visit, void *arg) {
    for (int i = 0; i < N_FIELDS; i++)
        Py_VISIT(fields(self)[i]);
    return 0;
}

static int clear(Steps *self) {
    for (int i = 0; i < N_FIELDS; i++)
        Py_CLEAR(fields(self)[i]);
    return 0;
}

static void dealloc(Steps *self) {
    PyObject_GC_UnTrack(self);
    clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* env._now (a new reference, or NULL with an error). */
static PyObject *now_of(Steps *self) {
    return slot_value(self->env, str_now, &env_type, &now_offset);
}

/* Whether `a` < `b` as Python compares them: 1, 0, or -1 with an error. */
static int less(PyObject *a, PyObject *b) {
    if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b))
        return PyFloat_AS_DOUBLE(a) < PyFloat_AS_DOUBLE(b);
    return PyObject_RichCompareBool(a, b, Py_LT);
}

/* a + b as Python adds them (a new reference, or NULL with an error). */
static PyObject *add(PyObject *a, PyObject *b) {
    if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b))
        return PyFloat_FromDouble(PyFloat_AS_DOUBLE(a) + PyFloat_AS_DOUBLE(b));
    return PyNumber_Add(a, b);
}

/* event.callbacks (borrowed, NULL with an error) and event.callbacks = value (0 or -1). */
static int learn_event(PyObject *event) {
    if (Py_TYPE(event) != event_type) {
        Py_INCREF(Py_TYPE(event));  /* a strong reference, so that its address is not reused */
        Py_XDECREF(event_type);
        event_type = Py_TYPE(event);
        callbacks_offset = slot_offset(event_type, str_callbacks);
    }
    return callbacks_offset != 0;
}

static int callbacks_are_none(PyObject *event) {
    if (learn_event(event)) {
        PyObject *value = *(PyObject **)((char *)event + callbacks_offset);
        if (value == NULL) {
            PyErr_SetObject(PyExc_AttributeError, str_callbacks);
            return -1;
        }
        return value == Py_None;
    }
    PyObject *value = PyObject_GetAttr(event, str_callbacks);
    Py_XDECREF(value);
    return value == NULL ? -1 : value == Py_None;
}

static int set_callbacks(PyObject *event, PyObject *value) {
    if (learn_event(event)) {
        PyObject **slot = (PyObject **)((char *)event + callbacks_offset), *old = *slot;
        Py_INCREF(value);
        *slot = value;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(event, str_callbacks, value);
}

/* Call `f` with message number `k` (and the other arguments); 0, or -1 with an error. */
static int call_with_id(PyObject *f, Py_ssize_t k, PyObject *const *more, Py_ssize_t n) {
    PyObject *id = PyLong_FromSsize_t(k);
    if (id == NULL)
        return -1;
    PyObject *args[4] = {id, n > 0 ? more[0] : NULL, n > 1 ? more[1] : NULL,
                         n > 2 ? more[2] : NULL};
    PyObject *r = PyObject_Vectorcall(f, args, 1 + n, NULL);
    Py_DECREF(id);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* A message id of a step's field (an int or None) plus `base`: 0 for None, 1, or -1. */
static int message_id(Steps *self, PyObject *field, Py_ssize_t *k) {
    if (field == Py_None)
        return 0;
    Py_ssize_t local = PyLong_AsSsize_t(field);
    if (local == -1 && PyErr_Occurred())
        return -1;
    *k = local + self->base;
    return 1;
}

/* The step's input: its receive posted, then consumed or waited for; 1 when it waits. */
static int take_input(Steps *self, PyObject *step) {
    Py_ssize_t k;
    int has = message_id(self, PyTuple_GET_ITEM(step, 0), &k);
    if (has <= 0)
        return has;
    if (check_index(self->state, k) < 0 || check_index(self->arrival, k) < 0 ||
            check_index(self->sent_at, k) < 0)
        return -1;
    if (PyList_GET_ITEM(self->state, k) == Py_None)
        store(self->state, k, self->posted);
    else if (call_with_id(self->post_msg, k, NULL, 0) < 0)  /* its send waiting, or posted early */
        return -1;
    PyObject *ev = PyList_GET_ITEM(self->arrival, k);
    if (ev != Py_None) {
        int arrived = callbacks_are_none(ev);
        if (arrived != 0) {  /* arrived (each is consumed once), or an error */
            if (arrived > 0) {
                store(self->arrival, k, Py_None);
                store(self->sent_at, k, Py_None);
            }
            return arrived < 0 ? -1 : 0;
        }
    } else {  /* not sent yet: its arrival event */
        ev = self->waiter;
        store(self->arrival, k, ev);
    }
    if (set_callbacks(ev, self->resume) < 0)
        return -1;
    Py_XSETREF(self->t0, now_of(self));
    if (self->t0 == NULL)
        return -1;
    self->k = k;
    self->phase = INPUT;
    return 1;
}

/* One row of `step` (t0 to t1, kind `code`) into `row`'s 8 fields (borrowed). */
static void row_of(Steps *self, PyObject *step, PyObject *t0, PyObject *t1, PyObject *code,
                   PyObject **row) {
    PyObject *fields[ROW_FIELDS] = {t0, t1, zero_f, self->eid, PyTuple_GET_ITEM(step, 2),
                                    PyTuple_GET_ITEM(step, 3), self->cst, code};
    memcpy(row, fields, sizeof fields);
}

/* The input arrived: its wait rows (bubble until sent, then wait-pp); 0 or -1. */
static int input_arrived(Steps *self, PyObject *step) {
    PyObject *now = now_of(self), *t0 = self->t0;
    if (now == NULL)
        return -1;
    PyObject *sent = PyList_GET_ITEM(self->sent_at, self->k);
    Py_INCREF(sent);
    store(self->arrival, self->k, Py_None);
    store(self->sent_at, self->k, Py_None);
    PyObject *split = t0;  /* max(sent, t0), then min(., now) */
    int status = 0, later;
    if (sent != Py_None && (later = less(sent, t0)) <= 0) {
        status = later;
        split = sent;
    }
    if (status == 0 && (later = less(now, split)) != 0) {
        status = later < 0 ? -1 : 0;
        split = now;
    }
    PyObject *row[ROW_FIELDS];
    int bubble = status < 0 ? -1 : less(t0, split);
    if (bubble > 0) {
        row_of(self, step, t0, split, self->bubble, row);
        bubble = append_rows(self->rows, row, 1);
    }
    int exposed = bubble < 0 ? -1 : less(split, now);
    if (exposed > 0) {
        row_of(self, step, split, now, self->wait_pp, row);
        exposed = append_rows(self->rows, row, 1);
    }
    Py_DECREF(sent);
    Py_DECREF(now);
    self->phase = IDLE;
    return exposed < 0 ? -1 : 0;
}

/* The op's compute: one timeout of its compute and TP seconds; 0 or -1. */
static int compute(Steps *self, PyObject *pair) {
    PyObject *busy = add(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)), *at = NULL;
    if (busy == NULL)
        return -1;
    Py_XSETREF(self->start, now_of(self));
    if (self->start == NULL || set_callbacks(self->timeout, self->resume) < 0 ||
            (at = add(self->start, busy)) == NULL) {
        Py_XDECREF(busy);
        Py_XDECREF(at);
        return -1;
    }
    Py_DECREF(busy);
    PyObject *bucket = PyDict_GetItemWithError(self->calendar, at);  /* borrowed */
    if (bucket != NULL)
        Py_INCREF(bucket);
    else if (!PyErr_Occurred())
        bucket = PyObject_CallOneArg(self->new_bucket, at);
    Py_DECREF(at);
    if (bucket == NULL)
        return -1;
    int status = PyList_CheckExact(bucket) ? PyList_Append(bucket, self->timeout) : -1;
    if (!PyList_CheckExact(bucket))
        PyErr_SetString(PyExc_TypeError, "a calendar bucket must be a list");
    Py_DECREF(bucket);
    self->phase = COMPUTE;
    return status;
}

/* The compute ended: the op's rows (and its TP row), its send and early post; 0 or -1. */
static int computed(Steps *self, PyObject *step, PyObject *pair) {
    PyObject *now = now_of(self), *tp = PyTuple_GET_ITEM(pair, 1);
    PyObject *end = now == NULL ? NULL : add(self->start, PyTuple_GET_ITEM(pair, 0));
    int status = end == NULL ? -1 : less(zero_f, tp);
    if (status >= 0) {
        PyObject *row[2 * ROW_FIELDS];
        row_of(self, step, self->start, end, PyTuple_GET_ITEM(step, 4), row);
        row_of(self, step, end, now, self->tp_code, row + ROW_FIELDS);
        status = append_rows(self->rows, row, status ? 2 : 1);
    }
    Py_XDECREF(now);
    Py_XDECREF(end);
    self->phase = IDLE;
    Py_ssize_t k;
    int has = status < 0 ? -1 : message_id(self, PyTuple_GET_ITEM(step, 6), &k);
    if (has > 0) {
        Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(step, 7));
        if ((r == -1 && PyErr_Occurred()) || check_index(self->routes, r) < 0)
            return -1;
        PyObject *args[3] = {PyList_GET_ITEM(self->routes, r), PyTuple_GET_ITEM(step, 2),
                             PyTuple_GET_ITEM(step, 3)};
        has = call_with_id(self->send_msg, k, args, 3);
    }
    if (has >= 0)
        has = message_id(self, PyTuple_GET_ITEM(step, 8), &k);
    if (has > 0)
        has = call_with_id(self->post_msg, k, NULL, 0);
    return has < 0 ? -1 : 0;
}

/* The step at `i` and its (compute, TP) pair (borrowed), or -1 with an error. */
static int step_at(Steps *self, PyObject **step, PyObject **pair) {
    *step = PyList_GET_ITEM(self->steps, self->i);
    if (!PyTuple_CheckExact(*step) || PyTuple_GET_SIZE(*step) != 9) {
        PyErr_SetString(PyExc_TypeError, "a step must be a 9-tuple");
        return -1;
    }
    Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(*step, 1));
    if ((j == -1 && PyErr_Occurred()) || check_index(self->durations, j) < 0)
        return -1;
    *pair = PyList_GET_ITEM(self->durations, j);
    if (!PyTuple_CheckExact(*pair) || PyTuple_GET_SIZE(*pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "durations must be (compute s, TP s) pairs");
        return -1;
    }
    return 0;
}

/* Run steps until a wait (0), a special op or the end (1, its index or -1 in *stop); -1 on an
 * error. */
static int advance(Steps *self, Py_ssize_t *stop) {
    PyObject *step, *pair;
    for (;;) {
        if (self->phase == IDLE && self->i >= PyList_GET_SIZE(self->steps)) {
            *stop = -1;
            return 1;
        }
        if (step_at(self, &step, &pair) < 0)
            return -1;
        if (self->phase == IDLE) {
            int waits = take_input(self, step);
            if (waits != 0)
                return waits < 0 ? -1 : 0;
        } else if (self->phase == INPUT) {
            if (input_arrived(self, step) < 0)
                return -1;
        } else {
            self->i++;
            if (computed(self, step, pair) < 0)
                return -1;
            continue;
        }
        if (PyTuple_GET_ITEM(step, 5) != Py_None) {  /* a special op: the generator's */
            *stop = self->i++;
            return 1;
        }
        if (compute(self, pair) < 0)
            return -1;
        return 0;
    }
}

static PyObject *go(Steps *self, PyObject *unused) {
    Py_ssize_t stop;
    int status = advance(self, &stop);
    if (status <= 0)
        return status < 0 ? NULL : Py_NewRef(Py_None);
    return PyLong_FromSsize_t(stop);
}

/* An event it waited for fired: the steps go on; the generator resumes at a special op or
 * the end (what it yields next is ignored, as the run loop ignores it). */
static PyObject *call(Steps *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *at = go(self, NULL);
    if (at == NULL || at == Py_None)
        return at;
    PyObject *r = PyObject_CallOneArg(self->gen_send, at);
    Py_DECREF(at);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static int init(Steps *self, PyObject *args, PyObject *kwargs) {
    self->vectorcall = (vectorcallfunc)call;
    PyObject *env, *steps, *durations, *routes, *base, *messages, *rows, *ids, *events, *send,
        *codes;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Steps takes no keyword arguments");
        return -1;
    }
    if (!PyArg_UnpackTuple(args, "Steps", 11, 11, &env, &steps, &durations, &routes, &base,
                           &messages, &rows, &ids, &events, &send, &codes))
        return -1;
    if (!PyList_CheckExact(steps) || !PyList_CheckExact(durations) ||
            !PyList_CheckExact(routes) || !PyByteArray_CheckExact(rows) ||
            !PyTuple_CheckExact(messages) || PyTuple_GET_SIZE(messages) != 6 ||
            !PyTuple_CheckExact(ids) || PyTuple_GET_SIZE(ids) != 2 ||
            !PyTuple_CheckExact(events) || PyTuple_GET_SIZE(events) != 2 ||
            !PyTuple_CheckExact(codes) || PyTuple_GET_SIZE(codes) != 3) {
        PyErr_SetString(PyExc_TypeError, "Steps(env, steps, durations, routes, base, messages, "
                        "rows, ids, events, send, codes): lists, a bytearray and tuples expected");
        return -1;
    }
    PyObject **m = &PyTuple_GET_ITEM(messages, 0);
    for (int i = 0; i < 3; i++)
        if (!PyList_CheckExact(m[i])) {
            PyErr_SetString(PyExc_TypeError, "Steps: the messages' state lists must be lists");
            return -1;
        }
    Py_ssize_t b = PyLong_AsSsize_t(base);
    if (b == -1 && PyErr_Occurred())
        return -1;
    PyObject *calendar = PyObject_GetAttr(env, str_normal);
    PyObject *new_bucket = calendar == NULL ? NULL : PyObject_GetAttr(env, str_new_bucket);
    PyObject *resume = new_bucket == NULL ? NULL : PyList_New(1);
    if (resume == NULL || !PyDict_CheckExact(calendar)) {
        if (resume != NULL)
            PyErr_SetString(PyExc_TypeError, "Steps: env.normal must be a dict");
        Py_XDECREF(calendar);
        Py_XDECREF(new_bucket);
        Py_XDECREF(resume);
        return -1;
    }
    Py_INCREF(self);
    PyList_SET_ITEM(resume, 0, (PyObject *)self);  /* the callbacks of the events it waits for */
    PyObject **e = &PyTuple_GET_ITEM(events, 0), **c = &PyTuple_GET_ITEM(codes, 0);
    PyObject *given[N_FIELDS] = {env, steps, durations, routes, m[0], m[1], m[2], m[3], m[4],
                                 m[5], rows, PyTuple_GET_ITEM(ids, 0), PyTuple_GET_ITEM(ids, 1),
                                 e[0], e[1], send, c[0], c[1], c[2], NULL, NULL, NULL, NULL,
                                 NULL};
    clear(self);
    for (int i = 0; i < N_FIELDS - 5; i++)
        fields(self)[i] = Py_NewRef(given[i]);
    self->calendar = calendar;
    self->new_bucket = new_bucket;
    self->resume = resume;
    self->base = b;
    self->i = self->k = 0;
    self->phase = IDLE;
    return 0;
}

static PyMethodDef steps_methods[] = {
    {"go", (PyCFunction)go, METH_NOARGS,
     "go(): run steps until a wait (None), a special op (its index) or the end (-1)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "holmes_sim.sim._entity_steps.Steps",
    .tp_basicsize = sizeof(Steps),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Steps, vectorcall),
    .tp_doc = "An entity's common ops in C, the callback of the events it waits for.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)init,
    .tp_dealloc = (destructor)dealloc,
    .tp_traverse = (traverseproc)traverse,
    .tp_clear = (inquiry)clear,
    .tp_call = PyVectorcall_Call,
    .tp_methods = steps_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_entity_steps",
                                    "An entity's common ops in C.", -1, NULL};

PyMODINIT_FUNC PyInit__entity_steps(void) {
    if ((str_now = PyUnicode_InternFromString("_now")) == NULL ||
            (str_normal = PyUnicode_InternFromString("normal")) == NULL ||
            (str_new_bucket = PyUnicode_InternFromString("new_bucket")) == NULL ||
            (str_callbacks = PyUnicode_InternFromString("callbacks")) == NULL ||
            (zero_f = PyFloat_FromDouble(0.0)) == NULL || PyType_Ready(&StepsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI", ABI) < 0
        || PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&StepsType);
    if (PyModule_AddObject(m, "Steps", (PyObject *)&StepsType) < 0) {
        Py_DECREF(&StepsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
