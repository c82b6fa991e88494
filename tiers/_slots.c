/*
 * The CPU arena's books in C arrays: SlotTable, part of kvstore.tiers._copyrows (slots_add() below adds it
 * to that module). tiers/cpu_arena.py wraps it; tiers/cpu_arena_py.py is the same arena in Python, for
 * installs without a C compiler, and the tests drive the two in lockstep.
 *
 * Why: on 16 KiB blocks a spill's books cost as much as its copy. Kept as Python objects -- an OrderedDict
 * index, a lease object and a dict entry per lease, the caller's BlockMeta per slot -- every block spilled
 * cost allocations, dict updates and, when its slot was reused, the frees of the evicted block's meta (the
 * meta, its token tuple and an int per token, last touched a pass over the arena earlier). Here a block is
 * a few array entries, and nothing is allocated per block but the grant the caller reads.
 *
 * Data (n slots, block size b):
 *   state[n]          FREE, WRITING (reserved, one write lease), CACHED (indexed), DETACHED (out of the
 *                     index, kept by read leases until the last is released)
 *   pins[n]           leases on the slot
 *   hash, parent, has_parent, tokens[n * b]
 *                     the block the slot holds or receives: the collision guard an acquire compares
 *   pending[n]        WRITING slots: the BlockMeta the reserve named (a strong reference, until the
 *                     commit hands it to the events or the write is abandoned); NULL elsewhere
 *   prev, next        the LRU list of CACHED slots, least recently used at lru_head
 *   freeq             the FREE slots, a FIFO ring (freed slots join the tail, reserves take from the head)
 *   index             open addressing (linear probing, backward-shift deletion): block hash -> slot, for
 *                     WRITING and CACHED slots; the key is read from hash[slot]
 *   leases            open addressing on the lease id: slot, kind, granted_at (grown by doubling)
 *
 * Invariants (check() asserts every one): a FREE slot is in freeq once and nowhere else, with no pins and
 * no pending meta; a WRITING slot is indexed, pinned once by its write lease, and holds a pending meta; a
 * CACHED slot is indexed and on the LRU list, with any number of read leases; a DETACHED slot is in neither
 * and has at least one read lease. pins[s] equals the leases naming s. A leased slot is never evicted or
 * reused: that is what makes a copy into or out of it safe while the index changes around it.
 *
 * Failure modes: every batch reads and checks all its input (metas, lease ids) before it looks at the table,
 * then plans, then allocates every Python object it hands back, then changes the table -- a change that
 * cannot fail and runs no Python code (metas it drops are released after it). So an error (LeaseError for a
 * bad lease id, TypeError / ValueError for a malformed meta, MemoryError) leaves the table as it was. Python
 * code can still run between the plan and the change: a field getter of a meta that is not a BlockMeta,
 * evict()'s keep(), or a finalizer run by the garbage collector inside an allocation. Every change bumps
 * `version`, and a call whose plan is older than the table raises RuntimeError and changes nothing. (A
 * reserve's touches of blocks it found cached are made while it plans; a failure leaves only those.) All
 * under the GIL, which nothing here releases; the arena's owner drives it from one thread, and
 * cached_metas() (a snapshot, from the publisher's thread) copies what it reads before it builds anything.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_books.h"

enum { FREE = 0, WRITING = 1, CACHED = 2, DETACHED = 3 };
enum { KIND_WRITE = 1, KIND_READ = 2 };

typedef struct {
    uint64_t id; /* 0: an empty entry */
    double granted_at;
    int32_t slot;
    uint8_t kind;
    uint32_t mark; /* the batch that last named it: a lease named twice in one batch */
} LeaseRec;

typedef struct {
    PyObject_HEAD
    Py_ssize_t num_slots;
    Py_ssize_t block_size;
    PyObject *meta_type;   /* BlockMeta: what reserve() takes, and what blocks are rebuilt as */
    PyObject *grant_type;  /* SlotGrant: a tuple subclass the grants are made as */
    PyObject *lease_error; /* LeaseError */
    uint8_t *state;
    int32_t *pins;
    uint64_t *hash;
    uint64_t *parent;
    uint8_t *has_parent;
    int64_t *tokens;
    PyObject **pending;
    int32_t *prev;
    int32_t *next;
    int32_t lru_head, lru_tail;
    int32_t *freeq;
    Py_ssize_t free_head, free_count;
    int32_t *index;
    uint64_t index_mask;
    int index_shift;
    LeaseRec *leases;
    uint64_t lease_mask;
    int lease_shift;
    Py_ssize_t num_leases;
    uint64_t next_lease;
    uint32_t mark;
    uint64_t version; /* bumped by every change: a call that allocated after planning checks it moved not */
    Py_ssize_t num_cached;
    Py_ssize_t num_leased_slots;
    long long num_evictions;
    long long num_collisions;
} SlotTable;

/* ------------------------------------------------------------------ hashing */

static inline uint64_t mix(uint64_t key, int shift) { return (key * 0x9E3779B97F4A7C15ull) >> shift; }

/* The index position holding `key`, or -1. */
static Py_ssize_t index_find(const SlotTable *t, uint64_t key) {
    uint64_t at = mix(key, t->index_shift);
    for (;;) {
        int32_t slot = t->index[at];
        if (slot < 0) {
            return -1;
        }
        if (t->hash[slot] == key) {
            return (Py_ssize_t)at;
        }
        at = (at + 1) & t->index_mask;
    }
}

static inline int32_t index_slot(const SlotTable *t, uint64_t key) {
    Py_ssize_t at = index_find(t, key);
    return at < 0 ? -1 : t->index[at];
}

/* Enter slot (whose hash[] is set) into the index; the caller knows its hash is not there. */
static void index_put(SlotTable *t, int32_t slot) {
    t->version++;
    uint64_t at = mix(t->hash[slot], t->index_shift);
    while (t->index[at] >= 0) {
        at = (at + 1) & t->index_mask;
    }
    t->index[at] = slot;
}

/* Take `key` out of the index (it is there), shifting later entries of its probe run back. */
static void index_del(SlotTable *t, uint64_t key) {
    t->version++;
    Py_ssize_t found = index_find(t, key);
    if (found < 0) {
        return;
    }
    uint64_t hole = (uint64_t)found, mask = t->index_mask;
    uint64_t at = (hole + 1) & mask;
    while (t->index[at] >= 0) {
        uint64_t home = mix(t->hash[t->index[at]], t->index_shift);
        /* Move the entry into the hole unless its home lies cyclically in (hole, at]. */
        if (((at - home) & mask) >= ((at - hole) & mask)) {
            t->index[hole] = t->index[at];
            hole = at;
        }
        at = (at + 1) & mask;
    }
    t->index[hole] = -1;
}

static LeaseRec *lease_find(const SlotTable *t, uint64_t id) {
    if (id == 0) {
        return NULL;
    }
    uint64_t at = mix(id, t->lease_shift);
    for (;;) {
        LeaseRec *rec = &t->leases[at];
        if (rec->id == 0) {
            return NULL;
        }
        if (rec->id == id) {
            return rec;
        }
        at = (at + 1) & t->lease_mask;
    }
}

static LeaseRec *lease_slot_for(LeaseRec *table, uint64_t mask, int shift, uint64_t id) {
    uint64_t at = mix(id, shift);
    while (table[at].id != 0) {
        at = (at + 1) & mask;
    }
    return &table[at];
}

/* Room for `more` leases beyond those held (the table at most half full); 0, or -1 with MemoryError. */
static int lease_reserve_room(SlotTable *t, Py_ssize_t more) {
    uint64_t capacity = t->lease_mask + 1;
    if ((uint64_t)(t->num_leases + more) * 2 <= capacity) {
        return 0;
    }
    uint64_t grown = capacity;
    int shift = t->lease_shift;
    while ((uint64_t)(t->num_leases + more) * 2 > grown) {
        grown <<= 1;
        shift -= 1;
    }
    LeaseRec *table = PyMem_Calloc(grown, sizeof(LeaseRec));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < capacity; i++) {
        if (t->leases[i].id != 0) {
            *lease_slot_for(table, grown - 1, shift, t->leases[i].id) = t->leases[i];
        }
    }
    PyMem_Free(t->leases);
    t->version++;
    t->leases = table;
    t->lease_mask = grown - 1;
    t->lease_shift = shift;
    return 0;
}

