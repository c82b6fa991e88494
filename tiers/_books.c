/*
 * The CPU arena's batch bookkeeping in C: part of kvstore.tiers._copyrows (built from this
 * file and _copyrows.c; books_add() below adds it to that module).
 *
 * Each function here is the inner loop of one batch operation of tiers/cpu_arena.py, run
 * over the arena's own Python objects -- the index (an OrderedDict: hash -> slot), the
 * per-slot meta and pin lists, the writing dict (hash -> slot) and the held dict (lease
 * id -> lease) -- doing exactly what the Python loop beside it does (cpu_arena.py keeps
 * that loop for installs without a C compiler, and the tests drive both side by side).
 * Nothing here owns state: the arena's invariants are the arena's.
 *
 *   LeaseCore            the fields of a lease (_arena, lease_id, slot, meta, kind, and
 *                        granted_at, which tiers/leases.py sets); the arena's Lease class
 *                        subclasses it and adds the methods
 *   lease_many(cls, arena, held, pins, slot_meta, index, first_id, pairs, kind)
 *                        -> (leases, newly pinned slots)
 *                        a lease of `cls` per (slot, meta) pair, ids from first_id up, each
 *                        entered in `held` and counted in pins[slot]; with `slot_meta` (not
 *                        None) slot_meta[slot] = meta; with `index` (not None) each meta's
 *                        hash moved to the index's end (most recently used) first, before
 *                        any lease is made
 *   match_prefix(index, slot_meta, metas) -> [(slot, stored meta), ...]
 *                        the longest prefix of metas cached with equal tokens and parent
 *   commit_many(held, pins, writing, index, lease_ids, write_kind) -> (leases, unpinned)
 *   release_many(held, pins, writing, index, slot_meta, lease_ids, write_kind)
 *                        -> (leases, unpinned, freed slots)
 *                        end the named leases. Both first check every id (live, named
 *                        once, and for commit a write lease) and answer None, changing
 *                        nothing, when one fails: the arena then finds which, for the
 *                        message.
 *   grant_many(grant_type, leases, medium, now) -> [grant, ...]
 *                        a grant_type tuple (lease_id, slot, meta.block_hash, medium) per
 *                        lease, each lease's granted_at set to `now` (tiers/leases.py)
 *   earliest_grant(leases, kind) -> (count, earliest granted_at or None)
 *                        over the leases of `kind` (tiers/leases.py)
 *   use_meta_type(meta_type) -> bool
 *                        read the fields of block metas of exactly that type from their slots
 *                        (see "block meta fields" below); called once by tiers/blocks.py
 *   drop_lru(index, pins, slot_meta, count) -> (freed slots, their metas)
 *                        up to `count` least recently used unleased blocks taken out of the
 *                        index, their slot_meta entries set to None
 *
 * Why C: on small blocks the books cost as much as the copy. At 16 KiB a block a spill's
 * and a promotion's Python loops (a Lease object, a dict entry and a pin per block, the
 * prefix match, the ending) took about 1.3 - 2 us a block, against 1.3 us for memcpy of
 * the block. The same work through the C API skips the interpreter's per-block dispatch
 * and builds a lease with one allocation instead of a Python __init__ call.
 *
 * All under the GIL, which none of these releases. Mutations go through the objects' own
 * C API (PyObject_SetItem / PyObject_DelItem on the OrderedDict, so its order is kept).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>

#include "_books.h"

/* ------------------------------------------------------------------ LeaseCore */

typedef struct {
    PyObject_HEAD
    PyObject *arena;
    PyObject *lease_id;
    PyObject *slot;
    PyObject *meta;
    PyObject *kind;
    PyObject *granted_at;
} LeaseCore;

static int LeaseCore_traverse(LeaseCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->arena);
    Py_VISIT(self->lease_id);
    Py_VISIT(self->slot);
    Py_VISIT(self->meta);
    Py_VISIT(self->kind);
    Py_VISIT(self->granted_at);
    return 0;
}

static int LeaseCore_clear(LeaseCore *self) {
    Py_CLEAR(self->arena);
    Py_CLEAR(self->lease_id);
    Py_CLEAR(self->slot);
    Py_CLEAR(self->meta);
    Py_CLEAR(self->kind);
    Py_CLEAR(self->granted_at);
    return 0;
}

