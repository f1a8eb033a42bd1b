/* The node store's atomic slot operations (optional; hicache.effects._arena._slots has a correct
 * fallback without a compiler).
 *
 * load/store/fetch_add: 64-bit words of the shared arena with acquire/release ordering, so a
 * reader that sees a slot's even generation also sees the bytes published before it - on weakly
 * ordered CPUs (aarch64: Grace Hopper) too.
 * copy_pages: a batch of page copies between a pool's page segments and arena slots, without the
 * GIL, checksumming every 8-byte word as it is copied - the checksum of exactly the bytes
 * written or delivered, in one pass at memory speed. The sum (`hicache.plan`'s SUM_HALFWORD_FLETCHER,
 * stated and proved in docs/store.md): the page's words w_i (i < N) as 2N half-words
 * x_p = 32-bit halves (p = 2i low, 2i + 1 high), and
 *     sum1 = seed1 + sum_i w_i                 mod 2**64
 *     sum2 = seed2 + sum_p (2N - p) x_p        mod 2**64  (Fletcher's second sum over half-words)
 * Any error inside one word moves sum1 by its nonzero difference: detected. Half-words summed
 * into 64-bit lanes cannot wrap (below 2**32 of them), so two flips of one bit position that
 * cancel in sum1 move sum2 by 2**k times a distance below 2**33: every error of at most two
 * bits is detected too (pages below 16 GiB). Computed in 8 sub-lanes (word i in lane i % 4, its
 * low and high half apart: a += x, b += a), folded at the page's end; adds, ands and shifts only,
 * so SSE2 runs it beside the copy (the old sum folded lanes as a0 + 2a1 + 3a2 + 4a3 and lost the
 * top bits: issue #51).
 * lookup: for each 16-byte key, the slot of its window holding it with an even generation.
 * Bounds are the caller's (hicache.effects._arena._slots checks every segment against the
 * arena and the pool before calling).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <fcntl.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
/* The SSE2 copy-and-sum on x86-64; the plain C loop elsewhere (aarch64: Grace Hopper), which a
 * build with -DHICACHE_PORTABLE_SUM runs on x86-64 too - so the suite checks it where CI runs. */
#if defined(__SSE2__) && !defined(HICACHE_PORTABLE_SUM)
#define SSE2_SUM 1
#else
#define SSE2_SUM 0
#endif

#define MAX_THREADS 8

/* Test builds only (-DHICACHE_STEP_HOOK; setup.py never sets it, so a user's build has no hook and
 * no cost): set_step_hook(f) makes the slot protocol call f(stage, n) with the GIL at each of its
 * steps, where the tests stop a writer or a reader of the C path users run - or kill it - as they
 * do the Python path's through SlotIndex's fault hook. A write's steps are the Python write's:
 * "claimed", "half" (half of the page's segments copied in), "copied", "summed", "published"
 * (n: the key's index among the keys the call was given); a lookup's "looked" comes between
 * reading a slot's even generation and comparing its key (n: the slot); a read's "delivered"
 * between copying a found page out and re-checking its generation (n: the key's index). An
 * exception the hook raises is printed and ignored: the protocol runs on as a user's build would. */
#ifdef HICACHE_STEP_HOOK
static PyObject *step_hook = NULL;

static void step(const char *stage, Py_ssize_t n) {
    PyGILState_STATE gil = PyGILState_Ensure(); /* any thread: the caller's, or a copy thread of run_job */
    PyObject *hook = step_hook;
    Py_XINCREF(hook);
    if (hook != NULL) {
        PyObject *result = PyObject_CallFunction(hook, "sn", stage, n);
        if (result == NULL) PyErr_WriteUnraisable(hook);
        Py_XDECREF(result);
        Py_DECREF(hook);
    }
    PyGILState_Release(gil);
}
#define STEP(stage, n) step(stage, n)

static PyObject *set_step_hook(PyObject *self, PyObject *hook) {
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "set_step_hook: a callable or None");
        return NULL;
    }
    PyObject *old = step_hook;
    step_hook = hook == Py_None ? NULL : hook;
    Py_XINCREF(step_hook);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}
#define STEP_HOOK 1
#else
#define STEP(stage, n) ((void)0)
#define STEP_HOOK 0
#endif

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

/* the page's running sums: lane l (word i % 4), its low and high halves apart */
typedef struct {
    uint64_t alo[4], ahi[4], blo[4], bhi[4];
} sums_t;

static inline void word_sum(sums_t *s, uint64_t i, uint64_t w) {
    int l = (int)(i & 3);
    s->alo[l] += w & 0xFFFFFFFFu;
    s->ahi[l] += w >> 32;
    s->blo[l] += s->alo[l];
    s->bhi[l] += s->ahi[l];
}

/* blocks of 4 words (the first in lane 0): copied from f to t (unless t is NULL) and summed. On
 * x86-64 SSE2 (its baseline), with streaming stores past the caches when t is 16-byte aligned -
 * made visible before the slot's generation is published by the sfence at the end of copy_pages. */
