/*
 * kvstore.tiers._copyrows: the copy engine's host-to-host block copy, in C.
 *
 * copy_rows(dst, dst_count, src, src_count, row_bytes, src_rows, dst_rows, stream_min) -> runs
 *
 *   dst, src       addresses of two contiguous row-major buffers of row_bytes-byte rows
 *                  (dst_count and src_count rows; the caller keeps both alive)
 *   src_rows,      equal-length sequences of ints: row src_rows[i] of src goes to row
 *   dst_rows       dst_rows[i] of dst
 *   stream_min     a run of at least this many bytes is written with non-temporal
 *                  (streaming) stores; 0 turns them off
 *
 * Returns the number of runs copied: pairs that advance together by one row on both
 * sides are coalesced into one copy, in the order given.
 *
 * Why C: at 16 KiB - 2 MiB a block, the Python loop around libc memmove cost a large
 * share of the copy, and glibc's memmove uses non-temporal stores only above a
 * threshold (about 190 MiB on the development host) that no block copy reaches. A
 * copy that is not read back soon (a spill into the arena; a promotion the model reads
 * once) gains from streaming stores: they skip the read-for-ownership of every
 * destination cache line. Every row is checked before any byte moves, with the GIL
 * held; the copies run with the GIL released, so two threads can copy at once.
 *
 * Built by setuptools as an optional extension (setup.py); where it is missing the
 * copy engine falls back to ctypes.memmove, same results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KV_HAVE_STREAM 1

/* memcpy with SSE2 streaming stores: the head up to a 64-byte boundary of dst and the tail
 * are plain copies, every whole cache line between them is four unaligned loads and four
 * streaming stores. The caller fences (_mm_sfence) once after all runs. */
static void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (size_t lines = n / 64; lines; lines--) {
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

static PyObject *copy_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "copy_rows takes 8 arguments, got %zd", nargs);
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t dst_count = PyLong_AsSsize_t(args[1]);
    const void *src = PyLong_AsVoidPtr(args[2]);
    Py_ssize_t src_count = PyLong_AsSsize_t(args[3]);
    Py_ssize_t row = PyLong_AsSsize_t(args[4]);
    Py_ssize_t stream_min = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (dst == NULL || src == NULL || row <= 0 || dst_count < 0 || src_count < 0 || stream_min < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: null buffer, or a non-positive row size or count");
        return NULL;
    }
    PyObject *src_seq = PySequence_Fast(args[5], "source rows must be a sequence of ints");
    if (src_seq == NULL) {
        return NULL;
    }
    PyObject *dst_seq = PySequence_Fast(args[6], "destination rows must be a sequence of ints");
    if (dst_seq == NULL) {
        Py_DECREF(src_seq);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t *rows = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(src_seq);
    if (PySequence_Fast_GET_SIZE(dst_seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd source rows but %zd destination rows", n,
                     PySequence_Fast_GET_SIZE(dst_seq));
        goto done;
    }
    rows = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(2 * n + 1));
    if (rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t *s_rows = rows, *d_rows = rows + n;
    if (read_rows(src_seq, n, src_count, "source", s_rows) < 0 ||
        read_rows(dst_seq, n, dst_count, "destination", d_rows) < 0) {
        goto done;
    }
    Py_ssize_t runs = 0;
    Py_BEGIN_ALLOW_THREADS
    int streamed = 0;
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t s = s_rows[i], d = d_rows[i], len = 1;
        while (i + len < n && s_rows[i + len] == s + len && d_rows[i + len] == d + len) {
            len++;
        }
        size_t bytes = (size_t)len * (size_t)row;
        uint8_t *to = (uint8_t *)dst + (size_t)d * (size_t)row;
        const uint8_t *from = (const uint8_t *)src + (size_t)s * (size_t)row;
#if KV_HAVE_STREAM
        /* Streaming copies go forward only: a run whose source and destination overlap (the same
         * buffer on both sides) is left to memmove, which copies it as the source was. */
        int overlap = (const uint8_t *)to < from + bytes && from < (const uint8_t *)to + bytes;
        if (stream_min && bytes >= (size_t)stream_min && !overlap) {
            stream_copy(to, from, bytes);
            streamed = 1;
        } else
#endif
        {
            memmove(to, from, bytes);
        }
        runs++;
        i += len;
    }
#if KV_HAVE_STREAM
    if (streamed) {
        _mm_sfence(); /* streaming stores are weakly ordered: visible before we return */
    }
#else
    (void)streamed;
#endif
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(runs);
done:
    PyMem_Free(rows);
    Py_DECREF(src_seq);
    Py_DECREF(dst_seq);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_FASTCALL,
     "copy_rows(dst, dst_count, src, src_count, row_bytes, src_rows, dst_rows, stream_min) -> runs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_copyrows", "Host block copies for the copy engine (see copy_rows).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copyrows(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddIntConstant(module, "STREAMING_STORES", KV_HAVE_STREAM) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