/* A new lease on `slot` (room reserved); its id. */
static uint64_t lease_add(SlotTable *t, int32_t slot, uint8_t kind, double now) {
    t->version++;
    uint64_t id = t->next_lease++;
    LeaseRec *rec = lease_slot_for(t->leases, t->lease_mask, t->lease_shift, id);
    rec->id = id;
    rec->slot = slot;
    rec->kind = kind;
    rec->granted_at = now;
    rec->mark = 0;
    t->num_leases++;
    if (t->pins[slot]++ == 0) {
        t->num_leased_slots++;
    }
    return id;
}

static void lease_del(SlotTable *t, LeaseRec *rec) {
    t->version++;
    uint64_t mask = t->lease_mask;
    uint64_t hole = (uint64_t)(rec - t->leases);
    uint64_t at = (hole + 1) & mask;
    while (t->leases[at].id != 0) {
        uint64_t home = mix(t->leases[at].id, t->lease_shift);
        if (((at - home) & mask) >= ((at - hole) & mask)) {
            t->leases[hole] = t->leases[at];
            hole = at;
        }
        at = (at + 1) & mask;
    }
    memset(&t->leases[hole], 0, sizeof(LeaseRec));
    t->num_leases--;
}

/* ------------------------------------------------------------------ lists */

static void lru_unlink(SlotTable *t, int32_t slot) {
    t->version++;
    int32_t p = t->prev[slot], n = t->next[slot];
    if (p >= 0) {
        t->next[p] = n;
    } else {
        t->lru_head = n;
    }
    if (n >= 0) {
        t->prev[n] = p;
    } else {
        t->lru_tail = p;
    }
    t->prev[slot] = t->next[slot] = -1;
}

static void lru_append(SlotTable *t, int32_t slot) {
    t->version++;
    t->prev[slot] = t->lru_tail;
    t->next[slot] = -1;
    if (t->lru_tail >= 0) {
        t->next[t->lru_tail] = slot;
    } else {
        t->lru_head = slot;
    }
    t->lru_tail = slot;
}

static void lru_touch(SlotTable *t, int32_t slot) {
    if (t->lru_tail != slot) {
        lru_unlink(t, slot);
        lru_append(t, slot);
    }
}

static void free_push(SlotTable *t, int32_t slot) {
    t->version++;
    t->state[slot] = FREE;
    t->freeq[(t->free_head + t->free_count) % t->num_slots] = slot;
    t->free_count++;
}

static int32_t free_pop(SlotTable *t) {
    t->version++;
    int32_t slot = t->freeq[t->free_head];
    t->free_head = (t->free_head + 1) % t->num_slots;
    t->free_count--;
    return slot;
}

/* A CACHED slot leaves the index and the LRU list: FREE when unpinned, else DETACHED. */
static void uncache(SlotTable *t, int32_t slot) {
    index_del(t, t->hash[slot]);
    lru_unlink(t, slot);
    t->num_cached--;
    if (t->pins[slot] == 0) {
        free_push(t, slot);
    } else {
        t->state[slot] = DETACHED;
    }
}

/* ------------------------------------------------------------------ reading metas */

typedef struct {
    uint64_t hash;
    uint64_t parent;
    int has_parent;
    PyObject *hash_obj; /* a strong reference (what a grant carries) */
} Head;

/* A u64 from an int object: 0, or -1 with TypeError / ValueError set. */
static int read_u64(PyObject *value, uint64_t *out, const char *what) {
    if (books_u64(value, out)) {
        return 0;
    }
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what, Py_TYPE(value)->tp_name);
    } else {
        PyErr_Format(PyExc_ValueError, "%s must be in 0..2**64-1", what);
    }
    return -1;
}

/* The hash and parent of `meta`; 0, or -1 with an exception set. */
static int read_head(PyObject *meta, Head *head) {
    PyObject *hash = books_meta_field(meta, META_HASH);
    if (hash == NULL) {
        return -1;
    }
    if (read_u64(hash, &head->hash, "a block hash") < 0) {
        Py_DECREF(hash);
        return -1;
    }
    PyObject *parent = books_meta_field(meta, META_PARENT);
    if (parent == NULL) {
        Py_DECREF(hash);
        return -1;
    }
    head->has_parent = parent != Py_None;
    head->parent = 0;
    int bad = head->has_parent && read_u64(parent, &head->parent, "a parent hash") < 0;
    Py_DECREF(parent);
    if (bad) {
        Py_DECREF(hash);
        return -1;
    }
    head->hash_obj = hash;
    return 0;
}

/* `meta`'s token ids into out[block_size]: 1, 0 when they are not a tuple of block_size ids in 0..2**63-1
 * (with `strict`, that is an error: -1 with ValueError set), or -1 with an exception set. */
static int read_tokens(const SlotTable *t, PyObject *meta, int64_t *out, int strict) {
    PyObject *field = books_meta_field(meta, META_TOKENS);
    if (field == NULL) {
        return -1;
    }
    int ok = PyTuple_Check(field) && PyTuple_GET_SIZE(field) == t->block_size;
    for (Py_ssize_t i = 0; ok && i < t->block_size; i++) {
        out[i] = books_token_id(PyTuple_GET_ITEM(field, i));
        ok = out[i] >= 0;
    }
    Py_DECREF(field);
    if (!ok && strict) {
        PyErr_Format(PyExc_ValueError, "a block's token ids must be a tuple of %zd ints in 0..2**63-1", t->block_size);
        return -1;
    }
    return ok;
}

/* Whether slot's guard equals the block (parent and tokens); the hash matched already. */
static int same_guard(const SlotTable *t, int32_t slot, const Head *head, const int64_t *tokens) {
    if (t->has_parent[slot] != head->has_parent || (head->has_parent && t->parent[slot] != head->parent)) {
        return 0;
    }
    return memcmp(&t->tokens[(Py_ssize_t)slot * t->block_size], tokens, sizeof(int64_t) * t->block_size) == 0;
}

/* A meta_type block (hash, parent or None, the token ids as a tuple): a new reference, or NULL with an exception
 * set. Calls meta_type: Python code may run. */
static PyObject *build_meta(const SlotTable *t, uint64_t hash, int has_parent, uint64_t parent, const int64_t *ids) {
    PyObject *tokens = PyTuple_New(t->block_size);
    for (Py_ssize_t i = 0; tokens != NULL && i < t->block_size; i++) {
        PyObject *id = PyLong_FromLongLong(ids[i]);
        if (id == NULL) {
            Py_CLEAR(tokens);
            break;
        }
        PyTuple_SET_ITEM(tokens, i, id);
    }
    PyObject *hash_obj = PyLong_FromUnsignedLongLong(hash);
    PyObject *parent_obj = has_parent ? PyLong_FromUnsignedLongLong(parent) : Py_NewRef(Py_None);
    PyObject *meta = NULL;
    if (tokens != NULL && hash_obj != NULL && parent_obj != NULL) {
        meta = PyObject_CallFunctionObjArgs(t->meta_type, hash_obj, parent_obj, tokens, NULL);
    }
    Py_XDECREF(tokens);
    Py_XDECREF(hash_obj);
    Py_XDECREF(parent_obj);
    return meta;
}

/* A BlockMeta rebuilt from slot's guard (a new reference), or NULL with an exception set. */
static PyObject *slot_meta(const SlotTable *t, int32_t slot) {
    return build_meta(t, t->hash[slot], t->has_parent[slot], t->parent[slot],
                      &t->tokens[(Py_ssize_t)slot * t->block_size]);
}

