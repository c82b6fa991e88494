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
 *                        hash moved to the index's end (most recently used)
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
    int marked; /* set only while live_leases runs: the lease was named already */
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
    Py_ssize_t offsets[META_FIELDS];
    for (int field = 0; field < META_FIELDS; field++) {
        PyObject *descr = PyDict_GetItemWithError(((PyTypeObject *)type)->tp_dict, field_names[field]);
        if (descr == NULL && PyErr_Occurred()) {
            return NULL;
        }
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            Py_RETURN_FALSE; /* not stored in a slot of its own: read by attribute */
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX && member->type != T_OBJECT) {
            Py_RETURN_FALSE;
        }
        offsets[field] = member->offset;
    }
    for (int field = 0; field < META_FIELDS; field++) {
        field_offsets[field] = offsets[field];
    }
    Py_INCREF(type);
    Py_XSETREF(meta_type, (PyTypeObject *)type);
    Py_RETURN_TRUE;
}

/* The int `value` as a slot of `num_slots`, or -1 with an exception set. */
static Py_ssize_t slot_number(PyObject *value, Py_ssize_t num_slots) {
    Py_ssize_t slot = PyLong_AsSsize_t(value);
    if (slot == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (slot < 0 || slot >= num_slots) {
        PyErr_Format(PyExc_IndexError, "slot %zd is outside the arena's %zd slots", slot, num_slots);
        return -1;
    }
    return slot;
}

/* pins[slot] += delta (slot in range); the new count, or -1 with an exception set. */
static Py_ssize_t pin_add(PyObject *pins, Py_ssize_t slot, Py_ssize_t delta) {
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
    PyObject *pairs = PySequence_Fast(args[7], "lease_many: pairs must be a sequence");
    if (pairs == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(pairs), num_slots = PyList_GET_SIZE(pins);
    PyObject **items = PySequence_Fast_ITEMS(pairs);
    if (slot_meta != NULL && PyList_GET_SIZE(slot_meta) != num_slots) {
        PyErr_SetString(PyExc_ValueError, "lease_many: slot_meta and pins differ in length");
        goto fail_pairs;
    }
    /* Every pair is checked before anything changes. */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyTuple_Check(items[i]) || PyTuple_GET_SIZE(items[i]) != 2) {
            PyErr_SetString(PyExc_TypeError, "lease_many: each pair must be a (slot, meta) tuple");
            goto fail_pairs;
        }
        if (slot_number(PyTuple_GET_ITEM(items[i], 0), num_slots) < 0) {
            goto fail_pairs;
        }
    }
    PyObject *move_to_end = index == NULL ? NULL : PyObject_GetAttr(index, str_move_to_end);
    if (index != NULL && move_to_end == NULL) {
        goto fail_pairs;
    }
    PyObject *leases = PyList_New(n);
    if (leases == NULL) {
        Py_XDECREF(move_to_end);
        goto fail_pairs;
    }
    Py_ssize_t pinned = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot_obj = PyTuple_GET_ITEM(items[i], 0), *meta = PyTuple_GET_ITEM(items[i], 1);
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
        if (move_to_end != NULL) {
            PyObject *block_hash = books_meta_field(meta, META_HASH);
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
    Py_XDECREF(move_to_end);
    Py_DECREF(pairs);
    return Py_BuildValue("(Nn)", leases, pinned);
fail:
    Py_XDECREF(move_to_end);
    Py_DECREF(leases);
fail_pairs:
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
    PyObject *metas = PySequence_Fast(args[2], "match_prefix: metas must be a sequence");
    if (metas == NULL) {
        return NULL;
    }
    PyObject *found = PyList_New(0);
    if (found == NULL) {
        Py_DECREF(metas);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(metas), num_slots = PyList_GET_SIZE(slot_meta);
    PyObject **items = PySequence_Fast_ITEMS(metas);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *meta = items[i];
        PyObject *block_hash = books_meta_field(meta, META_HASH);
        if (block_hash == NULL) {
            goto fail;
        }
        /* An OrderedDict reads through the dict's own lookup (its __getitem__ is dict's). */
        PyObject *slot_obj = PyDict_GetItemWithError(index, block_hash);
        Py_DECREF(block_hash);
        if (slot_obj == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            break;
        }
        Py_ssize_t slot = slot_number(slot_obj, num_slots);
        if (slot < 0) {
            goto fail;
        }
        PyObject *stored = PyList_GET_ITEM(slot_meta, slot);
        if (stored == Py_None) {
            PyErr_Format(PyExc_AssertionError, "cached slot %zd holds no block", slot);
            goto fail;
        }
        int equal = same_field(stored, meta, META_TOKENS);
        if (equal == 1) {
            equal = same_field(stored, meta, META_PARENT);
        }
        if (equal < 0) {
            goto fail;
        }
        if (!equal) {
            break;
        }
        PyObject *pair = PyTuple_Pack(2, slot_obj, stored);
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

/* The live leases `ids` names, in order (a new list); Py_None (a new reference) when an id is
 * not an int, unknown, named twice, or (`kind` not NULL) a lease is of another kind;
 * NULL with an exception set on a failure. Changes nothing. */
static PyObject *live_leases(PyObject *held, PyObject *ids, PyObject *kind) {
    PyObject *seq = PySequence_Fast(ids, "lease_ids must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *leases = PyList_New(n);
    if (leases == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    /* A lease named twice is found marked. Every id must be an int exactly (anything else is refused here and
     * left to the arena's Python loop), so looking it up runs no Python code that could see or reuse a mark;
     * every mark is cleared before returning. */
    Py_ssize_t found = 0;
    int twice = 0;
    for (Py_ssize_t i = 0; i < n && !twice; i++) {
        if (!PyLong_CheckExact(items[i])) {
            goto refused;
        }
        PyObject *lease = PyDict_GetItemWithError(held, items[i]);
        if (lease == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            goto refused;
        }
        if (!PyObject_TypeCheck(lease, &LeaseCoreType) || (kind != NULL && ((LeaseCore *)lease)->kind != kind)) {
            goto refused;
        }
        twice = ((LeaseCore *)lease)->marked;
        ((LeaseCore *)lease)->marked = 1;
        Py_INCREF(lease);
        PyList_SET_ITEM(leases, i, lease);
        found = i + 1;
    }
    for (Py_ssize_t i = 0; i < found; i++) {
        ((LeaseCore *)PyList_GET_ITEM(leases, i))->marked = 0;
    }
    if (twice) {
        goto refused_unmarked;
    }
    Py_DECREF(seq);
    return leases;
refused:
    for (Py_ssize_t i = 0; i < found; i++) {
        ((LeaseCore *)PyList_GET_ITEM(leases, i))->marked = 0;
    }
refused_unmarked:
    Py_DECREF(leases); /* its unfilled items are NULL, which list dealloc skips */
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t i = 0; i < found; i++) {
        ((LeaseCore *)PyList_GET_ITEM(leases, i))->marked = 0;
    }
    Py_DECREF(leases);
    Py_DECREF(seq);
    return NULL;
}

/* del held[lease.lease_id]; pins[lease.slot] -= 1. The new pin count, or -1 with an exception set. */
static Py_ssize_t end_lease(PyObject *held, PyObject *pins, LeaseCore *lease) {
    Py_ssize_t slot = slot_number(lease->slot, PyList_GET_SIZE(pins));
    if (slot < 0 || PyDict_DelItem(held, lease->lease_id) < 0) {
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
    PyObject *leases = live_leases(held, args[4], args[5]);
    if (leases == NULL || leases == Py_None) {
        return leases;
    }
    Py_ssize_t unpinned = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(leases); i++) {
        LeaseCore *lease = (LeaseCore *)PyList_GET_ITEM(leases, i);
        Py_ssize_t count = end_lease(held, pins, lease);
        if (count < 0) {
            goto fail;
        }
        unpinned += count == 0;
        PyObject *block_hash = books_meta_field(lease->meta, META_HASH);
        if (block_hash == NULL) {
            goto fail;
        }
        int failed = PyObject_DelItem(writing, block_hash) < 0 || PyObject_SetItem(index, block_hash, lease->slot) < 0;
        Py_DECREF(block_hash);
        if (failed) {
            goto fail;
        }
    }
    return Py_BuildValue("(Nn)", leases, unpinned);
fail:
    Py_DECREF(leases);
    return NULL;
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
    if (PyList_GET_SIZE(slot_meta) != PyList_GET_SIZE(pins)) {
        PyErr_SetString(PyExc_ValueError, "release_many: slot_meta and pins differ in length");
        return NULL;
    }
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
        LeaseCore *lease = (LeaseCore *)PyList_GET_ITEM(leases, i);
        Py_ssize_t count = end_lease(held, pins, lease);
        if (count < 0) {
            goto fail;
        }
        if (count > 0) {
            continue;
        }
        unpinned++;
        PyObject *block_hash = books_meta_field(lease->meta, META_HASH);
        if (block_hash == NULL) {
            goto fail;
        }
        int free_it;
        if (lease->kind == write_kind) { /* an abandoned reservation */
            free_it = PyObject_DelItem(writing, block_hash) < 0 ? -1 : 1;
        } else { /* a read: its slot is free once the block left the index (detached) */
            PyObject *current = PyDict_GetItemWithError(index, block_hash);
            if (current == NULL) {
                free_it = PyErr_Occurred() ? -1 : 1;
            } else {
                free_it = PyObject_RichCompareBool(current, lease->slot, Py_NE);
            }
        }
        Py_DECREF(block_hash);
        if (free_it < 0) {
            goto fail;
        }
        if (free_it) {
            Py_ssize_t slot = PyLong_AsSsize_t(lease->slot); /* checked by end_lease */
            Py_INCREF(Py_None);
            if (PyList_SetItem(slot_meta, slot, Py_None) < 0 || PyList_Append(freed, lease->slot) < 0) {
                goto fail;
            }
        }
    }
    return Py_BuildValue("(NnN)", leases, unpinned, freed);
fail:
    Py_DECREF(leases);
    Py_DECREF(freed);
    return NULL;
}

/* ------------------------------------------------------------------ grants and their clocks */

/* `leases` as a sequence of LeaseCore objects (a new reference), or NULL with TypeError set. */
static PyObject *lease_sequence(PyObject *leases) {
    PyObject *seq = PySequence_Fast(leases, "leases must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        if (!PyObject_TypeCheck(items[i], &LeaseCoreType)) {
            PyErr_Format(PyExc_TypeError, "expected a lease, got %.100s", Py_TYPE(items[i])->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
    }
    return seq;
}

static PyObject *grant_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("grant_many", nargs, 4) < 0) {
        return NULL;
    }
    PyTypeObject *grant_type = (PyTypeObject *)args[0];
    PyObject *medium = args[2], *now = args[3];
    if (!PyType_Check(args[0]) || !PyType_IsSubtype(grant_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "grant_many: grant_type must be a tuple type");
        return NULL;
    }
    PyObject *seq = lease_sequence(args[1]);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *grants = PyList_New(n);
    if (grants == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        LeaseCore *lease = (LeaseCore *)items[i];
        if (lease->lease_id == NULL || lease->slot == NULL || lease->meta == NULL) {
            PyErr_SetString(PyExc_AttributeError, "grant_many: a lease is missing its fields");
            goto fail;
        }
        PyObject *block_hash = books_meta_field(lease->meta, META_HASH);
        if (block_hash == NULL) {
            goto fail;
        }
        /* A tuple subclass's instance, filled as tuple.__new__ fills one. */
        PyObject *grant = grant_type->tp_alloc(grant_type, 4);
        if (grant == NULL) {
            Py_DECREF(block_hash);
            goto fail;
        }
        Py_INCREF(lease->lease_id);
        PyTuple_SET_ITEM(grant, 0, lease->lease_id);
        Py_INCREF(lease->slot);
        PyTuple_SET_ITEM(grant, 1, lease->slot);
        PyTuple_SET_ITEM(grant, 2, block_hash);
        Py_INCREF(medium);
        PyTuple_SET_ITEM(grant, 3, medium);
        PyList_SET_ITEM(grants, i, grant);
        Py_INCREF(now);
        Py_XSETREF(lease->granted_at, now);
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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), count = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *earliest = Py_None; /* borrowed from a lease */
    for (Py_ssize_t i = 0; i < n; i++) {
        LeaseCore *lease = (LeaseCore *)items[i];
        if (lease->kind != kind) {
            continue;
        }
        count++;
        PyObject *granted = lease->granted_at;
        if (granted == NULL || granted == Py_None) {
            continue;
        }
        int earlier = earliest == Py_None ? 1 : PyObject_RichCompareBool(granted, earliest, Py_LT);
        if (earlier < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (earlier) {
            earliest = granted;
        }
    }
    PyObject *answer = Py_BuildValue("(nO)", count, earliest);
    Py_DECREF(seq);
    return answer;
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
    Py_ssize_t count = PyLong_AsSsize_t(args[3]), num_slots = PyList_GET_SIZE(pins);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (PyList_GET_SIZE(slot_meta) != num_slots) {
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
        Py_ssize_t slot = slot_obj == NULL ? -1 : slot_number(slot_obj, num_slots);
        if (slot < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "drop_lru: the index changed while it was read");
            }
            Py_DECREF(block_hash);
            goto fail;
        }
        PyObject *pinned = PyList_GET_ITEM(pins, slot);
        int unleased = PyLong_Check(pinned) && PyLong_AsSsize_t(pinned) == 0;
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
    Py_INCREF(&LeaseCoreType);
    if (PyModule_AddObject(module, "LeaseCore", (PyObject *)&LeaseCoreType) < 0) {
        Py_DECREF(&LeaseCoreType);
        return -1;
    }
    return 0;
}
