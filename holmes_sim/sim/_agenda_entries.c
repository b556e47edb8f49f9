/* `holmes_sim.sim.agenda_entries._apply` in C: the flow network's agenda entries of one due
 * time, applied in the order posted, without the interpreter's bytecode per entry. The same
 * stores, the same calls (`_start`, `_take_off`, `_bucket`, `fire`) in the same order, and the
 * same IEEE double arithmetic for a lone flow's end (`now + size / rate`). Optional:
 * `agenda_entries.py` runs the Python loop when this extension was not built.
 *
 * apply(bucket, now, fire, context) -> (entries applied or -1, lone starts, ends)
 *   bucket:  list of (flow, token) tuples; entries appended meanwhile are applied too
 *   now:     float, the clock (s)
 *   fire:    callable, given each finished flow's event
 *   context: (due buckets by time, new_bucket, start, take_off, seeds, ahead)
 *
 * post(context, route, size, latency, callbacks, message) -> flow
 *   `network.FlowNetwork.send_message` in C: a new pending flow of the context's flow type,
 *   its start entry (flow, 0) due at `env._now + latency`, a wake-up armed for it;
 *   context: (env, flow type, flow ids (an iterator, or a callable giving the next id), due
 *            buckets by time, new_bucket, armed, arm).
 *
 * Fields of a flow, its route and its event are read and set as attributes, through the
 * slots of `flow_records.Flow` and `Route` where the objects are of a type seen last.
 *
 * ABI: this interface's version, the module's `ABI`. `agenda_entries.py` uses the module only
 * where its `AGENDA_ENTRIES_ABI` is the same, else runs its Python code: a build left in place
 * from other sources is never called. Bump both when the interface changes: a function's or
 * type's arguments, results or meaning, or what it reads or sets on the objects given.
 */
#define ABI 1
#ifndef SOURCE_SHA256  /* setup.py defines it: this file's SHA-256, the module's
                          `SOURCE_SHA256` (`version.extension` compares the two) */
#define SOURCE_SHA256 ""
#endif
#include "_slots.h"

enum { PENDING = 0, ACTIVE = 1, DONE = 2 };
enum { FL_STATE, FL_ROUTE, FL_SINCE, FL_TOKEN, FL_RATE, FL_SIZE, FL_DONE, FL_REMAINING, FL_OK, FL_VALUE,
       FL_FID, FL_CALLBACKS, FL_MESSAGE, RT_CONFLICTS, RT_ACTIVE, RT_LONE, RT_SOLO, N_NAMES };
static const char *names[N_NAMES] = {"state", "route", "since", "token", "rate", "size", "done",
                                     "remaining", "_ok", "_value", "fid", "callbacks", "message",
                                     "conflicts", "active", "lone", "solo"};
static PyObject *str[N_NAMES];
static PyObject *zero, *one, *active, *finished, *zero_f;

/* Slot offsets per attribute for the last flow type and the last route type (0: not a slot). */
static PyTypeObject *flow_type, *route_type;
static Py_ssize_t offset[N_NAMES];

static void learn(PyTypeObject **kept, PyTypeObject *type, int first, int last) {
    Py_INCREF(type);  /* a strong reference, so that its address is not reused */
    Py_XDECREF(*kept);
    *kept = type;
    for (int i = first; i < last; i++)
        offset[i] = slot_offset(type, str[i]);
}

/* obj.<name i> (a new reference, or NULL with an error). */
static PyObject *get(PyObject *obj, PyTypeObject *type, int i) {
    if (Py_TYPE(obj) == type && offset[i]) {
        PyObject *value = *(PyObject **)((char *)obj + offset[i]);
        if (value == NULL) {
            PyErr_SetObject(PyExc_AttributeError, str[i]);
            return NULL;
        }
        Py_INCREF(value);
        return value;
    }
    return PyObject_GetAttr(obj, str[i]);
}

