/* A trace row of `trace.ROW` ("<dddiihbb": start s, end s, bytes, entity index, micro-batch,
 * chunk, stream index, kind code; 36 bytes, little-endian) packed from its eight fields, the
 * bytes `struct` packs for the same values: shared by the C code that appends trace rows
 * (`_trace_rows.c`, `_pipeline_messages.c`). */
#ifndef HOLMES_SIM_ROWS_H
#define HOLMES_SIM_ROWS_H

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

/* Append `n` rows of fields `f` (8 a row) to bytearray `rows`; 0, or -1 with an error (nothing
 * appended then). */
static inline int append_rows(PyObject *rows, PyObject *const *f, Py_ssize_t n) {
    Py_ssize_t size = PyByteArray_GET_SIZE(rows);
    if (PyByteArray_Resize(rows, size + n * ROW_BYTES) < 0)
        return -1;
    char *p = PyByteArray_AS_STRING(rows) + size;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (put_row(p + r * ROW_BYTES, f + r * ROW_FIELDS) < 0) {
            PyByteArray_Resize(rows, size);
            return -1;
        }
    }
    return 0;
}

#endif
