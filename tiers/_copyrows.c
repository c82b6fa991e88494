/*
 * kvstore.tiers._copyrows: the copy engine's host-to-host block copy, in C (and, at the end
 * of this file, metas_ok: the batch check of the block metas every spill and promotion names;
 * the CPU arena's books, built into the same module, are in _slots.c, and the reads of a
 * block meta's fields they share in _books.c).
 *
 * Copier(helpers).copy_rows(dst, dst_count, src, src_count, row_bytes, src_rows, dst_rows,
 *                           stream_min, split_min) -> runs
 *
 *   dst, src       addresses of two contiguous row-major buffers of row_bytes-byte rows
 *                  (dst_count and src_count rows; the caller keeps both alive)
 *   src_rows,      equal-length sequences of ints: row src_rows[i] of src goes to row
 *   dst_rows       dst_rows[i] of dst
 *   stream_min     a run of at least this many bytes is written with non-temporal
 *                  (streaming) stores; 0 turns them off
 *   split_min      a batch of at least this many bytes is shared with the helpers
 *
 * Returns the number of runs copied: pairs that advance together by one row on both
 * sides are coalesced into one copy, in the order given.
 *
 *   A batch is shared with the Copier's `helpers` threads (started at its first shared
 *   copy, stopped by close() or when it is freed; Copier(0) copies on the caller's
 *   thread alone) once it is at least split_min bytes. The runs are cut into pieces of
 *   at most PIECE_BYTES; the caller posts the batch, wakes the helpers and copies
 *   pieces itself, each thread taking the next piece from one atomic counter (work
 *   stealing; in a job of many pieces a thread claims its next piece before copying the
 *   one it holds, so it can prefetch it). So a helper that wakes late, or is descheduled
 *   by other work on the machine, costs the caller at most the two pieces it holds.
 *   Helpers block on a condition variable between batches, taking no CPU. Smaller batches,
 *   and buffers that overlap each other (a shared copy has no order between pieces), are
 *   copied by the caller alone, run by run in order.
 *   One call at a time per Copier; calls from several threads queue.
 *
 * Why C: at 16 KiB - 2 MiB a block, the Python loop around libc memmove cost a large
 * share of the copy, and glibc's memmove uses non-temporal stores only above a
 * threshold (about 190 MiB on the development host) that no block copy reaches. A
 * copy that is not read back soon (a spill into the arena; a promotion the model reads
 * once) gains from streaming stores: they skip the read-for-ownership of every
 * destination cache line. Every row is checked before any byte moves, with the GIL
 * held; the copies run with the GIL released. Sharing a batch through a Python thread
 * pool cost two thread wake-ups and two GIL hand-offs per call (about 120 us measured
 * on the development host: more than the copy of a 32-block batch of 16 KiB blocks).
 *
 * Built by setuptools as an optional extension (setup.py); where it is missing the
 * copy engine falls back to ctypes.memmove, same results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "_books.h"

/* One span to copy: a whole run, or a piece of one. */
typedef struct {
    uint8_t *to;
    const uint8_t *from;
    size_t bytes;
} Span;

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KV_HAVE_STREAM 1

/* How far ahead of its loads a copy prefetches, in bytes: past the end of the span it copies,
 * into the next span the same thread will copy. The hardware prefetchers follow a stream only
 * within a 4 KiB page, and only once it has run a while, so every scattered row would otherwise
 * start with a burst of cache misses: single-threaded, 16 KiB rows read from random places
 * copied at 1.57 us a row without it and 0.98-1.07 with it prefetched 4-16 KiB ahead (0.80 for
 * one contiguous memcpy of the same bytes); 192 KiB and 2 MiB rows did not change. */
#define PREFETCH_BYTES ((size_t)8 * 1024)

/* memcpy with SSE2 streaming stores: the head up to a 64-byte boundary of dst and the tail
 * are plain copies, every whole cache line between them is four unaligned loads and four
 * streaming stores, and a prefetch PREFETCH_BYTES ahead -- inside this span, then into
 * `next` (the span this thread copies after it; NULL for none). The caller fences
 * (_mm_sfence) once after all runs. */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n, const Span *next) {
    const uint8_t *end = src + n;
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (size_t lines = n / 64; lines; lines--) {
        size_t left = (size_t)(end - src); /* sizes, not pointers past the buffer, are compared */
        if (PREFETCH_BYTES < left) {
            _mm_prefetch((const char *)src + PREFETCH_BYTES, _MM_HINT_T0);
        } else if (next != NULL && PREFETCH_BYTES - left < next->bytes) {
            _mm_prefetch((const char *)next->from + (PREFETCH_BYTES - left), _MM_HINT_T0);
        }
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64;
        dst += 64;
    }
    memcpy(dst, src, n & 63);
}
#else
#define KV_HAVE_STREAM 0
#define PREFETCH_BYTES ((size_t)0)
#endif