static void blocks_sum(const unsigned char *f, unsigned char *t, uint64_t blocks, sums_t *s) {
#if SSE2_SUM
    const __m128i mask = _mm_set1_epi64x(0xFFFFFFFFLL);
    __m128i alo01 = _mm_loadu_si128((const __m128i *)s->alo), alo23 = _mm_loadu_si128((const __m128i *)(s->alo + 2));
    __m128i ahi01 = _mm_loadu_si128((const __m128i *)s->ahi), ahi23 = _mm_loadu_si128((const __m128i *)(s->ahi + 2));
    __m128i blo01 = _mm_loadu_si128((const __m128i *)s->blo), blo23 = _mm_loadu_si128((const __m128i *)(s->blo + 2));
    __m128i bhi01 = _mm_loadu_si128((const __m128i *)s->bhi), bhi23 = _mm_loadu_si128((const __m128i *)(s->bhi + 2));
    int stream = t != NULL && ((uintptr_t)t & 15) == 0;
    for (uint64_t q = 0; q < blocks; q++) {
        __m128i v01 = _mm_loadu_si128((const __m128i *)(f + 32 * q));
        __m128i v23 = _mm_loadu_si128((const __m128i *)(f + 32 * q + 16));
        if (stream) {
            _mm_stream_si128((__m128i *)(t + 32 * q), v01);
            _mm_stream_si128((__m128i *)(t + 32 * q + 16), v23);
        } else if (t != NULL) {
            _mm_storeu_si128((__m128i *)(t + 32 * q), v01);
            _mm_storeu_si128((__m128i *)(t + 32 * q + 16), v23);
        }
        alo01 = _mm_add_epi64(alo01, _mm_and_si128(v01, mask));
        ahi01 = _mm_add_epi64(ahi01, _mm_srli_epi64(v01, 32));
        alo23 = _mm_add_epi64(alo23, _mm_and_si128(v23, mask));
        ahi23 = _mm_add_epi64(ahi23, _mm_srli_epi64(v23, 32));
        blo01 = _mm_add_epi64(blo01, alo01);
        bhi01 = _mm_add_epi64(bhi01, ahi01);
        blo23 = _mm_add_epi64(blo23, alo23);
        bhi23 = _mm_add_epi64(bhi23, ahi23);
    }
    _mm_storeu_si128((__m128i *)s->alo, alo01); _mm_storeu_si128((__m128i *)(s->alo + 2), alo23);
    _mm_storeu_si128((__m128i *)s->ahi, ahi01); _mm_storeu_si128((__m128i *)(s->ahi + 2), ahi23);
    _mm_storeu_si128((__m128i *)s->blo, blo01); _mm_storeu_si128((__m128i *)(s->blo + 2), blo23);
    _mm_storeu_si128((__m128i *)s->bhi, bhi01); _mm_storeu_si128((__m128i *)(s->bhi + 2), bhi23);
#else
    for (uint64_t q = 0; q < blocks; q++) {
        uint64_t v[4];
        memcpy(v, f + 32 * q, 32);
        if (t != NULL) memcpy(t + 32 * q, v, 32);
        for (int l = 0; l < 4; l++) word_sum(s, (uint64_t)l, v[l]);
    }
#endif
}

/* the page's (sum1, sum2) from its running sums over n words (see the charter) */
static void fold_sums(const sums_t *s, uint64_t n, uint64_t seed1, uint64_t seed2, uint64_t *out) {
    uint64_t sum1 = seed1, sum2 = seed2, halves = 2 * n;
    for (uint64_t l = 0; l < 4; l++) {
        uint64_t count = (n + 3 - l) / 4; /* words in lane l */
        sum1 += s->alo[l] + (s->ahi[l] << 32);
        sum2 += 8 * (s->blo[l] + s->bhi[l]) + (halves - 2 * l - 8 * count) * s->alo[l]
                + (halves - 2 * l - 1 - 8 * count) * s->ahi[l];
    }
    out[0] = sum1;
    out[1] = sum2;
}

typedef struct {
    int direction;
    Py_ssize_t per_page;
    const uint64_t *slot, *ptr, *len;
    uint64_t *sum;
    const Py_ssize_t *segs_of; /* page p's segments are those of page segs_of[p] (NULL: of page p) */
} job_t;

typedef struct {
    const job_t *job;
    Py_ssize_t first, last;
} share_t;

/* pages [first, last) of a job: each page's segments copied and checksummed */
static void *run_share(void *arg) {
    const share_t *share = arg;
    const job_t *job = share->job;
    const int direction = job->direction;
    const Py_ssize_t per_page = job->per_page;
    const uint64_t *slot = job->slot, *ptr = job->ptr, *len = job->len;
    uint64_t *sum = job->sum;
    for (Py_ssize_t p = share->first; p < share->last; p++) {
        sums_t sums;
        uint64_t i = 0;
        memset(&sums, 0, sizeof sums);
        unsigned char *at = (unsigned char *)(uintptr_t)slot[p];
        const Py_ssize_t first_seg = (job->segs_of ? job->segs_of[p] : p) * per_page;
        for (Py_ssize_t s = 0; s < per_page; s++) {
            uint64_t n = len[first_seg + s] / 8, k = 0, w;
            unsigned char *seg = (unsigned char *)(uintptr_t)ptr[first_seg + s];
            const unsigned char *from = direction == 0 ? seg : at;
            unsigned char *to = direction == 0 ? at : seg;
            for (; k < n && (i & 3); k++, i++) { /* to a lane-0 word */
                memcpy(&w, from + 8 * k, 8);
                if (direction != 2) memcpy(to + 8 * k, &w, 8);
                word_sum(&sums, i, w);
            }
            uint64_t blocks = (n - k) / 4;
            blocks_sum(from + 8 * k, direction == 2 ? NULL : to + 8 * k, blocks, &sums);
            k += 4 * blocks;
            i += 4 * blocks;
            for (; k < n; k++, i++) {
                memcpy(&w, from + 8 * k, 8);
                if (direction != 2) memcpy(to + 8 * k, &w, 8);
                word_sum(&sums, i, w);
            }
            at += 8 * n;
            if (direction == 0 && s + 1 == (per_page > 1 ? per_page / 2 : 1))
                STEP("half", job->segs_of ? job->segs_of[p] : p);
        }
        fold_sums(&sums, i, sum[2 * p], sum[2 * p + 1], sum + 2 * p);
    }
#if defined(__SSE2__)
    _mm_sfence();
#endif
    return NULL;
}