/* A grant_type tuple (lease_id, slot, block_hash, medium), stealing hash_obj; NULL with an exception set. */
static PyObject *make_grant(const SlotTable *t, uint64_t lease_id, int32_t slot, PyObject *hash_obj,
                            PyObject *medium) {
    PyTypeObject *type = (PyTypeObject *)t->grant_type;
    PyObject *grant = type->tp_alloc(type, 4);
    PyObject *id = PyLong_FromUnsignedLongLong(lease_id);
    PyObject *row = PyLong_FromLong(slot);
    if (grant == NULL || id == NULL || row == NULL) {
        Py_XDECREF(grant);
        Py_XDECREF(id);
        Py_XDECREF(row);
        Py_DECREF(hash_obj);
        return NULL;
    }
    PyTuple_SET_ITEM(grant, 0, id);
    PyTuple_SET_ITEM(grant, 1, row);
    PyTuple_SET_ITEM(grant, 2, hash_obj);
    PyTuple_SET_ITEM(grant, 3, Py_NewRef(medium));
    return grant;
}

/* ------------------------------------------------------------------ object */

static void table_free_arrays(SlotTable *t) {
    if (t->pending != NULL) {
        for (Py_ssize_t s = 0; s < t->num_slots; s++) {
            Py_CLEAR(t->pending[s]);
        }
    }
    PyMem_Free(t->state);
    PyMem_Free(t->pins);
    PyMem_Free(t->hash);
    PyMem_Free(t->parent);
    PyMem_Free(t->has_parent);
    PyMem_Free(t->tokens);
    PyMem_Free(t->pending);
    PyMem_Free(t->prev);
    PyMem_Free(t->next);
    PyMem_Free(t->freeq);
    PyMem_Free(t->index);
    PyMem_Free(t->leases);
    t->state = NULL;
    t->pins = NULL;
    t->hash = t->parent = NULL;
    t->has_parent = NULL;
    t->tokens = NULL;
    t->pending = NULL;
    t->prev = t->next = t->freeq = t->index = NULL;
    t->leases = NULL;
}

static int table_traverse(SlotTable *t, visitproc visit, void *arg) {
    Py_VISIT(t->meta_type);
    Py_VISIT(t->grant_type);
    Py_VISIT(t->lease_error);
    if (t->pending != NULL) {
        for (Py_ssize_t s = 0; s < t->num_slots; s++) {
            Py_VISIT(t->pending[s]);
        }
    }
    return 0;
}

static int table_clear(SlotTable *t) {
    Py_CLEAR(t->meta_type);
    Py_CLEAR(t->grant_type);
    Py_CLEAR(t->lease_error);
    if (t->pending != NULL) {
        for (Py_ssize_t s = 0; s < t->num_slots; s++) {
            Py_CLEAR(t->pending[s]);
        }
    }
    return 0;
}

static void table_dealloc(SlotTable *t) {
    PyObject_GC_UnTrack(t);
    table_clear(t);
    table_free_arrays(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* The deallocator of classes written in Python (CPython's subtype_dealloc), read off a probe class at import. */
static destructor python_class_dealloc;

/* 1 when instances of `type` are tuples with nothing else to free (a class written in Python deriving from
 * tuple, as a NamedTuple is), so that tp_alloc and filling the items is what tuple.__new__ does; else 0. A
 * C-defined tuple type such as a struct sequence keeps fields past the visible ones, which its own
 * deallocator frees, so tuple.__new__ refuses it too ("is not safe"). */
static int tuple_type_ok(PyObject *type) {
    if (!PyType_Check(type)) {
        return 0;
    }
    for (PyTypeObject *t = (PyTypeObject *)type; t != &PyTuple_Type; t = t->tp_base) {
        if (t == NULL || !(t->tp_flags & Py_TPFLAGS_HEAPTYPE) || t->tp_dealloc != python_class_dealloc) {
            return 0;
        }
    }
    return 1;
}

static int table_init(SlotTable *t, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"num_slots", "block_size", "meta_type", "grant_type", "lease_error", NULL};
    Py_ssize_t num_slots, block_size;
    PyObject *meta_type, *grant_type, *lease_error;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nnOOO:SlotTable", names, &num_slots, &block_size, &meta_type,
                                     &grant_type, &lease_error)) {
        return -1;
    }
    if (t->state != NULL) {
        PyErr_SetString(PyExc_TypeError, "SlotTable is initialized once");
        return -1;
    }
    if (num_slots < 1 || num_slots > INT32_MAX / 4 || block_size < 1 || block_size > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "SlotTable: bad shape %zd slots x %zd tokens", num_slots, block_size);
        return -1;
    }
    if (!PyType_Check(meta_type) || !tuple_type_ok(grant_type) || !PyExceptionClass_Check(lease_error)) {
        PyErr_SetString(PyExc_TypeError,
                        "SlotTable: meta_type must be a type, grant_type a Python tuple subclass, lease_error an "
                        "exception class");
        return -1;
    }
    Py_ssize_t n = num_slots;
    uint64_t index_size = 2;
    int index_shift = 63;
    while (index_size < (uint64_t)n * 2) {
        index_size <<= 1;
        index_shift--;
    }
    t->num_slots = n;
    t->block_size = block_size;
    t->state = PyMem_Calloc(n, 1);
    t->pins = PyMem_Calloc(n, sizeof(int32_t));
    t->hash = PyMem_Calloc(n, sizeof(uint64_t));
    t->parent = PyMem_Calloc(n, sizeof(uint64_t));
    t->has_parent = PyMem_Calloc(n, 1);
    t->tokens = PyMem_Calloc((size_t)n * block_size, sizeof(int64_t));
    t->pending = PyMem_Calloc(n, sizeof(PyObject *));
    t->prev = PyMem_Malloc(n * sizeof(int32_t));
    t->next = PyMem_Malloc(n * sizeof(int32_t));
    t->freeq = PyMem_Malloc(n * sizeof(int32_t));
    t->index = PyMem_Malloc(index_size * sizeof(int32_t));
    t->leases = PyMem_Calloc(64, sizeof(LeaseRec));
    if (!t->state || !t->pins || !t->hash || !t->parent || !t->has_parent || !t->tokens || !t->pending ||
        !t->prev || !t->next || !t->freeq || !t->index || !t->leases) {
        table_free_arrays(t);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t s = 0; s < n; s++) {
        t->prev[s] = t->next[s] = -1;
        t->freeq[s] = (int32_t)s;
    }
    memset(t->index, 0xff, index_size * sizeof(int32_t));
    t->index_mask = index_size - 1;
    t->index_shift = index_shift;
    t->lease_mask = 63;
    t->lease_shift = 64 - 6;
    t->lru_head = t->lru_tail = -1;
    t->free_head = 0;
    t->free_count = n;
    t->next_lease = 1;
    t->meta_type = Py_NewRef(meta_type);
    t->grant_type = Py_NewRef(grant_type);
    t->lease_error = Py_NewRef(lease_error);
    return 0;
}

static int not_ready(const SlotTable *t) {
    if (t->state == NULL) {
        PyErr_SetString(PyExc_ValueError, "the SlotTable was not initialized");
        return 1;
    }
    return 0;
}

#define READY(t)                                                                                              \
    do {                                                                                                      \
        if (not_ready(t)) {                                                                                   \
            return NULL;                                                                                      \
        }                                                                                                     \
    } while (0)

/* 0 when the table is at `version` still, else -1 with RuntimeError set: Python code run while a call built its
 * answer (a field's getter, keep(), a garbage collector's finalizer) changed the table under the call's plan. */
static int unchanged(const SlotTable *t, uint64_t version, const char *name) {
    if (t->version != version) {
        PyErr_Format(PyExc_RuntimeError, "SlotTable.%s: the table changed while the call built its answer", name);
        return -1;
    }
    return 0;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t wanted) {
    if (nargs != wanted) {
        PyErr_Format(PyExc_TypeError, "SlotTable.%s takes %zd arguments, got %zd", name, wanted, nargs);
        return -1;
    }
    return 0;
}

