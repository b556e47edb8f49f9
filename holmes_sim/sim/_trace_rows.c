/* The trace's row packing (`holmes_sim.sim.trace.append_rows`) in C: appends rows of
 * `trace.ROW` ("<dddiihbb": start s, end s, bytes, entity index, micro-batch, chunk, stream
 * index, kind code; 36 bytes, little-endian) to a bytearray, the bytes `struct` packs for the
 * same values, without making a bytes object per row. Optional: `trace.py` packs with `struct`
 * when this extension was not built.
 *
 * append(rows, *fields)
 *   rows:   bytearray, grown by 36 bytes a row (as `rows += ROW.pack(...)` grows it)
 *   fields: 8 per row, in `ROW`'s order: three numbers (converted as `float()` does for
 *           struct's 'd') and five integers in the ranges of 'i', 'i', 'h', 'b', 'b'
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ROW_FIELDS 8
#define ROW_BYTES 36

static void put_le(char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++)
        p[i] = (char)(v >> (8 * i));
}

static int put_double(char *p, PyObject *obj) {
    double x = PyFloat_CheckExact(obj) ? PyFloat_AS_DOUBLE(obj) : PyFloat_AsDouble(obj);
    if (x == -1.0 && PyErr_Occurred())
        return -1;
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);  /* IEEE 754 binary64, which CPython 3.11 requires */
    put_le(p, bits, 8);
    return 0;
}

static int put_int(char *p, PyObject *obj, long lo, long hi, int n) {
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < lo || v > hi) {
        PyErr_Format(PyExc_OverflowError, "trace row field %ld outside [%ld, %ld]", v, lo, hi);
        return -1;
    }
    put_le(p, (uint64_t)v, n);
    return 0;
}

static int put_row(char *p, PyObject *const *f) {
    if (put_double(p, f[0]) < 0 || put_double(p + 8, f[1]) < 0 || put_double(p + 16, f[2]) < 0)
        return -1;
    if (put_int(p + 24, f[3], INT32_MIN, INT32_MAX, 4) < 0 ||
        put_int(p + 28, f[4], INT32_MIN, INT32_MAX, 4) < 0 ||
        put_int(p + 32, f[5], INT16_MIN, INT16_MAX, 2) < 0 ||
        put_int(p + 34, f[6], INT8_MIN, INT8_MAX, 1) < 0 ||
        put_int(p + 35, f[7], INT8_MIN, INT8_MAX, 1) < 0)
        return -1;
    return 0;
}

static PyObject *append(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 + ROW_FIELDS || (nargs - 1) % ROW_FIELDS != 0) {
        PyErr_SetString(PyExc_TypeError, "append(rows, *fields): 8 fields a row expected");
        return NULL;
    }
    PyObject *rows = args[0];
    if (!PyByteArray_CheckExact(rows)) {
        PyErr_SetString(PyExc_TypeError, "append: rows must be a bytearray");
        return NULL;
    }
    Py_ssize_t n = (nargs - 1) / ROW_FIELDS;
    Py_ssize_t size = PyByteArray_GET_SIZE(rows);
    if (PyByteArray_Resize(rows, size + n * ROW_BYTES) < 0)
        return NULL;
    char *p = PyByteArray_AS_STRING(rows) + size;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (put_row(p + r * ROW_BYTES, args + 1 + r * ROW_FIELDS) < 0) {
            PyByteArray_Resize(rows, size);  /* nothing appended on an error */
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"append", (PyCFunction)(void (*)(void))append, METH_FASTCALL,
     "append(rows, *fields): append rows of trace.ROW (8 fields each) to bytearray rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_trace_rows",
                                    "The trace's row packing in C.", -1, methods};

PyMODINIT_FUNC PyInit__trace_rows(void) { return PyModule_Create(&module); }
