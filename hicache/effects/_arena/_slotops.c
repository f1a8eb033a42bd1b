/* The node store's atomic slot operations (optional; hicache.effects._arena._slots has a correct
 * fallback without a compiler).
 *
 * load/store/fetch_add: 64-bit words of the shared arena with acquire/release ordering, so a
 * reader that sees a slot's even generation also sees the bytes published before it - on weakly
 * ordered CPUs (aarch64: Grace Hopper) too.
 * copy_pages: a batch of page copies between a pool's page segments and arena slots, without the
 * GIL, summing every 8-byte word as it is copied (sum1 = seed1 + sum w_i, sum2 = seed2 +
 * sum (i+1) w_i, mod 2**64): the checksum of exactly the bytes written or delivered, in one pass.
 * lookup: for each 16-byte key, the slot of its window holding it with an even generation.
 * Bounds are the caller's (hicache.effects._arena._slots checks every segment against the
 * arena and the pool before calling).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RECORD_BYTES 64

static PyObject *slot_load(PyObject *self, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
    uint64_t value = __atomic_load_n((uint64_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *slot_store(PyObject *self, PyObject *args) {
    unsigned long long addr, value;
    if (!PyArg_ParseTuple(args, "KK", &addr, &value)) return NULL;
    __atomic_store_n((uint64_t *)(uintptr_t)addr, (uint64_t)value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *slot_fetch_add(PyObject *self, PyObject *args) {
    unsigned long long addr, delta;
    if (!PyArg_ParseTuple(args, "KK", &addr, &delta)) return NULL;
    uint64_t old = __atomic_fetch_add((uint64_t *)(uintptr_t)addr, (uint64_t)delta, __ATOMIC_ACQ_REL);
    return PyLong_FromUnsignedLongLong(old);
}

static int get_u64(PyObject *obj, Py_buffer *view, Py_ssize_t need, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len < need * 8) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zd needed", what, view->len, need * 8);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* copy_pages(direction, pages, per_page, slots, seg_ptrs, seg_lens, sums)
 * direction 0: segments -> slot (a write), 1: slot -> segments (a read), 2: sum the slot only.
 * sums: 2 u64 per page, the seeds in, the checksums out. */
static PyObject *copy_pages(PyObject *self, PyObject *args) {
    int direction;
    Py_ssize_t pages, per_page;
    PyObject *o_slots, *o_ptrs, *o_lens, *o_sums;
    if (!PyArg_ParseTuple(args, "innOOOO", &direction, &pages, &per_page, &o_slots, &o_ptrs, &o_lens, &o_sums))
        return NULL;
    if (direction < 0 || direction > 2 || pages < 0 || per_page < 1) {
        PyErr_SetString(PyExc_ValueError, "copy_pages: bad direction, page or segment count");
        return NULL;
    }
    Py_buffer slots, ptrs, lens, sums;
    if (get_u64(o_slots, &slots, pages, "slots") < 0) return NULL;
    if (get_u64(o_ptrs, &ptrs, pages * per_page, "seg_ptrs") < 0) { PyBuffer_Release(&slots); return NULL; }
    if (get_u64(o_lens, &lens, pages * per_page, "seg_lens") < 0) {
        PyBuffer_Release(&slots); PyBuffer_Release(&ptrs); return NULL;
    }
    if (get_u64(o_sums, &sums, 2 * pages, "sums") < 0) {
        PyBuffer_Release(&slots); PyBuffer_Release(&ptrs); PyBuffer_Release(&lens); return NULL;
    }
    const uint64_t *slot = slots.buf, *ptr = ptrs.buf, *len = lens.buf;
    uint64_t *sum = sums.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < pages; p++) {
        uint64_t s1 = sum[2 * p], s2 = sum[2 * p + 1], i = 0;
        unsigned char *at = (unsigned char *)(uintptr_t)slot[p];
        for (Py_ssize_t s = 0; s < per_page; s++) {
            uint64_t n = len[p * per_page + s] / 8, w;
            unsigned char *seg = (unsigned char *)(uintptr_t)ptr[p * per_page + s];
            const unsigned char *from = direction == 0 ? seg : at;
            unsigned char *to = direction == 0 ? at : seg;
            for (uint64_t k = 0; k < n; k++) {
                memcpy(&w, from + 8 * k, 8);
                if (direction != 2) memcpy(to + 8 * k, &w, 8);
                s1 += w;
                s2 += (++i) * w;
            }
            at += 8 * n;
        }
        sum[2 * p] = s1;
        sum[2 * p + 1] = s2;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&slots); PyBuffer_Release(&ptrs); PyBuffer_Release(&lens); PyBuffer_Release(&sums);
    Py_RETURN_NONE;
}

/* lookup(index_addr, nslots, window, keys, found, gens): keys 16 bytes each; found[i] the slot
 * (or -1, as u64 max), gens[i] the even generation it was seen with. */
static PyObject *lookup(PyObject *self, PyObject *args) {
    unsigned long long index_addr;
    Py_ssize_t nslots, window;
    Py_buffer keys;
    PyObject *o_found, *o_gens;
    if (!PyArg_ParseTuple(args, "Knny*OO", &index_addr, &nslots, &window, &keys, &o_found, &o_gens)) return NULL;
    Py_ssize_t n = keys.len / 16;
    Py_buffer found, gens;
    if (nslots < 1 || window < 1 || keys.len % 16) {
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_ValueError, "lookup: bad slot count, window or key bytes");
        return NULL;
    }
    if (get_u64(o_found, &found, n, "found") < 0) { PyBuffer_Release(&keys); return NULL; }
    if (get_u64(o_gens, &gens, n, "gens") < 0) { PyBuffer_Release(&keys); PyBuffer_Release(&found); return NULL; }
    const unsigned char *key = keys.buf;
    uint64_t *out = found.buf, *gen_out = gens.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t home;
        memcpy(&home, key + 16 * i, 8);
        home %= (uint64_t)nslots;
        out[i] = UINT64_MAX;
        gen_out[i] = 0;
        for (Py_ssize_t j = 0; j < window; j++) {
            unsigned char *rec = (unsigned char *)(uintptr_t)(index_addr + ((home + j) % nslots) * RECORD_BYTES);
            uint64_t gen = __atomic_load_n((uint64_t *)rec, __ATOMIC_ACQUIRE);
            if (gen == 0 || (gen & 1) || memcmp(rec + 8, key + 16 * i, 16) != 0) continue;
            __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the key's bytes were read before the re-check */
            if (__atomic_load_n((uint64_t *)rec, __ATOMIC_RELAXED) != gen) continue;
            out[i] = (home + j) % nslots;
            gen_out[i] = gen;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&keys); PyBuffer_Release(&found); PyBuffer_Release(&gens);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", slot_load, METH_VARARGS, "load(addr) -> u64, acquire"},
    {"store", slot_store, METH_VARARGS, "store(addr, value), release"},
    {"fetch_add", slot_fetch_add, METH_VARARGS, "fetch_add(addr, delta) -> old u64"},
    {"copy_pages", copy_pages, METH_VARARGS, "batched page copies with their checksums, without the GIL"},
    {"lookup", lookup, METH_VARARGS, "each key's slot in its window, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slotops(void) { return PyModule_Create(&module); }