/* Rows of a sequence into out[0..n), each checked against 0..limit-1. -1 with an exception set. */
static int read_rows(PyObject *seq, Py_ssize_t n, Py_ssize_t limit, const char *what, Py_ssize_t *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t row = PyLong_AsSsize_t(items[i]);
        if (row == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (row < 0 || row >= limit) {
            PyErr_Format(PyExc_IndexError, "%s row %zd is outside 0..%zd", what, row, limit - 1);
            return -1;
        }
        out[i] = row;
    }
    return 0;
}

/* A piece is at most this long: small enough that a thread holding the last one keeps the
 * others waiting briefly, large enough that taking one (an atomic add) costs nothing beside it. */
#define PIECE_BYTES ((size_t)256 * 1024)

/* The most helper threads a Copier runs (tiers.config.MAX_COPY_THREADS is this plus the caller). */
#define MAX_HELPERS 64

/* Copies one span, prefetching the start of `next` (the span this thread copies after it, or NULL)
 * towards its end; returns whether it streamed (so the thread fences before it reports). */
static int copy_span(const Span *span, const Span *next, size_t stream_min) {
#if KV_HAVE_STREAM
    /* Streaming copies go forward only: a span whose source and destination overlap (the same
     * buffer on both sides) is left to memmove, which copies it as the source was. */
    const uint8_t *to = span->to;
    int overlap = to < span->from + span->bytes && span->from < to + span->bytes;
    if (stream_min && span->bytes >= stream_min && !overlap) {
        stream_copy(span->to, span->from, span->bytes, next);
        return 1;
    }
#else
    (void)stream_min;
#endif
    (void)next;
    memmove(span->to, span->from, span->bytes);
    return 0;
}

static void fence(int streamed) {
#if KV_HAVE_STREAM
    if (streamed) {
        _mm_sfence(); /* streaming stores are weakly ordered: visible before we report */
    }
#else
    (void)streamed;
#endif
}

/* The arguments of a copy, checked: the rows (both sides) and the buffers. */
typedef struct {
    uint8_t *dst;
    const uint8_t *src;
    Py_ssize_t dst_count, src_count, row, n;
    size_t stream_min;
    Py_ssize_t *rows; /* n source rows, then n destination rows */
} Batch;

/* Parses and checks the eight copy_rows arguments into *batch (rows owned by it: batch_free).
 * -1 with an exception set, nothing allocated. */
static int batch_parse(PyObject *const *args, Batch *batch) {
    memset(batch, 0, sizeof(*batch));
    void *dst = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t dst_count = PyLong_AsSsize_t(args[1]);
    const void *src = PyLong_AsVoidPtr(args[2]);
    Py_ssize_t src_count = PyLong_AsSsize_t(args[3]);
    Py_ssize_t row = PyLong_AsSsize_t(args[4]);
    Py_ssize_t stream_min = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (dst == NULL || src == NULL || row <= 0 || dst_count < 0 || src_count < 0 || stream_min < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: null buffer, or a non-positive row size or count");
        return -1;
    }
    PyObject *src_seq = PySequence_Fast(args[5], "source rows must be a sequence of ints");
    if (src_seq == NULL) {
        return -1;
    }
    PyObject *dst_seq = PySequence_Fast(args[6], "destination rows must be a sequence of ints");
    if (dst_seq == NULL) {
        Py_DECREF(src_seq);
        return -1;
    }
    int status = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(src_seq);
    if (PySequence_Fast_GET_SIZE(dst_seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd source rows but %zd destination rows", n,
                     PySequence_Fast_GET_SIZE(dst_seq));
        goto done;
    }
    Py_ssize_t *rows = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(2 * n + 1));
    if (rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_rows(src_seq, n, src_count, "source", rows) < 0 ||
        read_rows(dst_seq, n, dst_count, "destination", rows + n) < 0) {
        PyMem_Free(rows);
        goto done;
    }
    batch->dst = dst;
    batch->src = src;
    batch->dst_count = dst_count;
    batch->src_count = src_count;
    batch->row = row;
    batch->n = n;
    batch->stream_min = (size_t)stream_min;
    batch->rows = rows;
    status = 0;