static int read_now(PyObject *value, double *now) {
    *now = PyFloat_AsDouble(value);
    return (*now == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* ------------------------------------------------------------------ reserve */

static int cmp_slot(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/*
 * reserve(metas, now, medium, evict) -> (grants, duplicates, no_slot, removed)
 *
 * Every block is checked first, as tiers/blocks.py's check_blocks does: exactly of meta_type, hashes in
 * 0..2**64-1 (the parent's may be None), a tuple of block_size token ids in 0..2**63-1; TypeError or
 * ValueError for the first that is not, and nothing changes.
 *
 * A write lease on a free slot for each block not cached, not being written and not named earlier in the
 * batch (those are duplicates, and a cached one becomes the most recently used). With `evict`, the least
 * recently used unleased cached blocks are dropped first to make room for all of them (their hashes in
 * `removed`, in LRU order); slots are taken from the free list's head and handed out in ascending order,
 * so a batch lands in as few runs as the free list allows. grants: one per block, in order, a grant_type
 * (lease_id, slot, block_hash, medium) or None; no_slot: blocks that wanted a slot and got none.
 */
static PyObject *table_reserve(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("reserve", nargs, 4) < 0) {
        return NULL;
    }
    double now;
    int evict = PyObject_IsTrue(args[3]);
    if (read_now(args[1], &now) < 0 || evict < 0) {
        return NULL;
    }
    PyObject *medium = args[2];
    PyObject *seq = PySequence_Tuple(args[0]); /* our own: a field's getter may change the caller's list */
    if (seq == NULL) {
        return NULL;
    }
    books_meta_type_intact();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), bs = t->block_size;
    PyObject **metas = PySequence_Fast_ITEMS(seq);
    Head *heads = PyMem_Calloc(n ? n : 1, sizeof(Head));
    int64_t *tokens = PyMem_Malloc((n ? n : 1) * bs * sizeof(int64_t));
    uint8_t *want = PyMem_Calloc(n ? n : 1, 1);
    /* The batch's own hashes, to find a block named twice: open addressing over positions (-1 empty). */
    uint64_t seen_size = 2;
    int seen_shift = 63;
    while (seen_size < (uint64_t)n * 2) {
        seen_size <<= 1;
        seen_shift--;
    }
    Py_ssize_t *seen = PyMem_Malloc(seen_size * sizeof(Py_ssize_t));
    int32_t *victims = NULL, *taken = NULL;
    PyObject *grants = NULL, *removed = NULL, *answer = NULL;
    Py_ssize_t parsed = 0, duplicates = 0, wanted = 0, num_victims = 0, k = 0, no_slot = 0;
    if (!heads || !tokens || !want || !seen) {
        PyErr_NoMemory();
        goto done;
    }
    for (; parsed < n; parsed++) { /* every meta read and checked before anything changes */
        if (Py_TYPE(metas[parsed]) != (PyTypeObject *)t->meta_type) {
            PyErr_Format(PyExc_TypeError, "expected %.100s, got %.100s", ((PyTypeObject *)t->meta_type)->tp_name,
                         Py_TYPE(metas[parsed])->tp_name);
            goto done;
        }
        if (read_head(metas[parsed], &heads[parsed]) < 0) {
            goto done;
        }
        if (read_tokens(t, metas[parsed], &tokens[parsed * bs], 1) < 0) {
            Py_CLEAR(heads[parsed].hash_obj);
            goto done;
        }
    }
    memset(seen, 0xff, seen_size * sizeof(Py_ssize_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = heads[i].hash;
        int32_t slot = index_slot(t, key);
        if (slot >= 0) {
            if (t->state[slot] == CACHED) {
                /* A repeated spill: the block stays, most recently used (so evicted last, should this batch
                 * need every unleased slot). Touched now: a call that fails below leaves only this behind. */
                lru_touch(t, slot);
            }
            duplicates++;
            continue;
        }
        uint64_t at = mix(key, seen_shift);
        int twice = 0;
        while (seen[at] >= 0) {
            if (heads[seen[at]].hash == key) {
                twice = 1;
                break;
            }
            at = (at + 1) & (seen_size - 1);
        }
        if (twice) {
            duplicates++;
            continue;
        }
        seen[at] = i;
        want[i] = 1;
        wanted++;
    }
    /* The victims, if any, and the slots to hand out, found without changing anything yet: the free list's
     * head, then the victims as they will join its tail. */
    uint64_t version = t->version;
    Py_ssize_t shortfall = evict ? wanted - t->free_count : 0;
    victims = PyMem_Malloc((shortfall > 0 ? shortfall : 1) * sizeof(int32_t));
    if (victims == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int32_t s = t->lru_head; s >= 0 && num_victims < shortfall; s = t->next[s]) {
        if (t->pins[s] == 0) {
            victims[num_victims++] = s;
        }
    }
    k = wanted < t->free_count + num_victims ? wanted : t->free_count + num_victims;
    grants = PyList_New(n);
    removed = PyList_New(num_victims);
    taken = PyMem_Malloc((k ? k : 1) * sizeof(int32_t));
    if (grants == NULL || removed == NULL || taken == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        taken[j] = j < t->free_count ? t->freeq[(t->free_head + j) % t->num_slots] : victims[j - t->free_count];
    }
    qsort(taken, k, sizeof(int32_t), cmp_slot);
    /* Every object the answer needs, before the change: the j-th block wanted gets taken[j]. */
    for (Py_ssize_t v = 0; v < num_victims; v++) {
        PyObject *gone = PyLong_FromUnsignedLongLong(t->hash[victims[v]]);
        if (gone == NULL) {
            goto done;
        }
        PyList_SET_ITEM(removed, v, gone);
    }
    for (Py_ssize_t i = 0, j = 0; i < n; i++) {
        PyObject *grant = Py_None;
        if (want[i] && j < k) {
            grant = make_grant(t, t->next_lease + j, taken[j], Py_NewRef(heads[i].hash_obj), medium);
            if (grant == NULL) {
                goto done;
            }
            j++;
        } else {
            Py_INCREF(grant);
            no_slot += want[i];
        }
        PyList_SET_ITEM(grants, i, grant);
    }
    if (unchanged(t, version, "reserve") < 0 || lease_reserve_room(t, k) < 0) {
        goto done;
    }
    /* The change: nothing below fails. */
    for (Py_ssize_t v = 0; v < num_victims; v++) {
        uncache(t, victims[v]);
    }
    t->num_evictions += num_victims;
    for (Py_ssize_t j = 0; j < k; j++) {
        free_pop(t);
    }
    for (Py_ssize_t i = 0, j = 0; i < n && j < k; i++) {
        if (!want[i]) {
            continue;
        }
        int32_t slot = taken[j++];
        t->state[slot] = WRITING;
        t->hash[slot] = heads[i].hash;
        t->parent[slot] = heads[i].parent;
        t->has_parent[slot] = (uint8_t)heads[i].has_parent;
        memcpy(&t->tokens[(Py_ssize_t)slot * bs], &tokens[i * bs], bs * sizeof(int64_t));
        t->pending[slot] = Py_NewRef(metas[i]);
        index_put(t, slot);
        lease_add(t, slot, KIND_WRITE, now);
    }
    answer = Py_BuildValue("(OnnO)", grants, duplicates, no_slot, removed);
done:
    for (Py_ssize_t i = 0; i < parsed; i++) {
        Py_XDECREF(heads[i].hash_obj);
    }
    Py_XDECREF(grants);
    Py_XDECREF(removed);
    PyMem_Free(heads);
    PyMem_Free(tokens);
    PyMem_Free(want);
    PyMem_Free(seen);
    PyMem_Free(victims);
    PyMem_Free(taken);
    Py_DECREF(seq);
    return answer;
}

/* ------------------------------------------------------------------ ending leases */

/* What a batch learns of each lease it names, copied out of the lease table (whose records move). */
typedef struct {
    uint64_t id;
    double granted_at;
    uint8_t kind;
} Named;

/* The live leases the sequence `seq` (a PySequence_Fast) names, checked as one batch, into out[len(seq)]: 0, or
 * -1 with LeaseError set for an unknown or ended id, an id named twice, or (with `writes_only`) a read lease.
 * Changes nothing and runs no Python code. */
static int named_leases(SlotTable *t, PyObject *seq, Named *out, int writes_only) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (++t->mark == 0) { /* wrapped: no lease may keep an old mark that equals a new one */
        for (uint64_t i = 0; i <= t->lease_mask; i++) {
            t->leases[i].mark = 0;
        }
        t->mark = 1;
    }
    Py_ssize_t twice = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t id = 0; /* no lease has id 0 */
        if (PyBool_Check(items[i]) || !books_u64(items[i], &id)) {
            id = 0;
        }
        LeaseRec *rec = lease_find(t, id);
        if (rec == NULL) {
            PyErr_Format(t->lease_error, "lease %R is unknown or already released", items[i]);
            return -1;
        }
        if (rec->mark == t->mark && twice < 0) {
            twice = i;
        }
        rec->mark = t->mark;
        out[i].id = rec->id;
        out[i].granted_at = rec->granted_at;
        out[i].kind = rec->kind;
    }
    if (twice >= 0) {
        PyErr_SetString(t->lease_error, "a lease id is listed twice");
        return -1;
    }
    for (Py_ssize_t i = 0; writes_only && i < n; i++) {
        if (out[i].kind != KIND_WRITE) {
            PyErr_Format(t->lease_error, "lease %R is a read lease: release it, only write leases commit", items[i]);
            return -1;
        }
    }
    return 0;
}