/* a job's pages shared out over up to `threads` threads (this one included); call without the GIL */
static void run_job(const job_t *job, Py_ssize_t pages, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > pages) threads = pages > 0 ? (int)pages : 1;
    share_t shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        shares[t].job = job;
        shares[t].first = pages * t / threads;
        shares[t].last = pages * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_share(&shares[t]); /* a thread that could not start: its pages here */
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are weakly ordered: all visible before any publish */
#endif
}

/* copy_pages(direction, pages, per_page, slots, seg_ptrs, seg_lens, sums[, threads])
 * direction 0: segments -> slot (a write), 1: slot -> segments (a read), 2: sum the slot only.
 * sums: 2 u64 per page, the seeds in, the checksums out. */
static PyObject *copy_pages(PyObject *self, PyObject *args) {
    int direction, threads = 1;
    Py_ssize_t pages, per_page;
    PyObject *o_slots, *o_ptrs, *o_lens, *o_sums;
    if (!PyArg_ParseTuple(args, "innOOOO|i", &direction, &pages, &per_page, &o_slots, &o_ptrs, &o_lens, &o_sums,
                          &threads))
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
    job_t job = {direction, per_page, slots.buf, ptrs.buf, lens.buf, sums.buf, NULL};
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, pages, threads);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&slots); PyBuffer_Release(&ptrs); PyBuffer_Release(&lens); PyBuffer_Release(&sums);
    Py_RETURN_NONE;
}

/* the slot of `key`'s window holding it with an even generation (UINT64_MAX: none), and that generation */
static void find_key(uint64_t index_addr, uint64_t nslots, Py_ssize_t window, const unsigned char *key,
                     uint64_t *slot, uint64_t *seen) {
    uint64_t home;
    memcpy(&home, key, 8);
    home %= nslots;
    *slot = UINT64_MAX;
    *seen = 0;
    for (Py_ssize_t j = 0; j < window; j++) {
        unsigned char *rec = (unsigned char *)(uintptr_t)(index_addr + ((home + j) % nslots) * RECORD_BYTES);
        uint64_t gen = __atomic_load_n((uint64_t *)rec, __ATOMIC_ACQUIRE);
        if (gen == 0 || (gen & 1)) continue;
        STEP("looked", (Py_ssize_t)((home + j) % nslots));
        if (memcmp(rec + 8, key, 16) != 0) continue;
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the key's bytes were read before the re-check */
        if (__atomic_load_n((uint64_t *)rec, __ATOMIC_RELAXED) != gen) continue;
        *slot = (home + j) % nslots;
        *seen = gen;
        return;
    }
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
    for (Py_ssize_t i = 0; i < n; i++) find_key(index_addr, (uint64_t)nslots, window, key + 16 * i, out + i, gen_out + i);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&keys); PyBuffer_Release(&found); PyBuffer_Release(&gens);
    Py_RETURN_NONE;
}

/* A record's fields read by read_pages (hicache.plan's RECORD; _slots checks them at import). */
#define OFF_SUM1 24
#define OFF_SUM2 32
#define OFF_LENGTH 40
#define OFF_REF 50
enum { MISS = 0, HIT = 1, TORN = 2, CORRUPT = 3 };

/* whether the slot's generation is still `seen`: every read of it before this one is done first */
static inline int still(const unsigned char *rec, uint64_t seen) {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n((const uint64_t *)rec, __ATOMIC_RELAXED) == seen;
}

/* the first page whose segments are not whole 8-byte words of at most a page each adding up to
 * page_bytes, or -1: the size rule read_pages, write_pages and check_segments check before
 * anything moves (no total can wrap: it stops at the first segment past a page) */
static Py_ssize_t uneven_page(const uint64_t *len, Py_ssize_t pages, Py_ssize_t per_page, uint64_t page_bytes) {
    for (Py_ssize_t i = 0; i < pages; i++) {
        uint64_t total = 0;
        for (Py_ssize_t s = 0; s < per_page; s++) {
            uint64_t size = len[i * per_page + s];
            if (size == 0 || size % 8 || size > page_bytes) { total = UINT64_MAX; break; }
            total += size;
        }
        if (total != page_bytes) return i;
    }
    return -1;
}

/* read_pages(index_addr, data_addr, nslots, window, slot_stride, page_bytes, keys, seg_ptrs, seg_lens,
 *            per_page, status, found, gens[, threads[, given]])
 * The read side of the slot protocol in one call, without the GIL (a 64 KiB-page batch spent
 * half its time in per-page Python around copy_pages: issue #51). Each 16-byte key is looked
 * up in its window; a slot found has its record's length checked, its payload copied into the
 * page's segments while checksumming what was delivered (seeded by the key), then its
 * generation re-read. status[i] (one byte): MISS (not held), HIT, TORN (a writer moved the slot
 * on: the bytes are not the key's) or CORRUPT (the length or checksum disagree while the slot
 * stood still). A hit sets the slot's CLOCK referenced bit. found/gens: each key's slot and the
 * generation it was seen with (the caller reclaims a corrupt slot only while it still has it);
 * with `given`, found/gens come in from the caller's own lookup (a writer can then be made to
 * move a slot on between the lookup and the read: the tests' seam).
 * Every page's segments are whole words adding up to page_bytes <= slot_stride, checked before
 * anything is read; where the segments point is the caller's check. */