static void LeaseCore_dealloc(LeaseCore *self) {
    PyObject_GC_UnTrack(self);
    LeaseCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef LeaseCore_members[] = {
    {"_arena", T_OBJECT_EX, offsetof(LeaseCore, arena), 0, "the arena that granted the lease"},
    {"lease_id", T_OBJECT_EX, offsetof(LeaseCore, lease_id), 0, "the lease's id in its arena"},
    {"slot", T_OBJECT_EX, offsetof(LeaseCore, slot), 0, "the arena slot it holds"},
    {"meta", T_OBJECT_EX, offsetof(LeaseCore, meta), 0, "the block whose bytes the slot holds or receives"},
    {"kind", T_OBJECT_EX, offsetof(LeaseCore, kind), 0, "LeaseKind.WRITE or LeaseKind.READ"},
    {"granted_at", T_OBJECT, offsetof(LeaseCore, granted_at), 0, "when the lease was handed out (None: not yet)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LeaseCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore.tiers._copyrows.LeaseCore",
    .tp_basicsize = sizeof(LeaseCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fields of an arena lease (kvstore.tiers.cpu_arena.Lease subclasses it).",
    .tp_traverse = (traverseproc)LeaseCore_traverse,
    .tp_clear = (inquiry)LeaseCore_clear,
    .tp_dealloc = (destructor)LeaseCore_dealloc,
    .tp_members = LeaseCore_members,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ helpers */

static PyObject *str_move_to_end;

/* ------------------------------------------------------------------ block meta fields
 *
 * Every kernel reads the fields of block metas (tiers/blocks.py's BlockMeta, a msgspec Struct whose fields
 * are member descriptors). use_meta_type(BlockMeta), called once at import, finds the instance offsets
 * behind those descriptors; a field of an object of exactly that type is then one load instead of an
 * attribute lookup (about 15 ns, eleven of them per block on a promotion). Anything else -- another type,
 * a subclass, a field unset -- goes through PyObject_GetAttr, which also raises the usual errors. */

static PyObject *field_names[META_FIELDS];
static PyTypeObject *meta_type; /* NULL until use_meta_type found all three offsets */
static Py_ssize_t field_offsets[META_FIELDS];
static PyObject *field_descrs[META_FIELDS]; /* the descriptors the offsets came from (strong references) */

int books_meta_type_intact(void) {
    if (meta_type == NULL) {
        return 0;
    }
    /* A class attribute reassigned since (a property, say) would be read by Python and not by the slot: stop
     * reading slots. Three lookups of interned names in the type's dict, which run no Python code. */
    for (int field = 0; field < META_FIELDS; field++) {
        PyObject *descr = PyDict_GetItemWithError(meta_type->tp_dict, field_names[field]);
        if (descr != field_descrs[field]) {
            PyErr_Clear();
            Py_CLEAR(meta_type);
            return 0;
        }
    }
    return 1;
}

PyObject *books_meta_field(PyObject *meta, int field) {
    if (Py_TYPE(meta) == meta_type) {
        PyObject *value = *(PyObject **)((char *)meta + field_offsets[field]);
        if (value != NULL) {
            Py_INCREF(value);
            return value;
        }
    }
    return PyObject_GetAttr(meta, field_names[field]);
}

static PyObject *use_meta_type(PyObject *module, PyObject *type) {
    (void)module;
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "use_meta_type: expected a type");
        return NULL;
    }
    PyTypeObject *candidate = (PyTypeObject *)type;
    Py_ssize_t offsets[META_FIELDS];
    PyObject *descrs[META_FIELDS];
    for (int field = 0; field < META_FIELDS; field++) {
        PyObject *descr = PyDict_GetItemWithError(candidate->tp_dict, field_names[field]);
        if (descr == NULL && PyErr_Occurred()) {
            return NULL;
        }
        /* Only the type's own object slots: a descriptor borrowed from another type, or one that is not an
         * object member inside the instance, is read by attribute. */
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
            ((PyDescrObject *)descr)->d_type != candidate) {
            Py_RETURN_FALSE;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        int object = member->type == T_OBJECT_EX || member->type == T_OBJECT;
        int inside = member->offset >= (Py_ssize_t)sizeof(PyObject) && candidate->tp_itemsize == 0 &&
                     member->offset <= candidate->tp_basicsize - (Py_ssize_t)sizeof(PyObject *);
        if (!object || !inside) {
            Py_RETURN_FALSE;
        }
        offsets[field] = member->offset;
        descrs[field] = descr;
    }
    for (int field = 0; field < META_FIELDS; field++) {
        field_offsets[field] = offsets[field];
        Py_INCREF(descrs[field]);
        Py_XSETREF(field_descrs[field], descrs[field]);
    }
    Py_INCREF(type);
    Py_XSETREF(meta_type, candidate);
    Py_RETURN_TRUE;
}

/* 0 when `slot` is one of `num_slots`, else -1 with IndexError set. */
static int slot_in_range(Py_ssize_t slot, Py_ssize_t num_slots) {
    if (slot < 0 || slot >= num_slots) {
        PyErr_Format(PyExc_IndexError, "slot %zd is outside the arena's %zd slots", slot, num_slots);
        return -1;
    }
    return 0;
}

/* The int `value` as a slot of `num_slots`, or -1 with an exception set. */
static Py_ssize_t slot_number(PyObject *value, Py_ssize_t num_slots) {
    Py_ssize_t slot = PyLong_AsSsize_t(value);
    if (slot == -1 && PyErr_Occurred()) {
        return -1;
    }
    return slot_in_range(slot, num_slots) < 0 ? -1 : slot;
}

/* pins[slot] += delta; the new count, or -1 with an exception set. */
static Py_ssize_t pin_add(PyObject *pins, Py_ssize_t slot, Py_ssize_t delta) {
    if (slot_in_range(slot, PyList_GET_SIZE(pins)) < 0) { /* checked again here: Python code may have run since */
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(pins, slot);
    Py_ssize_t count = PyLong_AsSsize_t(old);
    if (count == -1 && PyErr_Occurred()) {
        return -1;
    }
    count += delta;
    if (count < 0) {
        PyErr_Format(PyExc_AssertionError, "slot %zd was unpinned more often than pinned", slot);
        return -1;
    }
    PyObject *updated = PyLong_FromSsize_t(count);
    if (updated == NULL) {
        return -1;
    }
    PyList_SET_ITEM(pins, slot, updated);
    Py_DECREF(old);
    return count;
}

/* 1 when metas a's and b's `field` compare equal, 0 when not, -1 with an exception set. */
static int same_field(PyObject *a, PyObject *b, int field) {
    PyObject *x = books_meta_field(a, field);
    if (x == NULL) {
        return -1;
    }
    PyObject *y = books_meta_field(b, field);
    if (y == NULL) {
        Py_DECREF(x);
        return -1;
    }
    int equal = PyObject_RichCompareBool(x, y, Py_EQ);
    Py_DECREF(x);
    Py_DECREF(y);
    return equal;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t wanted) {
    if (nargs != wanted) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, wanted, nargs);
        return -1;
    }
    return 0;
}

static int check_dict(const char *name, PyObject *value) {
    if (!PyDict_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict", name);
        return -1;
    }
    return 0;
}

static int check_list(const char *name, PyObject *value) {
    if (!PyList_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", name);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ lease_many */

/* Python code can run inside several calls below (a meta's attribute, an index's move_to_end, a comparison,
 * a decref): every object a loop goes on using across such a call is held by a strong reference -- the
 * inputs as tuples of their own (PySequence_Tuple), the fields read, the leases built. */

/* 1 when every field a kernel reads of `lease` is set (a Python caller can `del` one), else 0. */
static int lease_complete(const LeaseCore *lease) {
    return lease->lease_id != NULL && lease->slot != NULL && lease->meta != NULL && lease->kind != NULL;
}

static PyObject *lease_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("lease_many", nargs, 9) < 0) {
        return NULL;
    }
    PyObject *cls = args[0], *arena = args[1], *held = args[2], *pins = args[3];
    PyObject *slot_meta = args[4] == Py_None ? NULL : args[4];
    PyObject *index = args[5] == Py_None ? NULL : args[5];
    PyObject *kind = args[8];
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, &LeaseCoreType)) {
        PyErr_SetString(PyExc_TypeError, "lease_many: cls must be a subclass of LeaseCore");
        return NULL;
    }
    if (check_dict("held", held) < 0 || check_list("pins", pins) < 0 ||
        (slot_meta != NULL && check_list("slot_meta", slot_meta) < 0) ||
        (index != NULL && check_dict("index", index) < 0)) {
        return NULL;
    }
    Py_ssize_t first_id = PyLong_AsSsize_t(args[6]);
    if (first_id == -1 && PyErr_Occurred()) {
        return NULL;
    }
    books_meta_type_intact();
    PyObject *pairs = PySequence_Tuple(args[7]);
    if (pairs == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(pairs);
    PyObject *leases = NULL, *move_to_end = NULL;
    if (first_id < 0 || first_id > PY_SSIZE_T_MAX - n) {
        PyErr_SetString(PyExc_OverflowError, "lease_many: lease ids out of range");
        goto fail;
    }
    /* Every pair is checked before anything changes. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "lease_many: each pair must be a (slot, meta) tuple");
            goto fail;
        }
        if (slot_number(PyTuple_GET_ITEM(pair, 0), PyList_GET_SIZE(pins)) < 0) {
            goto fail;
        }
    }
    /* Reads first: each block moves to the index's end (most recently used) before any lease is granted, so a
     * block that is no longer there (a KeyError) leaves no lease behind, as the Python loop does. */
    if (index != NULL) {
        move_to_end = PyObject_GetAttr(index, str_move_to_end);
        if (move_to_end == NULL) {
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *block_hash = books_meta_field(PyTuple_GET_ITEM(PyTuple_GET_ITEM(pairs, i), 1), META_HASH);
            if (block_hash == NULL) {
                goto fail;
            }
            PyObject *moved = PyObject_CallOneArg(move_to_end, block_hash);
            Py_DECREF(block_hash);
            if (moved == NULL) {
                goto fail;
            }
            Py_DECREF(moved);
        }
    }
    leases = PyList_New(n);
    if (leases == NULL) {
        goto fail;
    }
    Py_ssize_t pinned = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot_obj = PyTuple_GET_ITEM(PyTuple_GET_ITEM(pairs, i), 0);
        PyObject *meta = PyTuple_GET_ITEM(PyTuple_GET_ITEM(pairs, i), 1);
        Py_ssize_t slot = PyLong_AsSsize_t(slot_obj); /* checked above */
        LeaseCore *lease = (LeaseCore *)((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, 0);
        if (lease == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(leases, i, (PyObject *)lease);
        lease->lease_id = PyLong_FromSsize_t(first_id + i);
        if (lease->lease_id == NULL) {
            goto fail;
        }
        Py_INCREF(arena);
        lease->arena = arena;
        Py_INCREF(slot_obj);
        lease->slot = slot_obj;
        Py_INCREF(meta);
        lease->meta = meta;
        Py_INCREF(kind);
        lease->kind = kind;
        if (PyDict_SetItem(held, lease->lease_id, (PyObject *)lease) < 0) {
            goto fail;
        }
        Py_ssize_t count = pin_add(pins, slot, 1);
        if (count < 0) {
            goto fail;
        }
        pinned += count == 1;
        if (slot_meta != NULL) {
            Py_INCREF(meta);
            if (PyList_SetItem(slot_meta, slot, meta) < 0) {
                goto fail;
            }
        }
    }
    Py_XDECREF(move_to_end);
    Py_DECREF(pairs);
    return Py_BuildValue("(Nn)", leases, pinned);
fail:
    Py_XDECREF(move_to_end);
    Py_XDECREF(leases);
    Py_DECREF(pairs);
    return NULL;
}

/* ------------------------------------------------------------------ match_prefix */

static PyObject *match_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("match_prefix", nargs, 3) < 0) {
        return NULL;
    }
    PyObject *index = args[0], *slot_meta = args[1];
    if (check_dict("index", index) < 0 || check_list("slot_meta", slot_meta) < 0) {
        return NULL;
    }
    books_meta_type_intact();
    PyObject *metas = PySequence_Tuple(args[2]);
    if (metas == NULL) {
        return NULL;
    }
    PyObject *found = PyList_New(0);
    if (found == NULL) {
        Py_DECREF(metas);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(metas); i++) {
        PyObject *meta = PyTuple_GET_ITEM(metas, i);
        PyObject *block_hash = books_meta_field(meta, META_HASH);
        if (block_hash == NULL) {
            goto fail;
        }
        /* An OrderedDict reads through the dict's own lookup (its __getitem__ is dict's). */
        PyObject *slot_obj = PyDict_GetItemWithError(index, block_hash);
        Py_XINCREF(slot_obj);
        Py_DECREF(block_hash);
        if (slot_obj == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            break;
        }
        Py_ssize_t slot = slot_number(slot_obj, PyList_GET_SIZE(slot_meta));
        PyObject *stored = slot < 0 ? NULL : PyList_GET_ITEM(slot_meta, slot);
        if (stored == Py_None) {
            PyErr_Format(PyExc_AssertionError, "cached slot %zd holds no block", slot);
            stored = NULL;
        }
        if (stored == NULL) {
            Py_DECREF(slot_obj);
            goto fail;
        }
        Py_INCREF(stored);
        int equal = same_field(stored, meta, META_TOKENS);
        if (equal == 1) {
            equal = same_field(stored, meta, META_PARENT);
        }
        PyObject *pair = equal == 1 ? PyTuple_Pack(2, slot_obj, stored) : NULL;
        Py_DECREF(slot_obj);
        Py_DECREF(stored);
        if (equal == 0) {
            break;
        }
        if (pair == NULL) {
            goto fail;
        }
        int appended = PyList_Append(found, pair);
        Py_DECREF(pair);
        if (appended < 0) {
            goto fail;
        }
    }
    Py_DECREF(metas);
    return found;