static PyObject *earliest_or_none(int any, double earliest) {
    return any ? PyFloat_FromDouble(earliest) : Py_NewRef(Py_None);
}

/* End lease `id` (live); its slot. */
static int32_t lease_end(SlotTable *t, uint64_t id) {
    LeaseRec *rec = lease_find(t, id);
    int32_t slot = rec->slot;
    lease_del(t, rec);
    if (--t->pins[slot] == 0) {
        t->num_leased_slots--;
    }
    return slot;
}

/*
 * commit(lease_ids, want_metas) -> (count, earliest granted_at or None, metas or None)
 *
 * Publish written slots as cached blocks, most recently used, in the order named; ends their write leases.
 * With `want_metas`, the metas their reserves named, in order (for events and write-through). Raises
 * LeaseError, changing nothing, if any id is not a live write lease or one is named twice.
 */
static PyObject *table_commit(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("commit", nargs, 2) < 0) {
        return NULL;
    }
    int want = PyObject_IsTrue(args[1]);
    PyObject *seq = want < 0 ? NULL : PySequence_Tuple(args[0]);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    /* Everything allocated before the leases are looked up: an allocation may run a finalizer. */
    PyObject *metas = PyList_New(n); /* the committed metas: handed back, or dropped once the change is done */
    Named *named = PyMem_Malloc((n ? n : 1) * sizeof(Named));
    PyObject *answer = NULL;
    if (metas == NULL || named == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    if (named_leases(t, seq, named, 1) < 0) {
        goto done;
    }
    double earliest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || named[i].granted_at < earliest) {
            earliest = named[i].granted_at;
        }
        int32_t slot = lease_end(t, named[i].id);
        t->state[slot] = CACHED;
        lru_append(t, slot);
        t->num_cached++;
        PyList_SET_ITEM(metas, i, t->pending[slot]); /* no decref inside the change: it could run code */
        t->pending[slot] = NULL;
    }
    PyObject *first = earliest_or_none(n > 0, earliest);
    if (first != NULL) {
        answer = Py_BuildValue("(nNO)", n, first, want ? metas : Py_None);
    }
done:
    Py_XDECREF(metas);
    PyMem_Free(named);
    Py_DECREF(seq);
    return answer;
}

/*
 * release(lease_ids) -> (reads, earliest granted_at of the read leases or None)
 *
 * End leases: read leases after a copy out, write leases to abandon a reservation (the slot is freed).
 * The last lease of a detached slot frees it. Raises LeaseError, changing nothing, if any id is unknown
 * or ended, or one is named twice.
 */
static PyObject *table_release(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("release", nargs, 1) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq), reads = 0, dropped = 0;
    Named *named = PyMem_Malloc((n ? n : 1) * sizeof(Named));
    PyObject **drop = PyMem_Malloc((n ? n : 1) * sizeof(PyObject *)); /* abandoned writes' metas */
    if (named == NULL || drop == NULL || named_leases(t, seq, named, 0) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        PyMem_Free(named);
        PyMem_Free(drop);
        Py_DECREF(seq);
        return NULL;
    }
    double earliest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (named[i].kind == KIND_READ) {
            if (reads == 0 || named[i].granted_at < earliest) {
                earliest = named[i].granted_at;
            }
            reads++;
        }
        int32_t slot = lease_end(t, named[i].id);
        if (t->pins[slot] != 0) {
            continue;
        }
        if (t->state[slot] == WRITING) { /* abandoned: the block was never stored */
            index_del(t, t->hash[slot]);
            drop[dropped++] = t->pending[slot]; /* decref'd after the change: a deallocation may run code */
            t->pending[slot] = NULL;
            free_push(t, slot);
        } else if (t->state[slot] == DETACHED) {
            free_push(t, slot);
        }
    }
    for (Py_ssize_t d = 0; d < dropped; d++) {
        Py_DECREF(drop[d]);
    }
    PyMem_Free(named);
    PyMem_Free(drop);
    Py_DECREF(seq);
    PyObject *first = earliest_or_none(reads > 0, earliest);
    return first == NULL ? NULL : Py_BuildValue("(nN)", reads, first);
}

/* ------------------------------------------------------------------ acquire */

/*
 * acquire_prefix(metas, now, medium) -> [grant, ...]
 *
 * Read leases on the longest prefix of `metas` cached here with equal parent and tokens, each block now the
 * most recently used; a grant_type (lease_id, slot, block_hash, medium) per block. Stops before the first
 * miss, block being written, or collision (a collision is not counted here: the caller's acquire() of that
 * block counts it, once). Changes nothing when it raises.
 */