/* obj.<name i> = value (a borrowed value); 0, or -1 with an error. */
static int set(PyObject *obj, PyTypeObject *type, int i, PyObject *value) {
    if (Py_TYPE(obj) == type && offset[i]) {
        PyObject **slot = (PyObject **)((char *)obj + offset[i]);
        PyObject *old = *slot;
        Py_INCREF(value);
        *slot = value;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(obj, str[i], value);
}

static PyObject *get_flow(PyObject *flow, int i) {
    if (Py_TYPE(flow) != flow_type)
        learn(&flow_type, Py_TYPE(flow), FL_STATE, RT_CONFLICTS);
    return get(flow, flow_type, i);
}

static PyObject *get_route(PyObject *route, int i) {
    if (Py_TYPE(route) != route_type)
        learn(&route_type, Py_TYPE(route), RT_CONFLICTS, N_NAMES);
    return get(route, route_type, i);
}

/* The flow's state as PENDING, ACTIVE or DONE (-2 for anything else), -1 with an error. */
static int state_of(PyObject *flow) {
    PyObject *state = get_flow(flow, FL_STATE);
    if (state == NULL)
        return -1;
    long s = PyLong_Check(state) ? PyLong_AsLong(state) : -2;
    Py_DECREF(state);
    if (s == -1 && PyErr_Occurred())
        return -1;
    return s == PENDING || s == ACTIVE || s == DONE ? (int)s : -2;
}

/* Whether a route in the flow's route's conflicts has an active flow: 1, 0, -1 (error). */
static int joined(PyObject *route) {
    PyObject *conflicts = get_route(route, RT_CONFLICTS);
    if (conflicts == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(conflicts, "conflicts must be a sequence");
    Py_DECREF(conflicts);
    if (seq == NULL)
        return -1;
    int found = 0;
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(seq) && !found; j++) {
        PyObject *flows = get_route(PySequence_Fast_GET_ITEM(seq, j), RT_ACTIVE);
        if (flows == NULL) {
            found = -1;
            break;
        }
        found = PyObject_IsTrue(flows);
        Py_DECREF(flows);
    }
    Py_DECREF(seq);
    return found;
}

/* A lone flow's start: its rate and its end's entry (flow, 1); 0, or -1 with an error. */
static int start_lone(PyObject *flow, PyObject *route, PyObject *now, PyObject *due_at,
                      PyObject *new_bucket) {
    if (set(flow, flow_type, FL_STATE, active) < 0 || set(flow, flow_type, FL_SINCE, now) < 0 ||
            set(flow, flow_type, FL_TOKEN, one) < 0 || set(route, route_type, RT_ACTIVE, one) < 0 ||
            set(route, route_type, RT_LONE, flow) < 0)
        return -1;
    PyObject *rate = get_route(route, RT_SOLO), *size = NULL, *end = NULL, *later = NULL;
    int status = -1;
    if (rate == NULL || set(flow, flow_type, FL_RATE, rate) < 0)
        goto done;
    if ((size = get_flow(flow, FL_SIZE)) == NULL)
        goto done;
    if (PyFloat_CheckExact(now) && PyFloat_CheckExact(size) && PyFloat_CheckExact(rate) &&
            PyFloat_AS_DOUBLE(rate) != 0.0) {
        end = PyFloat_FromDouble(PyFloat_AS_DOUBLE(now) +
                                 PyFloat_AS_DOUBLE(size) / PyFloat_AS_DOUBLE(rate));
    } else {  /* other numbers: Python's arithmetic */
        PyObject *drain = PyNumber_TrueDivide(size, rate);
        if (drain != NULL) {
            end = PyNumber_Add(now, drain);
            Py_DECREF(drain);
        }
    }
    if (end == NULL)
        goto done;
    later = PyDict_GetItemWithError(due_at, end);  /* borrowed */
    if (later != NULL)
        Py_INCREF(later);
    else if (PyErr_Occurred() || (later = PyObject_CallOneArg(new_bucket, end)) == NULL)
        goto done;
    PyObject *entry = PyTuple_Pack(2, flow, one);
    if (entry != NULL) {
        status = PyList_Check(later) ? PyList_Append(later, entry) : -1;
        if (!PyList_Check(later))
            PyErr_SetString(PyExc_TypeError, "an agenda bucket must be a list");
        Py_DECREF(entry);
    }
done:
    Py_XDECREF(rate);
    Py_XDECREF(size);
    Py_XDECREF(end);
    Py_XDECREF(later);
    return status;
}

/* A live active flow's end: off its links, its event succeeded and fired; 0 or -1. */
static int end_flow(PyObject *flow, PyObject *route, PyObject *take_off, PyObject *seeds,
                    PyObject *fire) {
    PyObject *lone = get_route(route, RT_LONE);
    if (lone == NULL)
        return -1;
    Py_DECREF(lone);  /* only its identity is compared */
    if (lone == flow) {
        if (set(route, route_type, RT_ACTIVE, zero) < 0 || set(route, route_type, RT_LONE, Py_None) < 0 ||
                set(flow, flow_type, FL_STATE, finished) < 0)
            return -1;
    } else {
        PyObject *r = PyObject_CallFunctionObjArgs(take_off, flow, seeds, NULL);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        if (set(flow, flow_type, FL_STATE, finished) < 0 ||
                set(flow, flow_type, FL_REMAINING, zero_f) < 0 || set(flow, flow_type, FL_RATE, zero_f) < 0)
            return -1;
    }
    PyObject *done = get_flow(flow, FL_DONE);
    if (done == NULL)
        return -1;
    int status = -1;
    if (set(flow, flow_type, FL_DONE, Py_None) == 0) {
        PyTypeObject *type = Py_TYPE(done) == flow_type ? flow_type : NULL;
        if (set(done, type, FL_OK, Py_True) == 0 && set(done, type, FL_VALUE, Py_None) == 0) {
            PyObject *r = PyObject_CallOneArg(fire, done);
            status = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        }
    }
    Py_DECREF(done);
    return status;
}

/* One entry; 1 when a lone start found `ahead` not empty (stop), 0 to go on, -1 (error). */
static int entry(PyObject *flow, PyObject *token, PyObject *now, PyObject *fire,
                 PyObject **context, Py_ssize_t *lone, Py_ssize_t *ended) {
    int state = state_of(flow);
    if (state < 0 && state != -2)
        return -1;
    if (state != PENDING && state != ACTIVE)
        return 0;
    PyObject *route = get_flow(flow, FL_ROUTE);
    if (route == NULL)
        return -1;
    int status = 0;
    if (state == PENDING) {
        int busy = joined(route);
        if (busy > 0) {
            PyObject *r = PyObject_CallFunctionObjArgs(context[2], flow, now, NULL);
            status = r == NULL ? -1 : 0;
            Py_XDECREF(r);
        } else if (busy == 0 && (status = start_lone(flow, route, now, context[0], context[1])) == 0) {
            ++*lone;
            status = PyObject_IsTrue(context[5]);
        } else {
            status = -1;
        }
    } else {
        PyObject *live = get_flow(flow, FL_TOKEN);
        int same = live == NULL ? -1 : PyObject_RichCompareBool(token, live, Py_EQ);
        Py_XDECREF(live);
        if (same > 0 && (status = end_flow(flow, route, context[3], context[4], fire)) == 0)
            ++*ended;
        else if (same < 0)
            status = -1;
    }
    Py_DECREF(route);
    return status;
}

static PyObject *apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[3]) ||
            PyTuple_GET_SIZE(args[3]) != 6 || !PyDict_Check(PyTuple_GET_ITEM(args[3], 0))) {
        PyErr_SetString(PyExc_TypeError,
                        "apply(bucket, now, fire, context): a list, a number, a callable and "
                        "(dict, new_bucket, start, take_off, seeds, ahead) expected");
        return NULL;
    }
    PyObject *bucket = args[0], **context = &PyTuple_GET_ITEM(args[3], 0);
    Py_ssize_t lone = 0, ended = 0, stop = -1;
    Py_INCREF(bucket);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(bucket); i++) {
        PyObject *item = PyList_GET_ITEM(bucket, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "an agenda entry must be a (flow, token) tuple");
            Py_DECREF(bucket);
            return NULL;
        }
        Py_INCREF(item);
        int status = entry(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1), args[1],
                           args[2], context, &lone, &ended);
        Py_DECREF(item);
        if (status < 0) {
            Py_DECREF(bucket);
            return NULL;
        }
        if (status > 0) {
            stop = i + 1;
            break;
        }
    }
    Py_DECREF(bucket);
    return Py_BuildValue("(nnn)", stop, lone, ended);
}

