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
 *
 * ABI: this interface's version, the module's `ABI`. `trace.py` uses the module only where its
 * `TRACE_ROWS_ABI` is the same, else runs its Python code: a build left in place from other
 * sources is never called. Bump both when the interface changes: a function's or type's
 * arguments, results or meaning, or what it reads or sets on the objects given.
 */
#define ABI 1
#ifndef SOURCE_SHA256  /* setup.py defines it: this file's SHA-256, the module's
                          `SOURCE_SHA256` (`version.extension` compares the two) */
#define SOURCE_SHA256 ""
#endif
#include "_rows.h"

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
    if (append_rows(rows, args + 1, (nargs - 1) / ROW_FIELDS) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"append", (PyCFunction)(void (*)(void))append, METH_FASTCALL,
     "append(rows, *fields): append rows of trace.ROW (8 fields each) to bytearray rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_trace_rows",
                                    "The trace's row packing in C.", -1, methods};

PyMODINIT_FUNC PyInit__trace_rows(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI", ABI) < 0
                  || PyModule_AddStringConstant(m, "SOURCE_SHA256", SOURCE_SHA256) < 0))
        Py_CLEAR(m);
    return m;
}