done:
    Py_DECREF(src_seq);
    Py_DECREF(dst_seq);
    return status;
}

static void batch_free(Batch *batch) {
    PyMem_Free(batch->rows);
    batch->rows = NULL;
}

/* The run that starts at pair i (pairs that advance together by one row on both sides) into *span;
 * returns the pair after it. No GIL needed. */
static Py_ssize_t batch_run_at(const Batch *batch, Py_ssize_t i, Span *span) {
    const Py_ssize_t *s_rows = batch->rows, *d_rows = batch->rows + batch->n;
    Py_ssize_t s = s_rows[i], d = d_rows[i], len = 1;
    while (i + len < batch->n && s_rows[i + len] == s + len && d_rows[i + len] == d + len) {
        len++;
    }
    size_t row = (size_t)batch->row;
    span->to = batch->dst + (size_t)d * row;
    span->from = batch->src + (size_t)s * row;
    span->bytes = (size_t)len * row;
    return i + len;
}

/* The runs of a batch into spans[] (at most n of them); returns how many. No GIL needed. */
static Py_ssize_t batch_runs(const Batch *batch, Span *spans) {
    Py_ssize_t runs = 0;
    for (Py_ssize_t i = 0; i < batch->n; runs++) {
        i = batch_run_at(batch, i, &spans[runs]);
    }
    return runs;
}

/* Copies a batch on this thread alone, run by run in order; returns the number of runs. No GIL needed. */
static Py_ssize_t batch_copy_here(const Batch *batch) {
    if (batch->n == 0) {
        return 0;
    }
    Py_ssize_t runs = 1;
    int streamed = 0;
    Span span, next;
    Py_ssize_t i = batch_run_at(batch, 0, &span);
    while (i < batch->n) {
        i = batch_run_at(batch, i, &next); /* found first, so the copy can prefetch it */
        streamed |= copy_span(&span, &next, batch->stream_min);
        span = next;
        runs++;
    }
    streamed |= copy_span(&span, NULL, batch->stream_min);
    fence(streamed);
    return runs;
}

/* ------------------------------------------------------------------------ Copier */

/* A batch posted to the helpers: its pieces, the next one to take, and how many helpers hold it. */
typedef struct {
    const Span *pieces;
    size_t count;
    size_t stream_min;
    int claim_ahead; /* threads claim their next piece before copying one (see take_pieces) */
    atomic_size_t next;
    atomic_int active; /* helpers that took the job and have not left it (registered under mu) */
} Job;

typedef struct {
    PyObject_HEAD
    int helpers;     /* threads asked for */
    int started;     /* threads running */
    pid_t owner;     /* the process that started them (a forked child has none) */
    int stop;        /* under mu */
    unsigned long generation; /* under mu: bumped per posted job */
    Job *job;        /* under mu: the posted job, or NULL */
    pthread_mutex_t mu;
    pthread_cond_t wake; /* helpers: a job was posted, or stop */
    pthread_cond_t left; /* the caller: the last helper left a job */
    pthread_mutex_t calls; /* one copy at a time */
    pthread_t *threads;
} Copier;

/* The index of the next piece nobody has taken (count or more: none is left). */
static size_t claim_piece(Job *job) {
    return atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
}

/* Takes pieces until none is left; returns whether any streamed. With claim_ahead, a thread claims its next
 * piece before it copies the one it holds, so the copy can prefetch the start of the next: it holds at most
 * two pieces. Only for jobs of many pieces: in a job of a few, the caller would claim them all before a
 * helper woke (2-4 pieces of 256 KiB took 20-45% longer that way). */
static int take_pieces(Job *job) {
    int streamed = 0;
    size_t i = claim_piece(job);
    while (i < job->count) {
        size_t after = job->claim_ahead ? claim_piece(job) : job->count;
        const Span *next = after < job->count ? &job->pieces[after] : NULL;
        streamed |= copy_span(&job->pieces[i], next, job->stream_min);
        i = job->claim_ahead ? after : claim_piece(job);
    }
    return streamed;
}