static PyObject *read_pages(PyObject *self, PyObject *args) {
    unsigned long long index_addr, data_addr, slot_stride, page_bytes;
    Py_ssize_t nslots, window, per_page;
    int threads = 1, given = 0;
    Py_buffer keys;
    PyObject *o_ptrs, *o_lens, *o_status, *o_found, *o_gens;
    if (!PyArg_ParseTuple(args, "KKnnKKy*OOnOOO|ii", &index_addr, &data_addr, &nslots, &window, &slot_stride,
                          &page_bytes, &keys, &o_ptrs, &o_lens, &per_page, &o_status, &o_found, &o_gens, &threads,
                          &given))
        return NULL;
    Py_ssize_t n = keys.len / 16;
    if (nslots < 1 || window < 1 || per_page < 1 || keys.len % 16 || page_bytes % 8 || page_bytes > slot_stride) {
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_ValueError, "read_pages: bad slot count, window, segment count, key bytes or page bytes");
        return NULL;
    }
    Py_buffer ptrs, lens, status, found, gens;
    int got = 0;
    if (get_u64(o_ptrs, &ptrs, n * per_page, "seg_ptrs") == 0) got = 1;
    if (got == 1 && get_u64(o_lens, &lens, n * per_page, "seg_lens") == 0) got = 2;
    if (got == 2) {
        if (PyObject_GetBuffer(o_status, &status, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
            got = 3;
            if (status.len < n) PyErr_Format(PyExc_ValueError, "status holds %zd bytes, %zd needed", status.len, n);
        }
    }
    if (got == 3 && status.len >= n && get_u64(o_found, &found, n, "found") == 0) got = 4;
    if (got == 4 && get_u64(o_gens, &gens, n, "gens") == 0) got = 5;
    Py_ssize_t uneven = got == 5 ? uneven_page(lens.buf, n, per_page, page_bytes) : -1;
    if (uneven >= 0) {
        PyErr_Format(PyExc_ValueError, "read_pages: page %zd's segments are not whole words adding up to %llu bytes",
                     uneven, page_bytes);
        got = 6;
    }
    uint64_t *slot_addrs = NULL, *sums = NULL;
    Py_ssize_t *picked = NULL;
    if (got == 5) {
        slot_addrs = malloc(sizeof(uint64_t) * (n ? n : 1));
        sums = malloc(2 * sizeof(uint64_t) * (n ? n : 1));
        picked = malloc(sizeof(Py_ssize_t) * (n ? n : 1));
        if (!slot_addrs || !sums || !picked) { PyErr_NoMemory(); got = 7; }
    }
    if (got != 5) {
        free(slot_addrs); free(sums); free(picked);
        if (got >= 5) PyBuffer_Release(&gens);
        if (got >= 4) PyBuffer_Release(&found);
        if (got >= 3) PyBuffer_Release(&status);
        if (got >= 2) PyBuffer_Release(&lens);
        if (got >= 1) PyBuffer_Release(&ptrs);
        PyBuffer_Release(&keys);
        return NULL;
    }
    const unsigned char *key = keys.buf;
    unsigned char *state = status.buf;
    uint64_t *slot_of = found.buf, *seen = gens.buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t copying = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!given) find_key(index_addr, (uint64_t)nslots, window, key + 16 * i, slot_of + i, seen + i);
        state[i] = MISS;
        if (slot_of[i] >= (uint64_t)nslots || (seen[i] & 1)) continue; /* not held (a given slot: checked) */
        const unsigned char *rec = (const unsigned char *)(uintptr_t)(index_addr + slot_of[i] * RECORD_BYTES);
        uint32_t length;
        memcpy(&length, rec + OFF_LENGTH, 4);
        if (length != page_bytes) { /* the key's digest fixes its length: another is corrupt - unless moved on */
            state[i] = still(rec, seen[i]) ? CORRUPT : TORN;
            continue;
        }
        slot_addrs[copying] = data_addr + slot_of[i] * slot_stride;
        memcpy(sums + 2 * copying, key + 16 * i, 16); /* the seeds: the key's two little-endian words */
        picked[copying++] = i;
    }
    job_t job = {1, per_page, slot_addrs, ptrs.buf, lens.buf, sums, picked};
    run_job(&job, copying, threads);
    for (Py_ssize_t c = 0; c < copying; c++) STEP("delivered", picked[c]);
    for (Py_ssize_t c = 0; c < copying; c++) {
        Py_ssize_t i = picked[c];
        unsigned char *rec = (unsigned char *)(uintptr_t)(index_addr + slot_of[i] * RECORD_BYTES);
        uint64_t sum1, sum2;
        memcpy(&sum1, rec + OFF_SUM1, 8); /* read before the re-check: they belong to the generation seen */
        memcpy(&sum2, rec + OFF_SUM2, 8);
        if (!still(rec, seen[i])) state[i] = TORN; /* rewritten while we copied: those bytes are not the key's */
        else if (sum1 != sums[2 * c] || sum2 != sums[2 * c + 1]) state[i] = CORRUPT;
        else {
            state[i] = HIT;
            __atomic_store_n(rec + OFF_REF, (unsigned char)1, __ATOMIC_RELAXED); /* CLOCK: referenced */
        }
    }
    Py_END_ALLOW_THREADS
    free(slot_addrs); free(sums); free(picked);
    PyBuffer_Release(&gens); PyBuffer_Release(&found); PyBuffer_Release(&status); PyBuffer_Release(&lens);
    PyBuffer_Release(&ptrs); PyBuffer_Release(&keys);
    Py_RETURN_NONE;
}

#define OFF_DEPTH 44

/* victims(index_addr, nslots, window, keys, slots, gens): for each 16-byte key, the slots of its
 * window in the order a writer tries them, each with the generation it was seen with - empty
 * (generation 0 or no key) and torn (odd) in window order, then unreferenced pages and then
 * referenced ones, each by descending chain depth, then slot. A window of referenced pages only
 * loses every referenced bit (CLOCK's hand passing: their second chance is spent). Read without
 * locks: the writer re-checks a slot's generation under its lock before taking it. */
