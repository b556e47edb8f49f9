/* The estimate's critical-path walk (`holmes_sim.estimate.walk._State.advance_checked`) in C: the same
 * additions and maxima in the same order on IEEE doubles, so its stage clocks and message times
 * are the pure-Python walk's bit for bit (tests/estimate/test_walk.py runs both). Optional: `walk.py`
 * falls back to Python when this extension was not built.
 *
 * advance(rows, row_start, durs, kinds, sends, pos, limits, clock, ready[, floors])
 *   rows:      int32, 4 per op (kind index, input slot, the input's send index, output slot;
 *              -1 for none), stage after stage (`OpTable.rows` flattened)
 *   row_start: int64, p + 1 entries: stage s's ops are rows[4 * row_start[s] ...]
 *   durs:      double, `kinds` per stage: stage s's op of kind k takes durs[s * kinds + k] s
 *   sends:     double, seconds of each send index
 *   pos:       int64, p entries (in/out): each stage's next op
 *   limits:    int64, p entries: run each stage up to this op index
 *   clock:     double, p entries (in/out): each stage's clock (s)
 *   ready:     double (in/out): when each message was sent (s; negative: not yet)
 *   floors:    double laid out as durs, or None: an op of kind k on stage s starts no earlier
 *              than floors[s * kinds + k] s (after its input arrived)
 *
 * ABI: this interface's version, the module's `ABI`. `walk.py` uses the module only where its
 * `WALK_KERNEL_ABI` is the same, else runs its Python code: a build left in place from other
 * sources is never called. Bump both when the interface changes: a function's or type's
 * arguments, results or meaning, or what it reads or sets on the objects given.
 */
#define ABI 1
#ifndef SOURCE_SHA256  /* setup.py defines it: this file's SHA-256, the module's
                          `SOURCE_SHA256` (`version.extension` compares the two) */
#define SOURCE_SHA256 ""
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* A C-contiguous buffer of `obj` whose items are of struct format `format` (an array.array of
 * that type code). */
static int get(PyObject *obj, Py_buffer *view, int writable, const char *format, Py_ssize_t item,
               const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != item || view->format == NULL || strcmp(view->format, format) != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s: an array of type '%s' expected", what, format);
        return -1;
    }
    return 0;
}

static int walk(const int *rows, Py_ssize_t nrows, const long long *row_start, Py_ssize_t p,
                const double *durs, Py_ssize_t ndurs, Py_ssize_t kinds, const double *sends,
                Py_ssize_t nsends, long long *pos, const long long *limits, double *clock,
                double *ready, Py_ssize_t nready, const double *floors) {
    long long todo = 0;
    for (Py_ssize_t s = 0; s < p; s++) {
        if (pos[s] < 0 || limits[s] < pos[s] || row_start[s] + limits[s] > row_start[s + 1] ||
            row_start[s + 1] * 4 > nrows || (s + 1) * kinds > ndurs) {
            PyErr_SetString(PyExc_ValueError, "walk: positions or limits outside the table");
            return -1;
        }
        todo += limits[s] - pos[s];
    }
    while (todo) {
        int progressed = 0;
        for (Py_ssize_t s = 0; s < p; s++) {
            long long k = pos[s];
            const long long n = limits[s];
            if (k == n)
                continue;
            const int *row = rows + 4 * row_start[s];
            const double *dur = durs + s * kinds;
            double t = clock[s];
            while (k < n) {
                const int *op = row + 4 * k;
                const int dk = op[0], need = op[1], sk = op[2], out = op[3];
                if (dk < 0 || dk >= kinds || need >= nready || out >= nready ||
                    (need >= 0 && (sk < 0 || sk >= nsends))) {
                    PyErr_SetString(PyExc_ValueError, "walk: an op's index is outside the table");
                    return -1;
                }
                if (need >= 0) {
                    const double sent = ready[need];
                    if (sent < 0.0)
                        break;
                    /* Rendezvous: the transfer starts once sent and the receive is posted. */
                    t = (sent > t ? sent : t) + sends[sk];
                }
                if (floors) {
                    const double f = floors[s * kinds + dk];
                    if (f > t)
                        t = f;
                }
                t += dur[dk];
                if (out >= 0)
                    ready[out] = t;
                k++;
            }
            if (k != pos[s]) {
                todo -= k - pos[s];
                pos[s] = k;
                clock[s] = t;
                progressed = 1;
            }
        }
        if (!progressed) {
            PyErr_SetString(PyExc_RuntimeError, "schedule deadlock");
            return -1;
        }
    }
    return 0;
}

static PyObject *advance(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[9];
    Py_ssize_t kinds;
    o[8] = Py_None;
    if (!PyArg_ParseTuple(args, "OOOnOOOOO|O:advance", &o[0], &o[1], &o[2], &kinds, &o[3], &o[4],
                          &o[5], &o[6], &o[7], &o[8]))
        return NULL;
    /* rows, row_start, durs, sends, pos, limits, clock, ready, floors (or None) */
    static const char *format[9] = {"i", "q", "d", "d", "q", "q", "d", "d", "d"};
    static const Py_ssize_t item[9] = {sizeof(int), 8, 8, 8, 8, 8, 8, 8, 8};
    static const int writable[9] = {0, 0, 0, 0, 1, 0, 1, 1, 0};
    static const char *what[9] = {"rows", "row_start", "durs", "sends", "pos", "limits", "clock",
                                  "ready", "floors"};
    const int count = o[8] == Py_None ? 8 : 9;
    Py_buffer v[9];
    int got = 0, rc = -1;
    for (; got < count; got++)
        if (get(o[got], &v[got], writable[got], format[got], item[got], what[got]) < 0)
            goto done;
    const Py_ssize_t p = v[4].len / 8;
    if (kinds < 1 || v[1].len / 8 != p + 1 || v[5].len / 8 != p || v[6].len / 8 != p) {
        PyErr_SetString(PyExc_ValueError, "walk: stage counts differ");
        goto done;
    }
    if (count == 9 && v[8].len != v[2].len) {
        PyErr_SetString(PyExc_ValueError, "walk: floors and durations differ in length");
        goto done;
    }
    rc = walk(v[0].buf, v[0].len / 4, v[1].buf, p, v[2].buf, v[2].len / 8, kinds, v[3].buf,
              v[3].len / 8, v[4].buf, v[5].buf, v[6].buf, v[7].buf, v[7].len / 8,
              count == 9 ? v[8].buf : NULL);
done:
    while (got > 0)
        PyBuffer_Release(&v[--got]);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"advance", advance, METH_VARARGS,
     "advance(rows, row_start, durs, kinds, sends, pos, limits, clock, ready[, floors]): run "
     "every stage up to its limit, op by op, as `walk._State.advance_checked` does."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_walk_kernel", "The estimate's walk in C (see walk.py).", -1, methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__walk_kernel(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI", ABI) < 0
                  || PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0))
        Py_CLEAR(m);
    return m;
}