static PyObject *table_acquire_prefix(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("acquire_prefix", nargs, 3) < 0) {
        return NULL;
    }
    double now;
    if (read_now(args[1], &now) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(args[0]); /* our own: a field's getter may change the caller's list */
    if (seq == NULL) {
        return NULL;
    }
    books_meta_type_intact();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), bs = t->block_size, parsed = 0, found = 0;
    PyObject **metas = PySequence_Fast_ITEMS(seq);
    int32_t *slots = PyMem_Malloc((n ? n : 1) * sizeof(int32_t));
    Head *heads = PyMem_Calloc(n ? n : 1, sizeof(Head));
    uint8_t *valid = PyMem_Malloc(n ? n : 1);
    int64_t *tokens = PyMem_Malloc((n ? n : 1) * bs * sizeof(int64_t));
    PyObject *grants = NULL;
    if (slots == NULL || heads == NULL || valid == NULL || tokens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Every meta read first: reading one may run Python code (a field's getter), which could change the
     * table under a match already made. Token ids that are not valid simply match nothing. */
    for (; parsed < n; parsed++) {
        if (read_head(metas[parsed], &heads[parsed]) < 0) {
            goto done;
        }
        int ok = read_tokens(t, metas[parsed], &tokens[parsed * bs], 0);
        if (ok < 0) {
            Py_CLEAR(heads[parsed].hash_obj);
            goto done;
        }
        valid[parsed] = (uint8_t)ok;
    }
    for (; found < n; found++) {
        int32_t slot = index_slot(t, heads[found].hash);
        if (slot < 0 || t->state[slot] != CACHED || !valid[found] ||
            !same_guard(t, slot, &heads[found], &tokens[found * bs])) {
            break;
        }
        slots[found] = slot;
    }
    uint64_t version = t->version;
    grants = PyList_New(found);
    if (grants == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < found; i++) {
        PyObject *grant = make_grant(t, t->next_lease + i, slots[i], heads[i].hash_obj, args[2]);
        heads[i].hash_obj = NULL; /* stolen */
        if (grant == NULL) {
            Py_CLEAR(grants);
            goto done;
        }
        PyList_SET_ITEM(grants, i, grant);
    }
    if (unchanged(t, version, "acquire_prefix") < 0 || lease_reserve_room(t, found) < 0) {
        Py_CLEAR(grants);
        goto done;
    }
    for (Py_ssize_t i = 0; i < found; i++) {
        lru_touch(t, slots[i]);
        lease_add(t, slots[i], KIND_READ, now);
    }
done:
    for (Py_ssize_t i = 0; i < parsed; i++) {
        Py_XDECREF(heads[i].hash_obj);
    }
    PyMem_Free(slots);
    PyMem_Free(heads);
    PyMem_Free(valid);
    PyMem_Free(tokens);
    Py_DECREF(seq);
    return grants;
}

/*
 * acquire(meta, now) -> (lease_id, slot) or None
 *
 * A read lease on the cached block `meta` (now most recently used), or None on a miss. A cached block with
 * its hash but another parent or other tokens is a collision: counted, and a miss.
 */
static PyObject *table_acquire(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("acquire", nargs, 2) < 0) {
        return NULL;
    }
    double now;
    if (read_now(args[1], &now) < 0) {
        return NULL;
    }
    books_meta_type_intact();
    Head head;
    if (read_head(args[0], &head) < 0) {
        return NULL;
    }
    Py_DECREF(head.hash_obj);
    int64_t *tokens = PyMem_Malloc(t->block_size * sizeof(int64_t));
    if (tokens == NULL) {
        return PyErr_NoMemory();
    }
    int valid = read_tokens(t, args[0], tokens, 0); /* before the lookup: it may run Python code */
    if (valid < 0) {
        PyMem_Free(tokens);
        return NULL;
    }
    int32_t slot = index_slot(t, head.hash);
    if (slot < 0 || t->state[slot] != CACHED) {
        PyMem_Free(tokens);
        Py_RETURN_NONE;
    }
    int same = valid && same_guard(t, slot, &head, tokens);
    PyMem_Free(tokens);
    if (!same) {
        t->num_collisions++;
        Py_RETURN_NONE;
    }
    uint64_t version = t->version;
    PyObject *answer = Py_BuildValue("(Ki)", (unsigned long long)t->next_lease, slot);
    if (answer == NULL || unchanged(t, version, "acquire") < 0 || lease_reserve_room(t, 1) < 0) {
        Py_XDECREF(answer);
        return NULL;
    }
    lru_touch(t, slot);
    lease_add(t, slot, KIND_READ, now);
    return answer;
}

/* ------------------------------------------------------------------ eviction */

/*
 * evict(count, keep, now) -> (kept, removed)
 *
 * Take up to `count` least recently used unleased cached blocks out of the index. Those for which
 * keep(block_hash) is true come back with a read lease that keeps the slot (kept: [(lease_id, slot, meta)],
 * the meta rebuilt from the slot) until it is released; the others' slots are freed at once. keep True:
 * keep all; None: keep none. removed: every block taken out, its hash, in LRU order. Counted as evictions.
 */
static PyObject *table_evict(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("evict", nargs, 3) < 0) {
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[0]);
    double now;
    if ((count == -1 && PyErr_Occurred()) || read_now(args[2], &now) < 0) {
        return NULL;
    }
    int keep_all = args[1] == Py_True;
    PyObject *keep = args[1] == Py_None || keep_all ? NULL : args[1];
    if (count < 0) {
        count = 0;
    }
    if (count > t->num_cached) {
        count = t->num_cached;
    }
    int32_t *victims = PyMem_Malloc((count ? count : 1) * sizeof(int32_t));
    uint8_t *kept = PyMem_Calloc(count ? count : 1, 1);
    PyObject *keep_list = NULL, *removed = NULL, *answer = NULL;
    Py_ssize_t num = 0, num_kept = 0;
    if (victims == NULL || kept == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int32_t s = t->lru_head; s >= 0 && num < count; s = t->next[s]) {
        if (t->pins[s] == 0) {
            victims[num++] = s;
        }
    }
    uint64_t version = t->version; /* keep() and building the answer run Python code: checked below */
    removed = PyList_New(num);
    if (removed == NULL) {
        goto done;
    }
    for (Py_ssize_t v = 0; v < num; v++) {
        PyObject *hash = PyLong_FromUnsignedLongLong(t->hash[victims[v]]);
        if (hash == NULL) {
            goto done;
        }
        PyList_SET_ITEM(removed, v, hash);
        if (keep_all) {
            kept[v] = 1;
            num_kept++;
        } else if (keep != NULL) {
            PyObject *said = PyObject_CallOneArg(keep, hash);
            int yes = said == NULL ? -1 : PyObject_IsTrue(said);
            Py_XDECREF(said);
            if (yes < 0) {
                goto done;
            }
            kept[v] = (uint8_t)yes;
            num_kept += yes;
        }
    }
    keep_list = PyList_New(num_kept);
    if (keep_list == NULL) {
        goto done;
    }
    for (Py_ssize_t v = 0, j = 0; v < num; v++) {
        if (!kept[v]) {
            continue;
        }
        PyObject *meta = slot_meta(t, victims[v]);
        PyObject *item = meta == NULL ? NULL
                                      : Py_BuildValue("(KiN)", (unsigned long long)(t->next_lease + j), victims[v], meta);
        if (item == NULL) {
            goto done;
        }
        PyList_SET_ITEM(keep_list, j++, item);
    }
    if (unchanged(t, version, "evict") < 0 || lease_reserve_room(t, num_kept) < 0) {
        goto done;
    }
    for (Py_ssize_t v = 0; v < num; v++) {
        int32_t s = victims[v];
        if (kept[v]) {
            lease_add(t, s, KIND_READ, now); /* pinned first: uncache() then detaches it */
        }
        uncache(t, s);
    }
    t->num_evictions += num;
    answer = Py_BuildValue("(OO)", keep_list, removed);
done:
    Py_XDECREF(keep_list);
    Py_XDECREF(removed);
    PyMem_Free(victims);
    PyMem_Free(kept);
    return answer;
}

/* The CACHED (or, with `writing`, also WRITING) slot of `value`, or -1. */
static int32_t slot_of(const SlotTable *t, PyObject *value, int writing) {
    uint64_t key;
    if (!books_u64(value, &key)) {
        return -1;
    }
    int32_t slot = index_slot(t, key);
    if (slot < 0 || !(t->state[slot] == CACHED || (writing && t->state[slot] == WRITING))) {
        return -1;
    }
    return slot;
}

/* remove(block_hash) -> bool: drop a cached block; its slot is freed once no lease holds it. */
static PyObject *table_remove(SlotTable *t, PyObject *value) {
    READY(t);
    int32_t slot = slot_of(t, value, 0);
    if (slot < 0) {
        Py_RETURN_FALSE;
    }
    uncache(t, slot);
    Py_RETURN_TRUE;
}

/* touch(block_hash): a cached block becomes the most recently used. */
static PyObject *table_touch(SlotTable *t, PyObject *value) {
    READY(t);
    int32_t slot = slot_of(t, value, 0);
    if (slot >= 0) {
        lru_touch(t, slot);
    }
    Py_RETURN_NONE;
}

/* slot_of(block_hash) -> the cached block's slot, or None. */
static PyObject *table_slot_of(SlotTable *t, PyObject *value) {
    READY(t);
    int32_t slot = slot_of(t, value, 0);
    return slot < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(slot);
}

static int table_contains(SlotTable *t, PyObject *value) { return t->state != NULL && slot_of(t, value, 0) >= 0; }

