/* `holmes_sim.sim.pipeline_messages.PipelineMessages`' send, post and arrival in C: the same
 * list stores, calls and rows in the same order as its Python methods (`_send`, `_post`,
 * `_arrivals`), without the interpreter's bytecode per message. Optional:
 * `pipeline_messages.py` runs the Python methods when this extension was not built.
 *
 * Core(env, state, arrival, sent_at, rows, size, bytes, lean, send_message, on_arrival,
 *      send_plain, posted, started, kind)
 *   env:          the `CountingEnvironment` (its `_now`, `now_bucket`, `normal`, `new_bucket`)
 *   state, arrival, sent_at: the per-message lists
 *   rows:         the trace's bytearray; size: a message's bytes in its row; kind: its kind code
 *   bytes:        a flow's size (a float); lean: whether flows go by `send_message`
 *   send_message: `FlowNetwork.send_message`; on_arrival: every flow's callbacks (a list)
 *   send_plain:   `PipelineMessages._send_plain`; posted, started: the state markers
 * Core.send(k, route, mb, chunk), Core.post(k): `PipelineMessages._send`, `_post`
 * Core.arrive(done): one step of `PipelineMessages._arrivals`, given a transfer's event
 *
 * ABI: this interface's version, the module's `ABI`. `pipeline_messages.py` uses the module only
 * where its `PIPELINE_MESSAGES_ABI` is the same, else runs its Python code: a build left in
 * place from other sources is never called. Bump both when the interface changes: a function's
 * or type's arguments, results or meaning, or what it reads or sets on the objects given.
 */
#define ABI 1
#ifndef SOURCE_SHA256  /* setup.py defines it: this file's SHA-256, the module's
                          `SOURCE_SHA256` (`version.extension` compares the two) */
#define SOURCE_SHA256 ""
#endif
#include "_slots.h"
#include "_rows.h"
#include "_lists.h"

typedef struct {
    PyObject_HEAD
    PyObject *env, *state, *arrival, *sent_at, *rows, *size, *bytes, *send_message,
        *on_arrival, *send_plain, *posted, *started, *kind, *normal, *new_bucket;
    int lean;
} Core;

#define N_FIELDS 15
static PyObject *str_now, *str_now_bucket, *str_normal, *str_new_bucket, *str_links,
    *str_message, *str_callbacks;

/* Slot offsets (0: not a plain slot) of the last types seen: a route's `links`, an event's
 * `message` and `callbacks`, the environment's `_now` and `now_bucket` (`slot_value`). */
static PyTypeObject *route_type, *event_type, *callbacks_type, *env_type, *bucket_env_type;
static Py_ssize_t links_offset, message_offset, callbacks_offset, now_offset, bucket_offset;

static PyObject **fields(Core *self) { return &self->env; }

static int traverse(Core *self, visitproc visit, void *arg) {
    for (int i = 0; i < N_FIELDS; i++)
        Py_VISIT(fields(self)[i]);
    return 0;
}

static int clear(Core *self) {
    for (int i = 0; i < N_FIELDS; i++)
        Py_CLEAR(fields(self)[i]);
    return 0;
}

static void dealloc(Core *self) {
    PyObject_GC_UnTrack(self);
    clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int init(Core *self, PyObject *args, PyObject *kwargs) {
    PyObject *f[14];
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Core takes no keyword arguments");
        return -1;
    }
    if (!PyArg_UnpackTuple(args, "Core", 14, 14, &f[0], &f[1], &f[2], &f[3], &f[4], &f[5],
                           &f[6], &f[7], &f[8], &f[9], &f[10], &f[11], &f[12], &f[13]))
        return -1;
    if (!PyList_CheckExact(f[1]) || !PyList_CheckExact(f[2]) || !PyList_CheckExact(f[3]) ||
            !PyByteArray_CheckExact(f[4]) || !PyList_CheckExact(f[9])) {
        PyErr_SetString(PyExc_TypeError, "Core: state, arrival, sent_at and on_arrival must "
                                         "be lists, rows a bytearray");
        return -1;
    }
    int lean = PyObject_IsTrue(f[7]);
    if (lean < 0)
        return -1;
    PyObject *normal = PyObject_GetAttr(f[0], str_normal);
    PyObject *new_bucket = normal == NULL ? NULL : PyObject_GetAttr(f[0], str_new_bucket);
    if (new_bucket == NULL || !PyDict_CheckExact(normal)) {
        if (new_bucket != NULL)
            PyErr_SetString(PyExc_TypeError, "Core: env.normal must be a dict");
        Py_XDECREF(normal);
        Py_XDECREF(new_bucket);
        return -1;
    }
    clear(self);
    PyObject **mine = fields(self);
    for (int i = 0; i < 14; i++) {
        if (i == 7)
            continue;  /* lean, kept as an int */
        Py_INCREF(f[i]);
        mine[i < 7 ? i : i - 1] = f[i];
    }
    self->normal = normal;
    self->new_bucket = new_bucket;
    self->lean = lean;
    return 0;
}