static void *helper_main(void *arg) {
    Copier *self = arg;
#ifdef __linux__
    pthread_setname_np(pthread_self(), "kv-copy"); /* as the engine's Python threads: top -H, /proc */
#endif
    pthread_mutex_lock(&self->mu);
    unsigned long seen = self->generation;
    for (;;) {
        while (!self->stop && (self->job == NULL || self->generation == seen)) {
            pthread_cond_wait(&self->wake, &self->mu);
        }
        if (self->stop) {
            break;
        }
        seen = self->generation;
        Job *job = self->job;
        atomic_fetch_add(&job->active, 1); /* under mu: the caller unposts the job under it */
        pthread_mutex_unlock(&self->mu);
        fence(take_pieces(job));
        /* The job lives on the caller's stack: after this it may be gone. The release pairs with the
         * caller's acquire load, so every byte copied here (fenced above) is visible to it. */
        if (atomic_fetch_sub_explicit(&job->active, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&self->mu);
            pthread_cond_broadcast(&self->left);
            pthread_mutex_unlock(&self->mu);
        }
        pthread_mutex_lock(&self->mu);
    }
    pthread_mutex_unlock(&self->mu);
    return NULL;
}

static int copier_init_sync(Copier *self) {
    if (pthread_mutex_init(&self->mu, NULL) || pthread_cond_init(&self->wake, NULL) ||
        pthread_cond_init(&self->left, NULL) || pthread_mutex_init(&self->calls, NULL)) {
        return -1;
    }
    return 0;
}

/* In a forked child the Copier's memory is the parent's, but not its threads, and its locks may have
 * been held by a parent thread at the fork: forget the threads and make the locks anew. With the GIL. */
static void copier_after_fork(Copier *self) {
    if (self->owner != 0 && self->owner != getpid()) {
        self->owner = 0;
        self->started = 0;
        self->job = NULL;
        self->stop = 0;
        copier_init_sync(self);
    }
}

/* Starts the helpers not running yet (holding `calls`). Returns how many run: fewer than asked when
 * the system refuses a thread. */
static int copier_start(Copier *self) {
    if (self->started == self->helpers) {
        return self->started;
    }
    if (self->threads == NULL) {
        self->threads = PyMem_RawCalloc((size_t)self->helpers, sizeof(pthread_t));
        if (self->threads == NULL) {
            return 0;
        }
    }
    self->owner = getpid();
    pthread_mutex_lock(&self->mu);
    self->stop = 0;
    pthread_mutex_unlock(&self->mu);
    while (self->started < self->helpers) {
        if (pthread_create(&self->threads[self->started], NULL, helper_main, self) != 0) {
            break;
        }
        self->started++;
    }
    return self->started;
}

/* Stops and joins the helpers (none in a forked child). Without the GIL. */
static void copier_stop(Copier *self) {
    if (self->started == 0 || self->owner != getpid()) {
        self->started = 0;
        return;
    }
    pthread_mutex_lock(&self->mu);
    self->stop = 1;
    pthread_cond_broadcast(&self->wake);
    pthread_mutex_unlock(&self->mu);
    for (int i = 0; i < self->started; i++) {
        pthread_join(self->threads[i], NULL);
    }
    self->started = 0;
}

/* Copies a batch with the helpers (calls held, helpers running, no GIL); returns the number of runs,
 * or -1 when the pieces could not be allocated (nothing copied). */
static Py_ssize_t copier_share(Copier *self, const Batch *batch) {
    Span *runs = malloc(sizeof(Span) * (size_t)batch->n);
    if (runs == NULL) {
        return -1;
    }
    Py_ssize_t run_count = batch_runs(batch, runs);
    size_t count = 0;
    for (Py_ssize_t r = 0; r < run_count; r++) {
        count += (runs[r].bytes + PIECE_BYTES - 1) / PIECE_BYTES;
    }
    Span *pieces = malloc(sizeof(Span) * count);
    if (pieces == NULL) {
        free(runs);
        return -1;
    }
    size_t p = 0;
    for (Py_ssize_t r = 0; r < run_count; r++) {
        for (size_t offset = 0; offset < runs[r].bytes; offset += PIECE_BYTES) {
            size_t left = runs[r].bytes - offset;
            pieces[p].to = runs[r].to + offset;
            pieces[p].from = runs[r].from + offset;
            pieces[p].bytes = left < PIECE_BYTES ? left : PIECE_BYTES;
            p++;
        }
    }
    free(runs);
    /* Claiming ahead pays where each thread gets several pieces (see take_pieces). */
    int claim_ahead = count > 2 * ((size_t)self->started + 1);
    Job job = {.pieces = pieces, .count = count, .stream_min = batch->stream_min, .claim_ahead = claim_ahead};
    atomic_init(&job.next, 0);
    atomic_init(&job.active, 0);
    pthread_mutex_lock(&self->mu);
    self->job = &job;
    self->generation++;
    pthread_cond_broadcast(&self->wake);
    pthread_mutex_unlock(&self->mu);
    fence(take_pieces(&job));
    /* Every piece is taken: unpost the job so a helper waking now skips it, then wait for the ones
     * holding it -- each finishes at most the two pieces it claimed. A short spin first (about 1024 pauses:
     * tens of microseconds, what a piece takes), since a condition-variable wake-up costs as much. */
    pthread_mutex_lock(&self->mu);
    self->job = NULL;
    pthread_mutex_unlock(&self->mu);
    for (int spin = 0; spin < 1024 && atomic_load_explicit(&job.active, memory_order_acquire); spin++) {
#if KV_HAVE_STREAM
        _mm_pause();
#endif
    }
    if (atomic_load_explicit(&job.active, memory_order_acquire)) {
        pthread_mutex_lock(&self->mu);
        while (atomic_load_explicit(&job.active, memory_order_acquire)) {
            pthread_cond_wait(&self->left, &self->mu);
        }
        pthread_mutex_unlock(&self->mu);
    }
    free(pieces);
    return run_count;
}