static PyObject *table_is_writing(SlotTable *t, PyObject *value) {
    READY(t);
    uint64_t key;
    int32_t slot = books_u64(value, &key) ? index_slot(t, key) : -1;
    return PyBool_FromLong(slot >= 0 && t->state[slot] == WRITING);
}

/* held_among(hashes, writing) -> set: those of `hashes` cached here (with `writing`: or being written). */
static PyObject *table_held_among(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("held_among", nargs, 2) < 0) {
        return NULL;
    }
    int writing = PyObject_IsTrue(args[1]);
    PyObject *seq = writing < 0 ? NULL : PySequence_Tuple(args[0]); /* our own: hashing may run Python code */
    if (seq == NULL) {
        return NULL;
    }
    PyObject *held = PySet_New(NULL);
    for (Py_ssize_t i = 0; held != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (slot_of(t, item, writing) >= 0 && PySet_Add(held, item) < 0) {
            Py_CLEAR(held);
        }
    }
    Py_DECREF(seq);
    return held;
}

/* lru_hashes() -> [block_hash, ...]: cached blocks, least recently used first. */
static PyObject *table_lru_hashes(SlotTable *t, PyObject *unused) {
    READY(t);
    (void)unused;
    PyObject *out = PyList_New(t->num_cached);
    Py_ssize_t i = 0;
    for (int32_t s = t->lru_head; out != NULL && s >= 0; s = t->next[s], i++) {
        PyObject *hash = PyLong_FromUnsignedLongLong(t->hash[s]);
        if (hash == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, hash);
    }
    return out;
}

/* cached_metas() -> [BlockMeta, ...]: every cached block, least recently used first, rebuilt from the slots
 * (a snapshot: the slots and their guards are copied before anything is built). */
