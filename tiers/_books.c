/*
 * Reading block metas' fields from their slots: part of kvstore.tiers._copyrows (built from this file,
 * _copyrows.c and _slots.c; books_add() below adds use_meta_type to that module).
 *
 *   use_meta_type(meta_type) -> bool
 *                        read the fields of block metas of exactly that type from their slots
 *                        (see "block meta fields" below); called once by tiers/blocks.py
 *
 * metas_ok (_copyrows.c) and the SlotTable (_slots.c) read every block's hash, parent and token ids
 * through books_meta_field().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <structmember.h>

#include "_books.h"

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

int books_u64(PyObject *value, uint64_t *out) {
    if (!PyLong_Check(value)) {
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

long long books_token_id(PyObject *token) {
    int overflow = 0;
    long long id = PyLong_Check(token) ? PyLong_AsLongLongAndOverflow(token, &overflow) : -1;
    if (id == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    return overflow == 0 && id >= 0 ? id : -1;
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

/* ------------------------------------------------------------------ module */

static PyMethodDef books_methods[] = {
    {"use_meta_type", (PyCFunction)use_meta_type, METH_O,
     "use_meta_type(BlockMeta) -> bool: read that type's fields from their slots (False: by attribute)"},
    {NULL, NULL, 0, NULL},
};

int books_add(PyObject *module) {
    field_names[META_HASH] = PyUnicode_InternFromString("block_hash");
    field_names[META_PARENT] = PyUnicode_InternFromString("parent_hash");
    field_names[META_TOKENS] = PyUnicode_InternFromString("token_ids");
    if (field_names[META_HASH] == NULL || field_names[META_PARENT] == NULL || field_names[META_TOKENS] == NULL) {
        return -1;
    }
    return PyModule_AddFunctions(module, books_methods);
}