static PyObject *victims(PyObject *self, PyObject *args) {
    unsigned long long index_addr;
    Py_ssize_t nslots, window;
    Py_buffer keys;
    PyObject *o_slots, *o_gens;
    if (!PyArg_ParseTuple(args, "Knny*OO", &index_addr, &nslots, &window, &keys, &o_slots, &o_gens)) return NULL;
    Py_ssize_t n = keys.len / 16;
    if (nslots < 1 || window < 1 || window > 64 || window > nslots || keys.len % 16) {
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_ValueError, "victims: bad slot count, window (1-64, at most the slots) or key bytes");
        return NULL;
    }
    Py_buffer slots, gens;
    if (get_u64(o_slots, &slots, n * window, "slots") < 0) { PyBuffer_Release(&keys); return NULL; }
    if (get_u64(o_gens, &gens, n * window, "gens") < 0) { PyBuffer_Release(&keys); PyBuffer_Release(&slots); return NULL; }
    const unsigned char *key = keys.buf;
    uint64_t *slot_out = slots.buf, *gen_out = gens.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t home, slot[64], gen[64], rank[64]; /* rank: class << 32 | order within the class */
        int order[64], warm = 0;
        memcpy(&home, key + 16 * i, 8);
        home %= (uint64_t)nslots;
        for (Py_ssize_t j = 0; j < window; j++) {
            const unsigned char *rec = (const unsigned char *)(uintptr_t)(index_addr + ((home + j) % nslots) * RECORD_BYTES);
            uint64_t g = __atomic_load_n((const uint64_t *)rec, __ATOMIC_ACQUIRE), k0, k1;
            uint32_t depth;
            memcpy(&k0, rec + 8, 8);
            memcpy(&k1, rec + 16, 8);
            memcpy(&depth, rec + OFF_DEPTH, 4);
            slot[j] = (home + j) % nslots;
            gen[j] = g;
            order[j] = (int)j;
            if (g == 0 || (k0 == 0 && k1 == 0)) rank[j] = (uint64_t)j; /* empty: window order */
            else if (g & 1) rank[j] = (1ULL << 32) | (uint64_t)j; /* torn: a dead writer's, or in flight */
            else if (rec[OFF_REF]) { rank[j] = (3ULL << 32) | (uint64_t)(UINT32_MAX - depth); warm++; }
            else rank[j] = (2ULL << 32) | (uint64_t)(UINT32_MAX - depth);
        }
        for (Py_ssize_t a = 1; a < window; a++) { /* insertion sort: 16 entries; ties by slot */
            int o = order[a];
            Py_ssize_t b = a - 1;
            while (b >= 0 && (rank[order[b]] > rank[o] || (rank[order[b]] == rank[o] && slot[order[b]] > slot[o]))) {
                order[b + 1] = order[b];
                b--;
            }
            order[b + 1] = o;
        }
        if (warm == window) /* CLOCK's hand passes: every page loses its second chance */
            for (Py_ssize_t j = 0; j < window; j++)
                __atomic_store_n((unsigned char *)(uintptr_t)(index_addr + slot[j] * RECORD_BYTES) + OFF_REF,
                                 (unsigned char)0, __ATOMIC_RELAXED);
        for (Py_ssize_t j = 0; j < window; j++) {
            slot_out[i * window + j] = slot[order[j]];
            gen_out[i * window + j] = gen[order[j]];
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&keys); PyBuffer_Release(&slots); PyBuffer_Release(&gens);
    Py_RETURN_NONE;
}

#define OFF_NS 48
#define OFF_WRITER 52
#define OFF_STAMP 56

/* an OFD lock (F_WRLCK) or unlock (F_UNLCK) of the records of `count` slots from `offset` of the
 * arena file, never waiting: whether it was taken - only where no other open file holds a lock on
 * any of them (hicache.effects._arena._slots.try_lock's lock, so either side sees the other's);
 * record_lock: one record's */
static int records_lock(int fd, uint64_t offset, uint64_t count, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)offset;
    fl.l_len = (off_t)(count * RECORD_BYTES);
    return fcntl(fd, F_OFD_SETLK, &fl) == 0;
}

static int record_lock(int fd, uint64_t offset, short type) { return records_lock(fd, offset, 1, type); }

/* write_pages(index_addr, data_addr, fd, index_offset, nslots, window, slot_stride, page_bytes, keys,
 *             seg_ptrs, seg_lens, per_page, order, seen, depths, namespace, pid, stamp, status[, threads])
 * The write side of the slot protocol in one call, without the GIL (per-page Python around the
 * copy was most of a 64 KiB-page batch_set_v1: issue #51) - hicache.store._index's `_write`, step
 * for step, which the fallback and the tests' fault hooks run. For each 16-byte key (one not held)
 * the slots of its window in `order` (from victims; `seen`: the generation each was seen with) are
 * tried in turn: a slot this batch took already is skipped; one whose record lock another writer
 * holds is skipped; one whose generation moved on since it was seen is let go. The first taken
 * becomes odd (being written), gets its record (key, zero sums, length, depth, namespace, writer,
 * stamp); then every claimed page is copied in and checksummed, its sums stored, its generation
 * published even, and every lock let go. status[i]: 0 not stored (every slot of its window
 * busy), 1 stored, 2 stored in place of a live page (an eviction). Every page's segments are whole
 * words adding up to page_bytes <= slot_stride, checked before anything is locked; where the
 * segments point is the caller's check. */