fail:
    Py_DECREF(metas);
    Py_DECREF(found);
    return NULL;
}

/* ------------------------------------------------------------------ ending leases */

/* 1 when `items[0..n)` holds one pointer twice, 0 when not, -1 with MemoryError set: an open-addressing set of
 * the pointers, twice as large as n rounded up to a power of two (one pass, no Python objects). */
static int any_twice(PyObject *const *items, Py_ssize_t n) {
    size_t size = 16;
    while (size < 2 * (size_t)n) {
        size *= 2;
    }
    uintptr_t *table = PyMem_Calloc(size, sizeof(uintptr_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int twice = 0;
    for (Py_ssize_t i = 0; i < n && !twice; i++) {
        uintptr_t key = (uintptr_t)items[i];
        size_t at = (size_t)((key >> 4) * 0x9E3779B97F4A7C15ull) & (size - 1);
        while (table[at] != 0 && table[at] != key) {
            at = (at + 1) & (size - 1);
        }
        twice = table[at] == key;
        table[at] = key;
    }
    PyMem_Free(table);
    return twice;
}

/* The live leases `ids` names, in order (a new list); Py_None (a new reference) when an id is not an int,
 * unknown, or named twice, a lease has a field deleted, or (`kind` not NULL) a lease is of another kind; NULL
 * with an exception set on a failure. Changes nothing. The ids must be ints exactly: anything else is left to
 * the arena's Python loop, whose lookup may run the id's own __eq__. */
static PyObject *live_leases(PyObject *held, PyObject *ids, PyObject *kind) {
    PyObject *seq = PySequence_Tuple(ids);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject *leases = PyList_New(n);
    if (leases == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyTuple_GET_ITEM(seq, i);
        if (!PyLong_CheckExact(id)) {
            goto refused;
        }
        PyObject *lease = PyDict_GetItemWithError(held, id);
        if (lease == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            goto refused;
        }
        if (!PyObject_TypeCheck(lease, &LeaseCoreType) || !lease_complete((LeaseCore *)lease) ||
            (kind != NULL && ((LeaseCore *)lease)->kind != kind)) {
            goto refused;
        }
        Py_INCREF(lease);
        PyList_SET_ITEM(leases, i, lease);
    }
    /* One id twice is one lease twice. */
    int twice = any_twice(PySequence_Fast_ITEMS(leases), n);
    if (twice < 0) {
        goto fail;
    }
    if (twice) {
        goto refused;
    }
    Py_DECREF(seq);
    return leases;
refused:
    Py_DECREF(leases); /* its unfilled items are NULL, which list dealloc skips */
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(leases);
    Py_DECREF(seq);
    return NULL;
}

/* A lease's fields, each held by a strong reference while Python code may run (see lease_many). */
typedef struct {
    PyObject *id, *slot, *meta, *kind;
} Fields;

/* Takes `lease`'s fields; 0, or -1 with AttributeError set when one was deleted. */
static int fields_take(const LeaseCore *lease, Fields *fields) {
    if (!lease_complete(lease)) {
        PyErr_SetString(PyExc_AttributeError, "a lease is missing a field");
        return -1;
    }
    fields->id = Py_NewRef(lease->lease_id);
    fields->slot = Py_NewRef(lease->slot);
    fields->meta = Py_NewRef(lease->meta);
    fields->kind = Py_NewRef(lease->kind);
    return 0;
}

static void fields_drop(Fields *fields) {
    Py_DECREF(fields->id);
    Py_DECREF(fields->slot);
    Py_DECREF(fields->meta);
    Py_DECREF(fields->kind);
}

/* del held[id]; pins[slot] -= 1. The new pin count, or -1 with an exception set. */
static Py_ssize_t end_lease(PyObject *held, PyObject *pins, const Fields *fields) {
    Py_ssize_t slot = slot_number(fields->slot, PyList_GET_SIZE(pins));
    if (slot < 0 || PyDict_DelItem(held, fields->id) < 0) {
        return -1;
    }
    return pin_add(pins, slot, -1);
}

static PyObject *commit_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("commit_many", nargs, 6) < 0) {
        return NULL;
    }
    PyObject *held = args[0], *pins = args[1], *writing = args[2], *index = args[3];
    if (check_dict("held", held) < 0 || check_list("pins", pins) < 0 || check_dict("writing", writing) < 0 ||
        check_dict("index", index) < 0) {
        return NULL;
    }
    books_meta_type_intact();
    PyObject *leases = live_leases(held, args[4], args[5]);
    if (leases == NULL || leases == Py_None) {
        return leases;
    }
    Py_ssize_t unpinned = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(leases); i++) {
        Fields fields;
        if (fields_take((LeaseCore *)PyList_GET_ITEM(leases, i), &fields) < 0) {
            goto fail;
        }
        Py_ssize_t count = end_lease(held, pins, &fields);
        PyObject *block_hash = count < 0 ? NULL : books_meta_field(fields.meta, META_HASH);
        int failed = block_hash == NULL || PyObject_DelItem(writing, block_hash) < 0 ||
                     PyObject_SetItem(index, block_hash, fields.slot) < 0;
        Py_XDECREF(block_hash);
        fields_drop(&fields);
        if (failed) {
            goto fail;
        }
        unpinned += count == 0;
    }
    return Py_BuildValue("(Nn)", leases, unpinned);
