/* hicache.pools._pagestack: the page allocator's alloc and free as two C calls.
 *
 * Why native: SGLang's own scheme (slice a free-slot tensor on alloc, concatenate on free)
 * costs ~10 us a pair when the cache is full - its steady state - and a Python/torch
 * allocator that keeps double-free detection spends ~15 small tensor operations, ~100 us.
 * Here the free pages are a stack of int64 page ids and `allocated` a byte per page; alloc
 * pops and writes the token indices, free validates the whole call first (whole page-aligned
 * runs, in range, allocated, no page twice) and only then pushes: a refused free changes
 * nothing. The Python side passes tensors' data_ptr() and holds the pool's lock.
 *
 * alloc(stack, top, allocated, pages, page_size, out) -> new top, or -1 when a page on the
 *     stack is marked allocated (corruption).
 * free(stack, top, capacity, allocated, indices, count, index_bytes, page_size, page_num)
 *     -> new top, or a negative code: -1 not whole pages, -2 a run not page-aligned and
 *     contiguous, -3 out of range, -4 a page not allocated (double free), -5 a page twice,
 *     -6 the stack would overflow.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

static int args_to_ll(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *py_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[6];
    if (args_to_ll(args, nargs, 6, a) < 0) return NULL;
    int64_t *stack = (int64_t *)(intptr_t)a[0];
    int64_t top = a[1];
    uint8_t *allocated = (uint8_t *)(intptr_t)a[2];
    int64_t pages = a[3], page_size = a[4];
    int64_t *out = (int64_t *)(intptr_t)a[5];
    if (pages < 0 || pages > top) return PyLong_FromLongLong(-2);
    for (int64_t i = 0; i < pages; i++) {
        if (allocated[stack[top - 1 - i]]) return PyLong_FromLongLong(-1);
    }
    for (int64_t i = 0; i < pages; i++) {
        int64_t page = stack[top - 1 - i];
        allocated[page] = 1;
        int64_t base = page * page_size;
        for (int64_t t = 0; t < page_size; t++) *out++ = base + t;
    }
    return PyLong_FromLongLong(top - pages);
}

static int64_t index_at(const void *indices, int64_t i, int index_bytes) {
    return index_bytes == 8 ? ((const int64_t *)indices)[i] : (int64_t)((const int32_t *)indices)[i];
}

static PyObject *py_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long a[9];
    if (args_to_ll(args, nargs, 9, a) < 0) return NULL;
    int64_t *stack = (int64_t *)(intptr_t)a[0];
    int64_t top = a[1], capacity = a[2];
    uint8_t *allocated = (uint8_t *)(intptr_t)a[3];
    const void *indices = (const void *)(intptr_t)a[4];
    int64_t count = a[5];
    int index_bytes = (int)a[6];
    int64_t page_size = a[7], page_num = a[8];
    if (count % page_size) return PyLong_FromLongLong(-1);
    int64_t runs = count / page_size;
    int64_t code = 0, checked = 0;
    for (; checked < runs; checked++) { /* validate all, marking each page 2 ("being freed") */
        int64_t first = index_at(indices, checked * page_size, index_bytes);
        if (first < 0 || first % page_size) { code = first < 0 ? -3 : -2; break; }
        int64_t page = first / page_size;
        if (page >= page_num) { code = -3; break; }
        for (int64_t t = 1; t < page_size; t++) {
            if (index_at(indices, checked * page_size + t, index_bytes) != first + t) { code = -2; break; }
        }
        if (code) break;
        if (allocated[page] == 2) { code = -5; break; }
        if (allocated[page] != 1) { code = -4; break; }
        allocated[page] = 2;
    }
    if (!code && top + runs > capacity) code = -6; /* only if the books were already wrong */
    if (code) { /* refused: undo the marks, change nothing */
        for (int64_t i = 0; i < checked; i++) allocated[index_at(indices, i * page_size, index_bytes) / page_size] = 1;
        return PyLong_FromLongLong(code);
    }
    for (int64_t i = runs - 1; i >= 0; i--) { /* push so that the next alloc reuses them in order */
        int64_t page = index_at(indices, i * page_size, index_bytes) / page_size;
        allocated[page] = 0;
        stack[top++] = page;
    }
    return PyLong_FromLongLong(top);
}

static PyMethodDef methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))py_alloc, METH_FASTCALL, "pop pages, write token indices"},
    {"free", (PyCFunction)(void (*)(void))py_free, METH_FASTCALL, "validate, then push pages"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pagestack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pagestack(void) { return PyModule_Create(&module); }