static PyObject *write_pages(PyObject *self, PyObject *args) {
    unsigned long long index_addr, data_addr, index_offset, slot_stride, page_bytes, stamp;
    unsigned int namespace_entry, pid;
    int fd, threads = 1;
    Py_ssize_t nslots, window, per_page;
    Py_buffer keys;
    PyObject *o_ptrs, *o_lens, *o_order, *o_seen, *o_depths, *o_status;
    if (!PyArg_ParseTuple(args, "KKiKnnKKy*OOnOOOIIKO|i", &index_addr, &data_addr, &fd, &index_offset, &nslots,
                          &window, &slot_stride, &page_bytes, &keys, &o_ptrs, &o_lens, &per_page, &o_order, &o_seen,
                          &o_depths, &namespace_entry, &pid, &stamp, &o_status, &threads))
        return NULL;
    Py_ssize_t n = keys.len / 16;
    if (nslots < 1 || window < 1 || per_page < 1 || keys.len % 16 || page_bytes % 8 || page_bytes > slot_stride
        || namespace_entry > 0xFFFF) {
        PyBuffer_Release(&keys);
        PyErr_SetString(PyExc_ValueError, "write_pages: bad slot count, window, segment count, key bytes, page bytes "
                        "or namespace entry");
        return NULL;
    }
    Py_buffer ptrs, lens, order, seen, depths, status;
    int got = 0;
    if (get_u64(o_ptrs, &ptrs, n * per_page, "seg_ptrs") == 0) got = 1;
    if (got == 1 && get_u64(o_lens, &lens, n * per_page, "seg_lens") == 0) got = 2;
    if (got == 2 && get_u64(o_order, &order, n * window, "order") == 0) got = 3;
    if (got == 3 && get_u64(o_seen, &seen, n * window, "seen") == 0) got = 4;
    if (got == 4 && get_u64(o_depths, &depths, n, "depths") == 0) got = 5;
    if (got == 5 && PyObject_GetBuffer(o_status, &status, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
        got = 6;
        if (status.len < n) {
            PyErr_Format(PyExc_ValueError, "status holds %zd bytes, %zd needed", status.len, n);
            got = 7;
        }
    }
    const uint64_t *slots_in = got >= 3 ? order.buf : NULL;
    Py_ssize_t uneven = got == 6 ? uneven_page(lens.buf, n, per_page, page_bytes) : -1;
    if (uneven >= 0) {
        PyErr_Format(PyExc_ValueError, "write_pages: page %zd's segments are not whole words adding up to %llu bytes",
                     uneven, page_bytes);
        got = 7;
    }
    for (Py_ssize_t k = 0; got == 6 && k < n * window; k++) {
        if (slots_in[k] >= (uint64_t)nslots) {
            PyErr_Format(PyExc_ValueError, "write_pages: slot %llu is past the arena's %zd", slots_in[k], nslots);
            got = 7;
        }
    }
    uint64_t *slot_addrs = NULL, *sums = NULL, *claimed_slot = NULL, *claimed_odd = NULL;
    Py_ssize_t *picked = NULL;
    unsigned char *taken = NULL, *evicted = NULL;
    if (got == 6) {
        Py_ssize_t m = n ? n : 1;
        slot_addrs = malloc(sizeof(uint64_t) * m);
        sums = malloc(2 * sizeof(uint64_t) * m);
        claimed_slot = malloc(sizeof(uint64_t) * m);
        claimed_odd = malloc(sizeof(uint64_t) * m);
        picked = malloc(sizeof(Py_ssize_t) * m);
        evicted = calloc((size_t)m, 1);
        taken = calloc((size_t)(nslots + 7) / 8, 1); /* a bit per slot: the ones this batch claimed */
        if (!slot_addrs || !sums || !claimed_slot || !claimed_odd || !picked || !evicted || !taken) {
            PyErr_NoMemory();
            got = 7;
        }
    }
    if (got != 6) {
        free(slot_addrs); free(sums); free(claimed_slot); free(claimed_odd); free(picked); free(evicted); free(taken);
        if (got >= 6) PyBuffer_Release(&status);
        if (got >= 5) PyBuffer_Release(&depths);
        if (got >= 4) PyBuffer_Release(&seen);
        if (got >= 3) PyBuffer_Release(&order);
        if (got >= 2) PyBuffer_Release(&lens);
        if (got >= 1) PyBuffer_Release(&ptrs);
        PyBuffer_Release(&keys);
        return NULL;
    }
    const unsigned char *key = keys.buf;
    const uint64_t *seen_gen = seen.buf, *depth = depths.buf;
    unsigned char *state = status.buf;
    static const unsigned char zero_key[16] = {0};
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t claimed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        state[i] = 0;
        for (Py_ssize_t j = 0; j < window; j++) {
            uint64_t slot = slots_in[i * window + j];
            if (taken[slot / 8] & (1u << (slot % 8))) continue;
            if (!record_lock(fd, index_offset + slot * RECORD_BYTES, F_WRLCK)) continue;
            unsigned char *rec = (unsigned char *)(uintptr_t)(index_addr + slot * RECORD_BYTES);
            uint64_t gen = __atomic_load_n((uint64_t *)rec, __ATOMIC_ACQUIRE);
            if (gen != seen_gen[i * window + j]) { /* another writer filled or changed it since: not ours */
                record_lock(fd, index_offset + slot * RECORD_BYTES, F_UNLCK);
                continue;
            }
            evicted[i] = gen && !(gen & 1) && memcmp(rec + 8, zero_key, 16) != 0;
            uint64_t odd = gen % 2 == 0 ? gen + 1 : gen + 2;
            __atomic_store_n((uint64_t *)rec, odd, __ATOMIC_RELAXED);
            __atomic_thread_fence(__ATOMIC_RELEASE); /* odd before any byte of the record or payload */
            uint64_t zero = 0, dep = depth[i] & 0xFFFFFFFFu, when = stamp;
            uint32_t length = (uint32_t)page_bytes, depth32 = (uint32_t)dep, writer = pid;
            uint16_t ns = (uint16_t)namespace_entry;
            unsigned char ref_pad[2] = {0, 0};
            memcpy(rec + 8, key + 16 * i, 16);
            memcpy(rec + OFF_SUM1, &zero, 8);
            memcpy(rec + OFF_SUM2, &zero, 8);
            memcpy(rec + OFF_LENGTH, &length, 4);
            memcpy(rec + OFF_DEPTH, &depth32, 4);
            memcpy(rec + OFF_NS, &ns, 2);
            memcpy(rec + OFF_REF, ref_pad, 2);
            memcpy(rec + OFF_WRITER, &writer, 4);
            memcpy(rec + OFF_STAMP, &when, 8);
            taken[slot / 8] |= (unsigned char)(1u << (slot % 8));
            slot_addrs[claimed] = data_addr + slot * slot_stride;
            memcpy(sums + 2 * claimed, key + 16 * i, 16); /* the seeds: the key's two little-endian words */
            claimed_slot[claimed] = slot;
            claimed_odd[claimed] = odd;
            picked[claimed++] = i;
            STEP("claimed", i);
            break;
        }
    }
    job_t job = {0, per_page, slot_addrs, ptrs.buf, lens.buf, sums, picked};
    run_job(&job, claimed, threads); /* its sfence: every payload byte visible before a publish */
    for (Py_ssize_t c = 0; c < claimed; c++) STEP("copied", picked[c]);
    for (Py_ssize_t c = 0; c < claimed; c++) {
        unsigned char *rec = (unsigned char *)(uintptr_t)(index_addr + claimed_slot[c] * RECORD_BYTES);
        __atomic_store_n((uint64_t *)(rec + OFF_SUM1), sums[2 * c], __ATOMIC_RELEASE);
        __atomic_store_n((uint64_t *)(rec + OFF_SUM2), sums[2 * c + 1], __ATOMIC_RELEASE);
        STEP("summed", picked[c]);
        __atomic_store_n((uint64_t *)rec, claimed_odd[c] + 1, __ATOMIC_RELEASE); /* publish */
        state[picked[c]] = evicted[picked[c]] ? 2 : 1;
        STEP("published", picked[c]);
    }
    for (Py_ssize_t c = 0; c < claimed; c++)
        record_lock(fd, index_offset + claimed_slot[c] * RECORD_BYTES, F_UNLCK);
    Py_END_ALLOW_THREADS
    free(slot_addrs); free(sums); free(claimed_slot); free(claimed_odd); free(picked); free(evicted); free(taken);
    PyBuffer_Release(&status); PyBuffer_Release(&depths); PyBuffer_Release(&seen); PyBuffer_Release(&order);
    PyBuffer_Release(&lens); PyBuffer_Release(&ptrs); PyBuffer_Release(&keys);
    Py_RETURN_NONE;
}