fail:
    Py_DECREF(leases);
    return NULL;
}

/* 1 when a read lease's slot is free once its last lease ends -- its block left the index (detached), or the
 * index now names another slot for it (stored again) -- 0 when not, -1 with an exception set. */
static int read_slot_freed(PyObject *index, PyObject *block_hash, PyObject *slot) {
    PyObject *current = PyDict_GetItemWithError(index, block_hash);
    if (current == NULL) {
        return PyErr_Occurred() ? -1 : 1;
    }
    Py_INCREF(current);
    int other = PyObject_RichCompareBool(current, slot, Py_NE);
    Py_DECREF(current);
    return other;
}

static PyObject *release_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("release_many", nargs, 7) < 0) {
        return NULL;
    }
    PyObject *held = args[0], *pins = args[1], *writing = args[2], *index = args[3], *slot_meta = args[4];
    PyObject *write_kind = args[6];
    if (check_dict("held", held) < 0 || check_list("pins", pins) < 0 || check_dict("writing", writing) < 0 ||
        check_dict("index", index) < 0 || check_list("slot_meta", slot_meta) < 0) {
        return NULL;
    }
    books_meta_type_intact();
    PyObject *leases = live_leases(held, args[5], NULL);
    if (leases == NULL || leases == Py_None) {
        return leases;
    }
    PyObject *freed = PyList_New(0);
    if (freed == NULL) {
        Py_DECREF(leases);
        return NULL;
    }
    Py_ssize_t unpinned = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(leases); i++) {
        Fields fields;
        if (fields_take((LeaseCore *)PyList_GET_ITEM(leases, i), &fields) < 0) {
            goto fail;
        }
        Py_ssize_t count = end_lease(held, pins, &fields);
        int free_it = count < 0 ? -1 : 0;
        if (count == 0) {
            unpinned++;
            PyObject *block_hash = books_meta_field(fields.meta, META_HASH);
            if (block_hash == NULL) {
                free_it = -1;
            } else if (fields.kind == write_kind) { /* an abandoned reservation */
                free_it = PyObject_DelItem(writing, block_hash) < 0 ? -1 : 1;
            } else {
                free_it = read_slot_freed(index, block_hash, fields.slot);
            }
            Py_XDECREF(block_hash);
        }
        if (free_it == 1) {
            /* An int (end_lease read it); PyList_SetItem checks it against the list's length. */
            Py_ssize_t slot = PyLong_AsSsize_t(fields.slot);
            if (PyList_SetItem(slot_meta, slot, Py_NewRef(Py_None)) < 0 || PyList_Append(freed, fields.slot) < 0) {
                free_it = -1;
            }
        }
        fields_drop(&fields);
        if (free_it < 0) {
            goto fail;
        }
    }
    return Py_BuildValue("(NnN)", leases, unpinned, freed);