static PyObject *str_now;
static PyTypeObject *env_type;  /* the last environment type seen, and its `_now` slot offset */
static Py_ssize_t now_offset;

/* The next flow id of `ids`, an iterator or a callable (a new reference, or NULL with an
 * error). */
static PyObject *next_id(PyObject *ids) {
    if (!PyIter_Check(ids))
        return PyObject_CallNoArgs(ids);
    PyObject *id = Py_TYPE(ids)->tp_iternext(ids);
    if (id == NULL && !PyErr_Occurred())
        PyErr_SetNone(PyExc_StopIteration);
    return id;
}

/* The new flow's fields; 0, or -1 with an error. */
static int fill(PyObject *flow, PyObject *const *args, PyObject *fid) {
    return set(flow, flow_type, FL_FID, fid) < 0 || set(flow, flow_type, FL_ROUTE, args[1]) < 0 ||
        set(flow, flow_type, FL_DONE, flow) < 0 || set(flow, flow_type, FL_STATE, zero) < 0 ||
        set(flow, flow_type, FL_CALLBACKS, args[4]) < 0 ||
        set(flow, flow_type, FL_MESSAGE, args[5]) < 0 || set(flow, flow_type, FL_SIZE, args[2]) < 0
        ? -1 : 0;
}

/* The flow's start entry in the bucket due at `at` and its wake-up; 0, or -1 with an error. */
static int enter(PyObject *flow, PyObject *at, PyObject **context) {
    PyObject *bucket = PyDict_GetItemWithError(context[3], at);  /* borrowed */
    if (bucket != NULL)
        Py_INCREF(bucket);
    else if (PyErr_Occurred() || (bucket = PyObject_CallOneArg(context[4], at)) == NULL)
        return -1;
    PyObject *entry = PyTuple_Pack(2, flow, zero);
    int status = entry == NULL || !PyList_Check(bucket) ? -1 : PyList_Append(bucket, entry);
    if (entry != NULL && !PyList_Check(bucket))
        PyErr_SetString(PyExc_TypeError, "an agenda bucket must be a list");
    Py_XDECREF(entry);
    Py_DECREF(bucket);
    if (status < 0)
        return -1;
    int armed = PyDict_Contains(context[5], at);
    if (armed != 0)
        return armed < 0 ? -1 : 0;
    PyObject *r = PyObject_CallOneArg(context[6], at);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static PyObject *post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 7 ||
            !PyType_Check(PyTuple_GET_ITEM(args[0], 1)) ||
            !PyDict_Check(PyTuple_GET_ITEM(args[0], 3)) ||
            !PyDict_Check(PyTuple_GET_ITEM(args[0], 5))) {
        PyErr_SetString(PyExc_TypeError,
                        "post(context, route, size, latency, callbacks, message): context "
                        "(env, flow type, ids, dict, new_bucket, dict, arm) expected");
        return NULL;
    }
    PyObject **context = &PyTuple_GET_ITEM(args[0], 0);
    PyTypeObject *type = (PyTypeObject *)context[1];
    if (type != flow_type)
        learn(&flow_type, type, FL_STATE, RT_CONFLICTS);
    PyObject *flow = type->tp_alloc(type, 0), *fid = NULL, *now = NULL, *at = NULL;
    if (flow == NULL || (fid = next_id(context[2])) == NULL ||
            fill(flow, args, fid) < 0 ||
            (now = slot_value(context[0], str_now, &env_type, &now_offset)) == NULL ||
            (at = PyNumber_Add(now, args[3])) == NULL || enter(flow, at, context) < 0)
        Py_CLEAR(flow);
    Py_XDECREF(fid);
    Py_XDECREF(now);
    Py_XDECREF(at);
    return flow;
}

static PyMethodDef methods[] = {
    {"post", (PyCFunction)(void (*)(void))post, METH_FASTCALL,
     "post(context, route, size, latency, callbacks, message): start entry of a new flow."},
    {"apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL,
     "apply(bucket, now, fire, context): apply an agenda bucket's entries in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_agenda_entries",
                                    "The flow network's agenda entries applied in C.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__agenda_entries(void) {
    for (int i = 0; i < N_NAMES; i++)
        if ((str[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return NULL;
    if ((str_now = PyUnicode_InternFromString("_now")) == NULL)
        return NULL;
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    active = PyLong_FromLong(ACTIVE);
    finished = PyLong_FromLong(DONE);
    zero_f = PyFloat_FromDouble(0.0);
    if (!zero || !one || !active || !finished || !zero_f)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI", ABI) < 0
                  || PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0))
        Py_CLEAR(m);
    return m;
}