/* clear_slots(index_addr, fd, index_offset, nslots, slots, seen, empty, run) -> how many emptied
 * A clear's reclaims in one call, without the GIL (hicache.effects._arena._slots's
 * `_python_clear_slots`, the fallback, runs them slot by slot; a clear from Python took 4.5 us a
 * slot, 10 s of SGLang's scheduler thread for 2.2 M pages). `slots` ascending, each with the generation it was seen with (`seen`). The slots within
 * `run` of a run's first are locked with one OFD lock over their records; where another writer
 * holds any of them, each is locked on its own (a busy one is left: that writer is storing a page
 * now). A locked slot whose generation is still the one seen is made odd (past an even one),
 * given the empty record (`empty`: its bytes after the generation), published even and let go;
 * one whose generation moved on is someone else's now. The caller holds its process's write lock
 * (OFD locks do not exclude its own threads). Step "reclaiming" (n: the slot) comes between the
 * odd generation and the empty record. */
static PyObject *clear_slots(PyObject *self, PyObject *args) {
    unsigned long long index_addr, index_offset;
    int fd;
    Py_ssize_t nslots, run;
    Py_buffer empty;
    PyObject *o_slots, *o_seen;
    if (!PyArg_ParseTuple(args, "KiKnOOy*n", &index_addr, &fd, &index_offset, &nslots, &o_slots, &o_seen, &empty,
                          &run))
        return NULL;
    if (nslots < 1 || run < 1 || empty.len != RECORD_BYTES - 8) {
        PyBuffer_Release(&empty);
        PyErr_SetString(PyExc_ValueError, "clear_slots: bad slot count, run or empty record");
        return NULL;
    }
    Py_buffer slots, seen;
    if (get_u64(o_slots, &slots, 0, "clear_slots: slots") < 0) { PyBuffer_Release(&empty); return NULL; }
    Py_ssize_t n = slots.len / 8;
    if (get_u64(o_seen, &seen, n, "clear_slots: seen") < 0) {
        PyBuffer_Release(&slots); PyBuffer_Release(&empty);
        return NULL;
    }
    const uint64_t *slot = slots.buf, *seen_gen = seen.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (slot[k] >= (uint64_t)nslots || (k && slot[k] <= slot[k - 1])) {
            PyErr_Format(PyExc_ValueError, "clear_slots: slot %llu is past the arena's %zd or out of order",
                         (unsigned long long)slot[k], nslots);
            PyBuffer_Release(&seen); PyBuffer_Release(&slots); PyBuffer_Release(&empty);
            return NULL;
        }
    }
    Py_ssize_t cleared = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = i;
        while (j < n && slot[j] - slot[i] < (uint64_t)run) j++;
        uint64_t first = slot[i], count = slot[j - 1] - first + 1;
        int whole = records_lock(fd, index_offset + first * RECORD_BYTES, count, F_WRLCK);
        for (Py_ssize_t k = i; k < j; k++) {
            uint64_t offset = index_offset + slot[k] * RECORD_BYTES;
            if (!whole && !record_lock(fd, offset, F_WRLCK)) continue;
            unsigned char *rec = (unsigned char *)(uintptr_t)(index_addr + slot[k] * RECORD_BYTES);
            uint64_t gen = __atomic_load_n((uint64_t *)rec, __ATOMIC_ACQUIRE);
            if (gen == seen_gen[k]) {
                uint64_t odd = gen % 2 == 0 ? gen + 1 : gen;
                __atomic_store_n((uint64_t *)rec, odd, __ATOMIC_RELAXED);
                __atomic_thread_fence(__ATOMIC_RELEASE); /* odd before any byte of the record */
                STEP("reclaiming", (Py_ssize_t)slot[k]);
                memcpy(rec + 8, empty.buf, RECORD_BYTES - 8);
                __atomic_store_n((uint64_t *)rec, odd + 1, __ATOMIC_RELEASE); /* publish: empty */
                cleared++;
            }
            if (!whole) record_lock(fd, offset, F_UNLCK);
        }
        if (whole) records_lock(fd, index_offset + first * RECORD_BYTES, count, F_UNLCK);
        i = j;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&seen); PyBuffer_Release(&slots); PyBuffer_Release(&empty);
    return PyLong_FromSsize_t(cleared);
}