fail:
    Py_DECREF(leases);
    Py_DECREF(freed);
    return NULL;
}

/* ------------------------------------------------------------------ grants and their clocks */

/* `leases` as a tuple of LeaseCore objects (a new reference), or NULL with TypeError set. */
static PyObject *lease_sequence(PyObject *leases) {
    PyObject *seq = PySequence_Tuple(leases);
    if (seq == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (!PyObject_TypeCheck(item, &LeaseCoreType)) {
            PyErr_Format(PyExc_TypeError, "expected a lease, got %.100s", Py_TYPE(item)->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

/* The deallocator of classes written in Python (CPython's subtype_dealloc), read off a probe class at import. */
static destructor python_class_dealloc;

/* 1 when instances of `type` are tuples with nothing else to free (a class written in Python deriving from
 * tuple, as a NamedTuple is), so that tp_alloc and filling the items is what tuple.__new__ does; else 0. A
 * C-defined tuple type such as a struct sequence keeps fields past the visible ones, which its own
 * deallocator frees, so tuple.__new__ refuses it too ("is not safe"). */
static int tuple_layout(PyTypeObject *type) {
    for (PyTypeObject *t = type; t != &PyTuple_Type; t = t->tp_base) {
        if (t == NULL || !(t->tp_flags & Py_TPFLAGS_HEAPTYPE) || t->tp_dealloc != python_class_dealloc) {
            return 0;
        }
    }
    return 1;
}

static PyObject *grant_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("grant_many", nargs, 4) < 0) {
        return NULL;
    }
    PyTypeObject *grant_type = (PyTypeObject *)args[0];
    PyObject *medium = args[2], *now = args[3];
    if (!PyType_Check(args[0]) || !tuple_layout(grant_type)) {
        PyErr_SetString(PyExc_TypeError, "grant_many: grant_type must be a Python subclass of tuple");
        return NULL;
    }
    books_meta_type_intact();
    PyObject *seq = lease_sequence(args[1]);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject *grants = PyList_New(n);
    if (grants == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        LeaseCore *lease = (LeaseCore *)PyTuple_GET_ITEM(seq, i);
        Fields fields;
        if (fields_take(lease, &fields) < 0) {
            goto fail;
        }
        PyObject *block_hash = books_meta_field(fields.meta, META_HASH);
        PyObject *grant = block_hash == NULL ? NULL : grant_type->tp_alloc(grant_type, 4);
        if (grant == NULL) {
            Py_XDECREF(block_hash);
            fields_drop(&fields);
            goto fail;
        }
        /* The items as tuple.__new__ fills them; each reference is the grant's own. */
        PyTuple_SET_ITEM(grant, 0, Py_NewRef(fields.id));
        PyTuple_SET_ITEM(grant, 1, Py_NewRef(fields.slot));
        PyTuple_SET_ITEM(grant, 2, block_hash);
        PyTuple_SET_ITEM(grant, 3, Py_NewRef(medium));
        PyList_SET_ITEM(grants, i, grant);
        fields_drop(&fields);
        Py_XSETREF(lease->granted_at, Py_NewRef(now));
    }
    Py_DECREF(seq);
    return grants;
fail:
    Py_DECREF(grants);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *earliest_grant(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("earliest_grant", nargs, 2) < 0) {
        return NULL;
    }
    PyObject *kind = args[1];
    PyObject *seq = lease_sequence(args[0]);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = 0;
    PyObject *earliest = Py_NewRef(Py_None);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); i++) {
        LeaseCore *lease = (LeaseCore *)PyTuple_GET_ITEM(seq, i);
        if (lease->kind != kind) {
            continue;
        }
        count++;
        if (lease->granted_at == NULL || lease->granted_at == Py_None) {
            continue;
        }
        PyObject *granted = Py_NewRef(lease->granted_at); /* the comparison may run Python code */
        int earlier = earliest == Py_None ? 1 : PyObject_RichCompareBool(granted, earliest, Py_LT);
        if (earlier < 0) {
            Py_DECREF(granted);
            Py_DECREF(earliest);
            Py_DECREF(seq);
            return NULL;
        }
        if (earlier) {
            Py_SETREF(earliest, granted);
        } else {
            Py_DECREF(granted);
        }
    }
    Py_DECREF(seq);
    return Py_BuildValue("(nN)", count, earliest);
}