static PyObject *table_cached_metas(SlotTable *t, PyObject *unused) {
    READY(t);
    (void)unused;
    Py_ssize_t n = t->num_cached, bs = t->block_size;
    uint64_t *heads = PyMem_Malloc((n ? n : 1) * 2 * sizeof(uint64_t));
    uint8_t *parents = PyMem_Malloc(n ? n : 1);
    int64_t *tokens = PyMem_Malloc((n ? n : 1) * bs * sizeof(int64_t));
    PyObject *out = NULL;
    if (heads == NULL || parents == NULL || tokens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t i = 0;
    for (int32_t s = t->lru_head; s >= 0 && i < n; s = t->next[s], i++) {
        heads[2 * i] = t->hash[s];
        heads[2 * i + 1] = t->parent[s];
        parents[i] = t->has_parent[s];
        memcpy(&tokens[i * bs], &t->tokens[(Py_ssize_t)s * bs], bs * sizeof(int64_t));
    }
    out = PyList_New(n);
    for (Py_ssize_t j = 0; out != NULL && j < n; j++) {
        PyObject *meta = build_meta(t, heads[2 * j], parents[j], heads[2 * j + 1], &tokens[j * bs]);
        if (meta == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, j, meta);
    }
done:
    PyMem_Free(heads);
    PyMem_Free(parents);
    PyMem_Free(tokens);
    return out;
}

/* ------------------------------------------------------------------ leases, one by one */

static LeaseRec *lease_arg(SlotTable *t, PyObject *value) {
    uint64_t id;
    return books_u64(value, &id) ? lease_find(t, id) : NULL;
}

static PyObject *table_holds(SlotTable *t, PyObject *value) {
    READY(t); return PyBool_FromLong(lease_arg(t, value) != NULL); }

/* lease_info(lease_id) -> (slot, is_write, meta, granted_at): a write lease's meta is the one its reserve
 * named, a read lease's is rebuilt from the slot. Raises LeaseError for an unknown or ended lease. */
static PyObject *table_lease_info(SlotTable *t, PyObject *value) {
    READY(t);
    LeaseRec *rec = lease_arg(t, value);
    if (rec == NULL) {
        PyErr_Format(t->lease_error, "lease %R is unknown or already released", value);
        return NULL;
    }
    int32_t slot = rec->slot;
    int write = rec->kind == KIND_WRITE;
    double granted_at = rec->granted_at;
    PyObject *meta = write ? Py_NewRef(t->pending[slot]) : slot_meta(t, slot);
    if (meta == NULL) {
        return NULL;
    }
    return Py_BuildValue("(iNNd)", slot, PyBool_FromLong(write), meta, granted_at);
}

/* regrant(lease_ids, now): the leases' batch handed out at `now` (what their offload time counts from). */
static PyObject *table_regrant(SlotTable *t, PyObject *const *args, Py_ssize_t nargs) {
    READY(t);
    if (check_nargs("regrant", nargs, 2) < 0) {
        return NULL;
    }
    double now;
    if (read_now(args[1], &now) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "lease ids must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        LeaseRec *rec = lease_arg(t, PySequence_Fast_GET_ITEM(seq, i));
        if (rec != NULL) {
            rec->granted_at = now;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* leases() -> [(lease_id, slot, is_write), ...]: every live lease, by id. */
static PyObject *table_leases(SlotTable *t, PyObject *unused) {
    READY(t);
    (void)unused;
    PyObject *out = PyList_New(0);
    for (uint64_t i = 0; out != NULL && i <= t->lease_mask; i++) {
        const LeaseRec *rec = &t->leases[i];
        if (rec->id == 0) {
            continue;
        }
        PyObject *item = Py_BuildValue("(KiN)", (unsigned long long)rec->id, rec->slot,
                                       PyBool_FromLong(rec->kind == KIND_WRITE));
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(item);
    }
    if (out != NULL && PyList_Sort(out) < 0) {
        Py_CLEAR(out);
    }
    return out;
}

/* drop_leases(): forget every lease (the arena is closing; slots stay as they are). */
static PyObject *table_drop_leases(SlotTable *t, PyObject *unused) {
    READY(t);
    (void)unused;
    memset(t->leases, 0, (t->lease_mask + 1) * sizeof(LeaseRec));
    t->num_leases = 0;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ check */

#define CHECK(cond, ...)                                                                                      \
    do {                                                                                                      \
        if (!(cond)) {                                                                                        \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);                                                  \
            goto fail;                                                                                        \
        }                                                                                                     \
    } while (0)

/* check(): assert every invariant of the module comment; raises AssertionError naming the first fault. */
static PyObject *table_check(SlotTable *t, PyObject *unused) {
    READY(t);
    (void)unused;
    Py_ssize_t n = t->num_slots;
    int32_t *count = PyMem_Calloc(n, sizeof(int32_t));
    uint8_t *seen = PyMem_Calloc(n, 1);
    if (count == NULL || seen == NULL) {
        PyMem_Free(count);
        PyMem_Free(seen);
        return PyErr_NoMemory();
    }
    Py_ssize_t leases = 0, leased = 0, cached = 0, writing = 0, indexed = 0;
    for (uint64_t i = 0; i <= t->lease_mask; i++) {
        const LeaseRec *rec = &t->leases[i];
        if (rec->id == 0) {
            continue;
        }
        leases++;
        CHECK(rec->slot >= 0 && rec->slot < n, "lease %llu names slot %d", (unsigned long long)rec->id, rec->slot);
        CHECK(lease_find(t, rec->id) == rec, "lease %llu cannot be found by its id", (unsigned long long)rec->id);
        CHECK(rec->id < t->next_lease, "lease %llu was never handed out", (unsigned long long)rec->id);
        count[rec->slot]++;
        if (rec->kind == KIND_WRITE) {
            CHECK(t->state[rec->slot] == WRITING, "write lease %llu on slot %d not being written",
                  (unsigned long long)rec->id, rec->slot);
        } else {
            CHECK(rec->kind == KIND_READ, "lease %llu has no kind", (unsigned long long)rec->id);
            CHECK(t->state[rec->slot] == CACHED || t->state[rec->slot] == DETACHED,
                  "read lease %llu on slot %d that holds no block", (unsigned long long)rec->id, rec->slot);
        }
    }
    CHECK(leases == t->num_leases, "%zd leases counted, %zd held", t->num_leases, leases);
    for (Py_ssize_t q = 0; q < t->free_count; q++) {
        int32_t s = t->freeq[(t->free_head + q) % n];
        CHECK(s >= 0 && s < n && !seen[s], "slot %d is twice in the free list", s);
        CHECK(t->state[s] == FREE, "slot %d is in the free list but in use", s);
        seen[s] = 1;
    }
    for (uint64_t i = 0; i <= t->index_mask; i++) {
        int32_t s = t->index[i];
        if (s < 0) {
            continue;
        }
        indexed++;
        CHECK(s < n && (t->state[s] == CACHED || t->state[s] == WRITING), "index names slot %d, not stored", s);
        CHECK(index_find(t, t->hash[s]) == (Py_ssize_t)i, "slot %d is indexed under another hash", s);
    }
    Py_ssize_t lru = 0;
    for (int32_t s = t->lru_head, back = -1; s >= 0; back = s, s = t->next[s]) {
        CHECK(t->state[s] == CACHED, "slot %d is on the LRU list but not cached", s);
        CHECK(t->prev[s] == back, "the LRU list's links disagree at slot %d", s);
        CHECK(++lru <= n, "the LRU list loops");
    }
    for (Py_ssize_t s = 0; s < n; s++) {
        CHECK(count[s] == t->pins[s], "slot %zd has %d pins and %d leases", s, t->pins[s], count[s]);
        leased += t->pins[s] != 0;
        CHECK((t->pending[s] != NULL) == (t->state[s] == WRITING), "slot %zd's pending meta disagrees with its state",
              s);
        switch (t->state[s]) {
        case FREE:
            CHECK(seen[s] && t->pins[s] == 0, "free slot %zd is in use or not in the free list", s);
            break;
        case WRITING:
            writing++;
            CHECK(t->pins[s] == 1, "slot %zd being written has %d leases", s, t->pins[s]);
            CHECK(index_slot(t, t->hash[s]) == s, "slot %zd being written is not indexed", s);
            break;
        case CACHED:
            cached++;
            CHECK(index_slot(t, t->hash[s]) == s, "cached slot %zd is not indexed", s);
            break;
        case DETACHED:
            CHECK(t->pins[s] >= 1, "detached slot %zd has no lease: it leaked", s);
            CHECK(index_slot(t, t->hash[s]) != s, "detached slot %zd is still indexed", s);
            break;
        default:
            CHECK(0, "slot %zd has state %d", s, t->state[s]);
        }
    }
    CHECK(cached == t->num_cached && lru == cached, "%zd cached slots, %zd counted, %zd on the LRU list", cached,
          t->num_cached, lru);
    CHECK(leased == t->num_leased_slots, "leased-slot count is off: %zd, counted %zd", leased, t->num_leased_slots);
    CHECK(indexed == cached + writing, "%zd index entries for %zd stored slots", indexed, cached + writing);
    PyMem_Free(count);
    PyMem_Free(seen);
    Py_RETURN_NONE;
fail:
    PyMem_Free(count);
    PyMem_Free(seen);
    return NULL;
}

/* ------------------------------------------------------------------ type */

static PyObject *get_count(SlotTable *t, void *which) {
    READY(t);
    switch ((intptr_t)which) {
    case 0:
        return PyLong_FromSsize_t(t->num_cached);
    case 1:
        return PyLong_FromSsize_t(t->free_count);
    case 2:
        return PyLong_FromSsize_t(t->num_leased_slots);
    case 3:
        return PyLong_FromLongLong(t->num_evictions);
    case 4:
        return PyLong_FromLongLong(t->num_collisions);
    case 5:
        return PyLong_FromSsize_t(t->num_leases);
    default:
        return PyLong_FromSsize_t(t->num_slots);
    }
}

static PyGetSetDef table_getset[] = {
    {"num_blocks", (getter)get_count, NULL, "cached blocks", (void *)0},
    {"num_free_slots", (getter)get_count, NULL, "slots holding nothing", (void *)1},
    {"num_leased_slots", (getter)get_count, NULL, "slots pinned by a lease", (void *)2},
    {"num_evictions", (getter)get_count, NULL, "blocks evicted to make room", (void *)3},
    {"num_collisions", (getter)get_count, NULL, "acquires that found another block under the hash", (void *)4},
    {"num_leases", (getter)get_count, NULL, "leases held", (void *)5},
    {"num_slots", (getter)get_count, NULL, "slots", (void *)6},
    {NULL, NULL, NULL, NULL, NULL},
};

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))table_##name, METH_FASTCALL, doc}

static PyMethodDef table_methods[] = {
    FAST(reserve, "reserve(metas, now, medium, evict) -> (grants, duplicates, no_slot, removed hashes)"),
    FAST(commit, "commit(lease_ids, want_metas) -> (count, earliest granted_at or None, metas or None)"),
    FAST(release, "release(lease_ids) -> (read leases ended, their earliest granted_at or None)"),
    FAST(acquire_prefix, "acquire_prefix(metas, now, medium) -> [grant, ...]"),
    FAST(acquire, "acquire(meta, now) -> (lease_id, slot) or None"),
    FAST(evict, "evict(count, keep, now) -> ([(lease_id, slot, meta)], removed hashes)"),
    FAST(held_among, "held_among(hashes, writing) -> set"),
    FAST(regrant, "regrant(lease_ids, now)"),
    {"remove", (PyCFunction)table_remove, METH_O, "remove(block_hash) -> bool"},
    {"touch", (PyCFunction)table_touch, METH_O, "touch(block_hash)"},
    {"slot_of", (PyCFunction)table_slot_of, METH_O, "slot_of(block_hash) -> the cached block's slot, or None"},
    {"is_writing", (PyCFunction)table_is_writing, METH_O, "is_writing(block_hash) -> bool"},
    {"holds", (PyCFunction)table_holds, METH_O, "holds(lease_id) -> bool"},
    {"lease_info", (PyCFunction)table_lease_info, METH_O, "lease_info(lease_id) -> (slot, is_write, meta, granted_at)"},
    {"lru_hashes", (PyCFunction)table_lru_hashes, METH_NOARGS, "lru_hashes() -> [block_hash, ...]"},
    {"cached_metas", (PyCFunction)table_cached_metas, METH_NOARGS, "cached_metas() -> [BlockMeta, ...]"},
    {"leases", (PyCFunction)table_leases, METH_NOARGS, "leases() -> [(lease_id, slot, is_write), ...]"},
    {"drop_leases", (PyCFunction)table_drop_leases, METH_NOARGS, "drop_leases()"},
    {"check", (PyCFunction)table_check, METH_NOARGS, "check(): raise AssertionError on a broken invariant"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods table_as_sequence = {
    .sq_contains = (objobjproc)table_contains,
};

static PyTypeObject SlotTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvstore.tiers._copyrows.SlotTable",
    .tp_doc = "SlotTable(num_slots, block_size, meta_type, grant_type, lease_error): the CPU arena's books",
    .tp_basicsize = sizeof(SlotTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)table_init,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_traverse = (traverseproc)table_traverse,
    .tp_clear = (inquiry)table_clear,
    .tp_methods = table_methods,
    .tp_getset = table_getset,
    .tp_as_sequence = &table_as_sequence,
};

int slots_add(PyObject *module) {
    if (PyType_Ready(&SlotTableType) < 0) {
        return -1;
    }
    PyObject *probe = PyObject_CallFunction((PyObject *)&PyType_Type, "s(O){s:()}", "_probe", (PyObject *)&PyTuple_Type,
                                            "__slots__");
    if (probe == NULL) {
        return -1;
    }
    python_class_dealloc = ((PyTypeObject *)probe)->tp_dealloc;
    Py_DECREF(probe);
    Py_INCREF(&SlotTableType);
    if (PyModule_AddObject(module, "SlotTable", (PyObject *)&SlotTableType) < 0) {
        Py_DECREF(&SlotTableType);
        return -1;
    }
    return 0;
}