/* env._now and env.now_bucket (new references, or NULL with an error). */
static PyObject *now_of(Core *self) {
    return slot_value(self->env, str_now, &env_type, &now_offset);
}

static PyObject *now_bucket(Core *self) {
    return slot_value(self->env, str_now_bucket, &bucket_env_type, &bucket_offset);
}

/* The transfer of message k over `route` (links, latency, (sender, stream)) starts at `now`. */
static int start(Core *self, PyObject *k, PyObject *route, PyObject *mb, PyObject *chunk,
                 PyObject *now) {
    if (!PyTuple_CheckExact(route) || PyTuple_GET_SIZE(route) != 3) {
        PyErr_SetString(PyExc_TypeError, "a route must be (links, latency, ids)");
        return -1;
    }
    PyObject *links = PyTuple_GET_ITEM(route, 0), *r;
    int crosses = 0;
    if (self->lean) {
        PyObject *used = slot_value(links, str_links, &route_type, &links_offset);
        if (used == NULL)
            return -1;
        crosses = PyObject_IsTrue(used);
        Py_DECREF(used);
        if (crosses < 0)
            return -1;
    }
    if (crosses) {
        PyObject *message = PyTuple_Pack(5, k, now, PyTuple_GET_ITEM(route, 2), mb, chunk);
        if (message == NULL)
            return -1;
        /* args[0] is free for the callee (a `functools.partial` prepends its argument) */
        PyObject *args[6] = {NULL, links, self->bytes, PyTuple_GET_ITEM(route, 1),
                             self->on_arrival, message};
        r = PyObject_Vectorcall(self->send_message, args + 1,
                                5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(message);
    } else {
        PyObject *args[4] = {k, route, mb, chunk};
        r = PyObject_Vectorcall(self->send_plain, args, 4, NULL);
    }
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *send(Core *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "send(k, route, mb, chunk): 4 arguments expected");
        return NULL;
    }
    Py_ssize_t i = position(self->state, args[0]), j = position(self->sent_at, args[0]);
    if (i < 0 || j < 0)
        return NULL;
    PyObject *now = now_of(self);
    if (now == NULL)
        return NULL;
    store(self->sent_at, j, now);
    int status = 0;
    if (PyList_GET_ITEM(self->state, i) == Py_None) {
        PyObject *waiting = PyTuple_Pack(3, args[1], args[2], args[3]);
        if (waiting == NULL)
            status = -1;
        else {
            store(self->state, i, waiting);
            Py_DECREF(waiting);
        }
    } else {
        store(self->state, i, self->started);
        status = start(self, args[0], args[1], args[2], args[3], now);
    }
    Py_DECREF(now);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *post(Core *self, PyObject *k) {
    Py_ssize_t i = position(self->state, k);
    if (i < 0)
        return NULL;
    PyObject *state = PyList_GET_ITEM(self->state, i);
    if (state == Py_None) {
        store(self->state, i, self->posted);
    } else if (PyTuple_CheckExact(state)) {  /* the waiting send starts */
        if (PyTuple_GET_SIZE(state) != 3) {
            PyErr_SetString(PyExc_TypeError, "a waiting send must be (route, mb, chunk)");
            return NULL;
        }
        Py_INCREF(state);
        store(self->state, i, self->started);
        PyObject *now = now_of(self);
        int status = now == NULL ? -1 : start(self, k, PyTuple_GET_ITEM(state, 0),
                                              PyTuple_GET_ITEM(state, 1),
                                              PyTuple_GET_ITEM(state, 2), now);
        Py_XDECREF(now);
        Py_DECREF(state);
        if (status < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* done.callbacks = () (its receiver sets its own when it waits); 0, or -1 with an error. */
static int no_callbacks(PyObject *done) {
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL)
        return -1;
    if (Py_TYPE(done) != callbacks_type) {
        Py_INCREF(Py_TYPE(done));  /* a strong reference, so that its address is not reused */
        Py_XDECREF(callbacks_type);
        callbacks_type = Py_TYPE(done);
        callbacks_offset = slot_offset(callbacks_type, str_callbacks);
    }
    if (callbacks_offset) {
        PyObject **slot = (PyObject **)((char *)done + callbacks_offset);
        PyObject *old = *slot;
        *slot = empty;  /* the new reference moves to the slot */
        Py_XDECREF(old);
        return 0;
    }
    int status = PyObject_SetAttr(done, str_callbacks, empty);
    Py_DECREF(empty);
    return status;
}

/* The bucket of `now` to append an arrival to (a new reference), or NULL with an error. */
static PyObject *bucket_of(Core *self, PyObject *now) {
    PyObject *bucket = now_bucket(self);
    if (bucket == NULL || bucket != Py_None)
        return bucket;
    Py_DECREF(bucket);
    bucket = PyDict_GetItemWithError(self->normal, now);  /* borrowed */
    if (bucket != NULL) {
        Py_INCREF(bucket);
        return bucket;
    }
    return PyErr_Occurred() ? NULL : PyObject_CallOneArg(self->new_bucket, now);
}

/* The row, the arrival event and its place in the calendar; 0, or -1 with an error. */
static int arrived(Core *self, PyObject *done, PyObject *message, PyObject *now) {
    if (!PyTuple_CheckExact(message) || PyTuple_GET_SIZE(message) != 5 ||
            !PyTuple_CheckExact(PyTuple_GET_ITEM(message, 2)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(message, 2)) != 2) {
        PyErr_SetString(PyExc_TypeError, "a message must be (k, begun, (sender, stream), mb, chunk)");
        return -1;
    }
    PyObject **m = &PyTuple_GET_ITEM(message, 0), **ids = &PyTuple_GET_ITEM(m[2], 0);
    PyObject *row[ROW_FIELDS] = {m[1], now, self->size, ids[0], m[3], m[4], ids[1], self->kind};
    if (append_rows(self->rows, row, 1) < 0)
        return -1;
    Py_ssize_t i = position(self->arrival, m[0]);
    if (i < 0)
        return -1;
    PyObject *ev = PyList_GET_ITEM(self->arrival, i);
    if (ev == Py_None) {  /* nobody waits for it yet */
        store(self->arrival, i, done);
        if (no_callbacks(done) < 0)
            return -1;
        ev = done;
    }
    Py_INCREF(ev);
    PyObject *bucket = bucket_of(self, now);
    int status = -1;
    if (bucket != NULL) {
        if (PyList_CheckExact(bucket))
            status = PyList_Append(bucket, ev);
        else
            PyErr_SetString(PyExc_TypeError, "a calendar bucket must be a list");
        Py_DECREF(bucket);
    }
    Py_DECREF(ev);
    return status;
}

static PyObject *arrive(Core *self, PyObject *done) {
    PyObject *message = slot_value(done, str_message, &event_type, &message_offset);
    if (message == NULL)
        return NULL;
    PyObject *now = now_of(self);
    int status = now == NULL ? -1 : arrived(self, done, message, now);
    Py_DECREF(message);
    Py_XDECREF(now);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"send", (PyCFunction)(void (*)(void))send, METH_FASTCALL,
     "send(k, route, mb, chunk): the sender's op ended (`PipelineMessages._send`)."},
    {"post", (PyCFunction)post, METH_O,
     "post(k): the receiver posts message k's receive (`PipelineMessages._post`)."},
    {"arrive", (PyCFunction)arrive, METH_O,
     "arrive(done): a transfer's last byte is in (`PipelineMessages._arrivals`)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "holmes_sim.sim._pipeline_messages.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The pipeline messages' send, post and arrival in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)init,
    .tp_dealloc = (destructor)dealloc,
    .tp_traverse = (traverseproc)traverse,
    .tp_clear = (inquiry)clear,
    .tp_methods = core_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pipeline_messages",
                                    "The pipeline messages' send, post and arrival in C.", -1,
                                    NULL};

PyMODINIT_FUNC PyInit__pipeline_messages(void) {
    const char *names[] = {"_now", "now_bucket", "normal", "new_bucket", "links", "message",
                           "callbacks"};
    PyObject **strs[] = {&str_now, &str_now_bucket, &str_normal, &str_new_bucket, &str_links,
                         &str_message, &str_callbacks};
    for (int i = 0; i < 7; i++)
        if ((*strs[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI", ABI) < 0
        || PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