/* ------------------------------------------------------------------ drop_lru */

static PyObject *drop_lru(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("drop_lru", nargs, 4) < 0) {
        return NULL;
    }
    PyObject *index = args[0], *pins = args[1], *slot_meta = args[2];
    if (check_dict("index", index) < 0 || check_list("pins", pins) < 0 || check_list("slot_meta", slot_meta) < 0) {
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (PyList_GET_SIZE(slot_meta) != PyList_GET_SIZE(pins)) {
        PyErr_SetString(PyExc_ValueError, "drop_lru: slot_meta and pins differ in length");
        return NULL;
    }
    PyObject *hashes = PyList_New(0), *slots = PyList_New(0), *metas = PyList_New(0), *keys = NULL;
    if (hashes == NULL || slots == NULL || metas == NULL) {
        goto fail;
    }
    /* The victims first, oldest first (the OrderedDict iterates in LRU order), then the changes. */
    keys = PyObject_GetIter(index);
    if (keys == NULL) {
        goto fail;
    }
    PyObject *block_hash;
    while (PyList_GET_SIZE(slots) < count && (block_hash = PyIter_Next(keys)) != NULL) {
        PyObject *slot_obj = PyDict_GetItemWithError(index, block_hash);
        Py_ssize_t slot = slot_obj == NULL ? -1 : slot_number(slot_obj, PyList_GET_SIZE(pins));
        if (slot < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "drop_lru: the index changed while it was read");
            }
            Py_DECREF(block_hash);
            goto fail;
        }
        PyObject *pinned = PyList_GET_ITEM(pins, slot);
        int overflow = 0; /* a count past 64 bits is leased, not an error */
        int unleased = PyLong_Check(pinned) && PyLong_AsLongLongAndOverflow(pinned, &overflow) == 0 && !overflow;
        int failed = unleased && (PyList_Append(hashes, block_hash) < 0 || PyList_Append(slots, slot_obj) < 0);
        Py_DECREF(block_hash);
        if (failed) {
            goto fail;
        }
    }
    if (PyErr_Occurred()) {
        goto fail;
    }
    Py_CLEAR(keys);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i)); /* checked above */
        if (slot_in_range(slot, PyList_GET_SIZE(slot_meta)) < 0) {
            goto fail;
        }
        PyObject *meta = PyList_GET_ITEM(slot_meta, slot);
        if (meta == Py_None) {
            PyErr_Format(PyExc_AssertionError, "cached slot %zd holds no block", slot);
            goto fail;
        }
        if (PyList_Append(metas, meta) < 0 || PyObject_DelItem(index, PyList_GET_ITEM(hashes, i)) < 0) {
            goto fail;
        }
        Py_INCREF(Py_None);
        if (PyList_SetItem(slot_meta, slot, Py_None) < 0) {
            goto fail;
        }
    }
    Py_DECREF(hashes);
    return Py_BuildValue("(NN)", slots, metas);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(hashes);
    Py_XDECREF(slots);
    Py_XDECREF(metas);
    return NULL;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef books_methods[] = {
    {"lease_many", (PyCFunction)(void (*)(void))lease_many, METH_FASTCALL,
     "lease_many(cls, arena, held, pins, slot_meta, index, first_id, pairs, kind) -> (leases, pinned)"},
    {"match_prefix", (PyCFunction)(void (*)(void))match_prefix, METH_FASTCALL,
     "match_prefix(index, slot_meta, metas) -> [(slot, stored meta), ...]"},
    {"commit_many", (PyCFunction)(void (*)(void))commit_many, METH_FASTCALL,
     "commit_many(held, pins, writing, index, lease_ids, write_kind) -> (leases, unpinned) or None"},
    {"release_many", (PyCFunction)(void (*)(void))release_many, METH_FASTCALL,
     "release_many(held, pins, writing, index, slot_meta, lease_ids, write_kind) -> (leases, unpinned, freed)"
     " or None"},
    {"grant_many", (PyCFunction)(void (*)(void))grant_many, METH_FASTCALL,
     "grant_many(grant_type, leases, medium, now) -> [grant, ...]"},
    {"earliest_grant", (PyCFunction)(void (*)(void))earliest_grant, METH_FASTCALL,
     "earliest_grant(leases, kind) -> (count, earliest granted_at or None)"},
    {"use_meta_type", (PyCFunction)use_meta_type, METH_O,
     "use_meta_type(BlockMeta) -> bool: read that type's fields from their slots (False: by attribute)"},
    {"drop_lru", (PyCFunction)(void (*)(void))drop_lru, METH_FASTCALL,
     "drop_lru(index, pins, slot_meta, count) -> (freed slots, their metas)"},
    {NULL, NULL, 0, NULL},
};

int books_add(PyObject *module) {
    field_names[META_HASH] = PyUnicode_InternFromString("block_hash");
    field_names[META_PARENT] = PyUnicode_InternFromString("parent_hash");
    field_names[META_TOKENS] = PyUnicode_InternFromString("token_ids");
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    if (field_names[META_HASH] == NULL || field_names[META_PARENT] == NULL || field_names[META_TOKENS] == NULL ||
        str_move_to_end == NULL) {
        return -1;
    }
    if (PyType_Ready(&LeaseCoreType) < 0 || PyModule_AddFunctions(module, books_methods) < 0) {
        return -1;
    }
    PyObject *probe = PyObject_CallFunction((PyObject *)&PyType_Type, "s(O){s:()}", "_probe", (PyObject *)&PyTuple_Type,
                                            "__slots__");
    if (probe == NULL) {
        return -1;
    }
    python_class_dealloc = ((PyTypeObject *)probe)->tp_dealloc;
    Py_DECREF(probe);
    Py_INCREF(&LeaseCoreType);
    if (PyModule_AddObject(module, "LeaseCore", (PyObject *)&LeaseCoreType) < 0) {
        Py_DECREF(&LeaseCoreType);
        return -1;
    }
    return 0;
}