/* check_segments(seg_ptrs, seg_lens, per_page, page_bytes, arena_start, arena_end) -> the first
 * page (in page order) with a segment at address 0, of no bytes or not whole 8-byte words, larger
 * than a page, reaching 2**63 (negative as int64: outside every user address space) or touching
 * [arena_start, arena_end) - the store's own mapping - or whose sizes do not add up to page_bytes;
 * -1 when every page passes. hicache.store._pages.check_pages's rule in one pass without the
 * GIL's per-op costs (its torch pass, the fallback, was a tenth of a 64 KiB-page read: issue #51). */
static PyObject *check_segments(PyObject *self, PyObject *args) {
    Py_ssize_t per_page;
    unsigned long long page_bytes, arena_start, arena_end;
    PyObject *o_ptrs, *o_lens;
    if (!PyArg_ParseTuple(args, "OOnKKK", &o_ptrs, &o_lens, &per_page, &page_bytes, &arena_start, &arena_end))
        return NULL;
    if (per_page < 1) {
        PyErr_SetString(PyExc_ValueError, "check_segments: per_page must be >= 1");
        return NULL;
    }
    Py_buffer ptrs, lens;
    if (get_u64(o_ptrs, &ptrs, 0, "seg_ptrs") < 0) return NULL;
    if (get_u64(o_lens, &lens, 0, "seg_lens") < 0) { PyBuffer_Release(&ptrs); return NULL; }
    Py_ssize_t count = ptrs.len / 8;
    if (count != lens.len / 8 || count % per_page) {
        PyBuffer_Release(&ptrs); PyBuffer_Release(&lens);
        PyErr_SetString(PyExc_ValueError, "check_segments: pointers and sizes differ in count or are not whole pages");
        return NULL;
    }
    const uint64_t top = (uint64_t)1 << 63;
    const uint64_t *ptr = ptrs.buf, *len = lens.buf;
    Py_ssize_t bad = uneven_page(len, count / per_page, per_page, page_bytes);
    Py_ssize_t checked = bad < 0 ? count / per_page : bad; /* pages before it: their pointers */
    for (Py_ssize_t s = 0; s < checked * per_page; s++) {
        uint64_t p = ptr[s], n = len[s];
        /* p, n < 2**63: p + n cannot wrap */
        if (p == 0 || p >= top || n >= top || p + n >= top || (p < arena_end && p + n > arena_start)) {
            bad = s / per_page;
            break;
        }
    }
    PyBuffer_Release(&ptrs); PyBuffer_Release(&lens);
    return PyLong_FromSsize_t(bad);
}

static PyMethodDef methods[] = {
    {"load", slot_load, METH_VARARGS, "load(addr) -> u64, acquire"},
    {"store", slot_store, METH_VARARGS, "store(addr, value), release"},
    {"fetch_add", slot_fetch_add, METH_VARARGS, "fetch_add(addr, delta) -> old u64"},
    {"copy_pages", copy_pages, METH_VARARGS, "batched page copies with their checksums, without the GIL"},
    {"lookup", lookup, METH_VARARGS, "each key's slot in its window, or -1"},
    {"victims", victims, METH_VARARGS, "each key's window in the order a writer tries its slots"},
    {"read_pages", read_pages, METH_VARARGS, "the slot protocol's reads: look up, copy, checksum, re-check"},
    {"write_pages", write_pages, METH_VARARGS, "the slot protocol's writes: claim, copy, checksum, publish"},
    {"clear_slots", clear_slots, METH_VARARGS, "a clear's reclaims: lock, empty and publish each slot still as seen"},
    {"check_segments", check_segments, METH_VARARGS, "the first page whose segments fail the store's checks, or -1"},
#ifdef HICACHE_STEP_HOOK
    {"set_step_hook", set_step_hook, METH_O, "test builds: f(stage, n) at each step of the slot protocol, or None"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slotops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slotops(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* the record layout this build reads: _slots refuses the helper if hicache.plan's differs */
    if (PyModule_AddIntConstant(m, "RECORD_BYTES", RECORD_BYTES) < 0 || PyModule_AddIntConstant(m, "OFF_SUM1", OFF_SUM1) < 0
        || PyModule_AddIntConstant(m, "OFF_SUM2", OFF_SUM2) < 0 || PyModule_AddIntConstant(m, "OFF_LENGTH", OFF_LENGTH) < 0
        || PyModule_AddIntConstant(m, "OFF_REF", OFF_REF) < 0 || PyModule_AddIntConstant(m, "OFF_DEPTH", OFF_DEPTH) < 0
        || PyModule_AddIntConstant(m, "OFF_NS", OFF_NS) < 0 || PyModule_AddIntConstant(m, "OFF_WRITER", OFF_WRITER) < 0
        || PyModule_AddIntConstant(m, "OFF_STAMP", OFF_STAMP) < 0
        || PyModule_AddIntConstant(m, "SSE2_SUM", SSE2_SUM) < 0 /* which sum loop this build runs */
        || PyModule_AddIntConstant(m, "STEP_HOOK", STEP_HOOK) < 0) { /* a test build's step hook: never a user's */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
