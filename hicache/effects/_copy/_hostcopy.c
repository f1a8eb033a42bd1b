/* hicache.effects._hostcopy: many host-memory block copies in one call, without the GIL.
 *
 * Why native: a page transfer between host buffers is hundreds of 32-256 KiB blocks. Looping
 * over them in Python (one ctypes memmove each, the GIL taken back between blocks) costs ~20%
 * of the copy's bandwidth, and glibc's memcpy writes blocks this small through the cache
 * (a read-for-ownership of every destination line), while a plain large copy streams.
 * Here one call splits the total bytes evenly over `threads` (a single huge block is shared
 * too) and, when asked, writes with non-temporal stores (SSE2, baseline on x86-64): a KV page
 * moved to the other pool is not read again by this CPU soon. Elsewhere it uses memcpy.
 *
 * copy_blocks(dst_addrs, src_addrs, sizes, count, threads, streaming[, dst_base, src_base]): the
 * first three are addresses of int64 arrays of `count` entries (the Python side passes tensors'
 * data_ptr()); the optional bases are added to every address (a pattern of offsets reused for
 * every layer of a transfer, each layer at its own base).
 * Blocks that overlap their own source are copied with memmove, all on the calling thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HICACHE_HAVE_STREAM 1
#else
#define HICACHE_HAVE_STREAM 0
#endif

#define MAX_THREADS 64

/* A part: `count` blocks of `size[i]` bytes from `src[i] + src_base` to `dst[i] + dst_base`. */
typedef struct {
    const int64_t *dst, *src, *size;
    int64_t count, dst_base, src_base;
} part_t;

/* One thread's share: `bytes` bytes starting at block `first_block` (+`first_offset`) of part
 * `first_part`, walking on across parts. */
typedef struct {
    const part_t *parts;
    int64_t nparts, first_part, first_block, first_offset, bytes;
    int streaming;
} share_t;

static void copy_span(char *dst, const char *src, size_t n, int streaming) {
#if HICACHE_HAVE_STREAM
    if (streaming && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* _mm_stream_si128 needs 16-byte alignment */
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; dst += 64, src += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#else
    (void)streaming;
#endif
    memcpy(dst, src, n);
}

static void *run_share(void *arg) {
    share_t *s = (share_t *)arg;
    int64_t part = s->first_part, block = s->first_block, offset = s->first_offset, left = s->bytes;
    while (left > 0 && part < s->nparts) {
        const part_t *p = &s->parts[part];
        if (block >= p->count) {
            part += 1, block = 0, offset = 0;
            continue;
        }
        int64_t n = p->size[block] - offset;
        if (n > left) n = left;
        copy_span((char *)(intptr_t)(p->dst[block] + p->dst_base) + offset,
                  (const char *)(intptr_t)(p->src[block] + p->src_base) + offset, (size_t)n, s->streaming);
        left -= n;
        block += 1, offset = 0;
    }
#if HICACHE_HAVE_STREAM
    if (s->streaming) _mm_sfence(); /* streamed stores visible before the join says "done" */
#endif
    return NULL;
}

static int overlapping(const part_t *p) {
    for (int64_t i = 0; i < p->count; i++) {
        int64_t d = p->dst[i] + p->dst_base, s = p->src[i] + p->src_base;
        if (d < s + p->size[i] && s < d + p->size[i]) return 1;
    }
    return 0;
}

static void copy_parts_all(const part_t *parts, int64_t nparts, int threads, int streaming) {
    int64_t total = 0;
    for (int64_t k = 0; k < nparts; k++) {
        if (overlapping(&parts[k])) { /* rare: every block by memmove, on this thread */
            for (int64_t j = 0; j < nparts; j++)
                for (int64_t i = 0; i < parts[j].count; i++)
                    memmove((void *)(intptr_t)(parts[j].dst[i] + parts[j].dst_base),
                            (const void *)(intptr_t)(parts[j].src[i] + parts[j].src_base), (size_t)parts[j].size[i]);
            return;
        }
        for (int64_t i = 0; i < parts[k].count; i++) total += parts[k].size[i];
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (total < threads) threads = 1;
    share_t shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t part = 0, block = 0, offset = 0;
    for (int t = 0; t < threads; t++) { /* consecutive, near-equal byte shares across parts */
        int64_t bytes = total / threads + (t < total % threads ? 1 : 0);
        shares[t] = (share_t){parts, nparts, part, block, offset, bytes, streaming};
        int64_t skip = bytes; /* advance the cursor to where share t+1 begins */
        while (skip > 0 && part < nparts) {
            if (block >= parts[part].count) {
                part += 1, block = 0, offset = 0;
                continue;
            }
            int64_t rest = parts[part].size[block] - offset;
            if (rest > skip) {
                offset += skip;
                skip = 0;
            } else {
                skip -= rest;
                block += 1, offset = 0;
            }
        }
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            run_share(&shares[t]); /* no thread to be had: copy that share here */
    }
}

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    unsigned long long dst, src, size;
    long long count, dst_base = 0, src_base = 0;
    int threads, streaming;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKLip|LL", &dst, &src, &size, &count, &threads, &streaming, &dst_base, &src_base))
        return NULL;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "count must be >= 0, got %lld", count);
        return NULL;
    }
    part_t part = {(const int64_t *)(uintptr_t)dst, (const int64_t *)(uintptr_t)src, (const int64_t *)(uintptr_t)size,
                   (int64_t)count, (int64_t)dst_base, (int64_t)src_base};
    Py_BEGIN_ALLOW_THREADS
    copy_parts_all(&part, 1, threads, streaming);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy_parts(parts, threads, streaming): every part is a tuple (dst_addrs, src_addrs, sizes, count,
 * dst_base, src_base) as copy_blocks takes them; all are copied in one call, their bytes split
 * evenly over the threads (a transfer's layers and K/V streams, each at its own bases). */
static PyObject *copy_parts(PyObject *self, PyObject *args) {
    PyObject *list;
    int threads, streaming;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!ip", &PyList_Type, &list, &threads, &streaming)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    part_t *parts = (part_t *)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(part_t));
    if (!parts) return PyErr_NoMemory();
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned long long dst, src, size;
        long long count, dst_base, src_base;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, k), "KKKLLL", &dst, &src, &size, &count, &dst_base, &src_base) ||
            count < 0) {
            PyMem_Free(parts);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "count must be >= 0");
            return NULL;
        }
        parts[k] = (part_t){(const int64_t *)(uintptr_t)dst, (const int64_t *)(uintptr_t)src,
                            (const int64_t *)(uintptr_t)size, count, dst_base, src_base};
    }
    Py_BEGIN_ALLOW_THREADS
    copy_parts_all(parts, (int64_t)n, threads, streaming);
    Py_END_ALLOW_THREADS
    PyMem_Free(parts);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_parts", copy_parts, METH_VARARGS,
     "copy_parts(parts, threads, streaming): copy every part (dst_addrs, src_addrs, sizes, count, dst_base, "
     "src_base) in one call, the bytes split evenly over the threads."},
    {"copy_blocks", copy_blocks, METH_VARARGS,
     "copy_blocks(dst_addrs, src_addrs, sizes, count, threads, streaming[, dst_base, src_base]): copy `count` "
     "blocks; the first three are addresses of int64 arrays, the bases are added to every address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hostcopy", "Batched host block copies.", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hostcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "STREAMING_STORES", HICACHE_HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