static PyObject *Copier_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"helpers", NULL};
    int helpers = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i", keywords, &helpers)) {
        return NULL;
    }
    if (helpers < 0 || helpers > MAX_HELPERS) {
        PyErr_Format(PyExc_ValueError, "helpers must be in 0..%d, got %d", MAX_HELPERS, helpers);
        return NULL;
    }
    Copier *self = (Copier *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->helpers = helpers;
    if (copier_init_sync(self) < 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void Copier_dealloc(Copier *self) {
    copier_after_fork(self);
    Py_BEGIN_ALLOW_THREADS
    copier_stop(self);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(self->threads);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Copier_copy_rows(Copier *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "Copier.copy_rows takes 9 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t split_min = PyLong_AsSsize_t(args[8]);
    if (split_min == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (split_min < 0) {
        PyErr_SetString(PyExc_ValueError, "split_min must be >= 0");
        return NULL;
    }
    Batch batch;
    if (batch_parse(args, &batch) < 0) {
        return NULL;
    }
    size_t total = (size_t)batch.n * (size_t)batch.row;
    /* Buffers that overlap are copied in order, here: pieces copied at once have no order. */
    size_t dst_bytes = (size_t)batch.dst_count * (size_t)batch.row;
    size_t src_bytes = (size_t)batch.src_count * (size_t)batch.row;
    int disjoint = batch.dst + dst_bytes <= batch.src || batch.src + src_bytes <= batch.dst;
    int share = self->helpers > 0 && disjoint && total >= (size_t)split_min && batch.n > 0;
    Py_ssize_t runs = -1;
    copier_after_fork(self);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->calls);
    if (share && copier_start(self) > 0) {
        runs = copier_share(self, &batch);
    }
    if (runs < 0) {
        runs = batch_copy_here(&batch);
    }
    pthread_mutex_unlock(&self->calls);
    Py_END_ALLOW_THREADS
    batch_free(&batch);
    return PyLong_FromSsize_t(runs);
}

static PyObject *Copier_close(Copier *self, PyObject *unused) {
    (void)unused;
    copier_after_fork(self);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->calls);
    copier_stop(self);
    pthread_mutex_unlock(&self->calls);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Copier_get_started(Copier *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->owner == getpid() ? self->started : 0);
}

static PyObject *Copier_get_helpers(Copier *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->helpers);
}

static PyMethodDef Copier_methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))Copier_copy_rows, METH_FASTCALL,
     "copy_rows(dst, dst_count, src, src_count, row_bytes, src_rows, dst_rows, stream_min, split_min) -> runs"},
    {"close", (PyCFunction)Copier_close, METH_NOARGS,
     "Stop the helper threads (a later shared copy starts them again). Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Copier_getset[] = {
    {"helpers", (getter)Copier_get_helpers, NULL, "helper threads asked for", NULL},
    {"started", (getter)Copier_get_started, NULL, "helper threads running in this process", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore.tiers._copyrows.Copier",
    .tp_basicsize = sizeof(Copier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Copier(helpers): copy_rows shared with helper threads of its own (see the module source).",
    .tp_new = Copier_new,
    .tp_dealloc = (destructor)Copier_dealloc,
    .tp_methods = Copier_methods,
    .tp_getset = Copier_getset,
};

/* ------------------------------------------------------------------ block metas
 *
 * metas_ok(blocks, meta_type, block_size, tokens) -> bool
 *
 *   True when every item of the sequence `blocks` is exactly of type `meta_type` (the tiers'
 *   BlockMeta: fields block_hash, parent_hash, token_ids), its hashes are ints in 0..2**64-1
 *   (parent_hash may be None), its token_ids a tuple of `block_size` ints and, with `tokens`
 *   true, every token id an int in 0..2**63-1. False otherwise: the caller then checks block
 *   by block in Python, for the message (so this may be stricter than that check, never
 *   looser). It reads and never changes anything.
 *
 * Why C: it runs for every block spilled or promoted; in Python the token pass alone cost
 * about 0.6 us per 16-token block, about half a 16 KiB block's copy.
 */

/* 1 when `value` is an int in 0..2**64-1, else 0 (never raises). */
static int u64_ok(PyObject *value) {
    uint64_t unused;
    return books_u64(value, &unused);
}

/* 1 when `meta`'s field (META_HASH or META_PARENT) is an int in 0..2**64-1 (or None, with `or_none`), 0 when
 * not, -1 with an exception set when it cannot be read. */
static int hash_field_ok(PyObject *meta, int name, int or_none) {
    PyObject *field = books_meta_field(meta, name);
    if (field == NULL) {
        return -1;
    }
    int ok = (or_none && field == Py_None) || u64_ok(field);
    Py_DECREF(field);
    return ok;
}

/* 1 when `meta` passes (see metas_ok), 0 when not, -1 with an exception set on a failure. */
static int meta_ok(PyObject *meta, Py_ssize_t block_size, int tokens) {
    int ok = hash_field_ok(meta, META_HASH, 0);
    if (ok == 1) {
        ok = hash_field_ok(meta, META_PARENT, 1);
    }
    if (ok != 1) {
        return ok;
    }
    PyObject *field = books_meta_field(meta, META_TOKENS);
    if (field == NULL) {
        return -1;
    }
    ok = PyTuple_Check(field) && PyTuple_GET_SIZE(field) == block_size;
    for (Py_ssize_t i = 0; ok && tokens && i < block_size; i++) {
        ok = books_token_id(PyTuple_GET_ITEM(field, i)) >= 0;
    }
    Py_DECREF(field);
    return ok;
}

static PyObject *metas_ok(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "metas_ok takes 4 arguments, got %zd", nargs);
        return NULL;
    }
    if (!PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "metas_ok: meta_type must be a type");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int tokens = PyObject_IsTrue(args[3]);
    if (tokens < 0) {
        return NULL;
    }
    books_meta_type_intact();
    PyObject *seq = PySequence_Tuple(args[0]); /* its own tuple: a field's getter may change the caller's list */
    if (seq == NULL) {
        return NULL;
    }
    int ok = 1;
    for (Py_ssize_t i = 0; ok == 1 && i < PyTuple_GET_SIZE(seq); i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        ok = Py_TYPE(item) == (PyTypeObject *)args[1] ? meta_ok(item, block_size, tokens) : 0;
    }
    Py_DECREF(seq);
    if (ok < 0) {
        return NULL;
    }
    return PyBool_FromLong(ok);
}

static PyMethodDef module_methods[] = {
    {"metas_ok", (PyCFunction)(void (*)(void))metas_ok, METH_FASTCALL,
     "metas_ok(blocks, meta_type, block_size, tokens) -> bool: whether every block meta is well formed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_copyrows",
    "Host block copies for the copy engine (see Copier), the batch check of block metas (metas_ok), and the CPU "
    "arena's books (SlotTable, tiers/_slots.c).",
    -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copyrows(void) {
    if (PyType_Ready(&CopierType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&CopierType);
    if (PyModule_AddIntConstant(module, "STREAMING_STORES", KV_HAVE_STREAM) < 0 ||
        PyModule_AddIntConstant(module, "PIECE_BYTES", (long)PIECE_BYTES) < 0 ||
        PyModule_AddIntConstant(module, "PREFETCH_BYTES", (long)PREFETCH_BYTES) < 0 ||
        PyModule_AddIntConstant(module, "MAX_HELPERS", MAX_HELPERS) < 0 ||
        PyModule_AddObject(module, "Copier", (PyObject *)&CopierType) < 0) {
        Py_DECREF(&CopierType);
        Py_DECREF(module);
        return NULL;
    }
    if (books_add(module) < 0 || slots_add(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
