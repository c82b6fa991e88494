/* Block meta field reads (tiers/_books.c) and the SlotTable (tiers/_slots.c), parts of kvstore.tiers._copyrows. */
#ifndef KVSTORE_TIERS_BOOKS_H
#define KVSTORE_TIERS_BOOKS_H

#include <Python.h>
#include <stdint.h>

/* Adds use_meta_type to `module`; 0, or -1 with an exception set. */
int books_add(PyObject *module);

/* Adds SlotTable (tiers/_slots.c) to `module`; 0, or -1 with an exception set. */
int slots_add(PyObject *module);

/* The fields of a block meta, by index (tiers/blocks.py's BlockMeta). */
enum { META_HASH = 0, META_PARENT = 1, META_TOKENS = 2, META_FIELDS = 3 };

/* `meta`'s field (a new reference), read from its slot when `meta` is of the type use_meta_type() was given,
 * else by attribute; NULL with an exception set when it cannot be read. */
PyObject *books_meta_field(PyObject *meta, int field);

/* Call once per kernel call, before reading fields: whether the slots use_meta_type() found are still the
 * type's fields (a class attribute reassigned since turns slot reads off for good). Never raises. */
int books_meta_type_intact(void);

/* 1 with *out set when `value` is an int in 0..2**64-1 (a block hash, a lease id), else 0. Never raises, runs no
 * Python code. */
int books_u64(PyObject *value, uint64_t *out);

/* `token` as a token id: its value when it is an int in 0..2**63-1, else -1. Never raises, runs no Python code. */
long long books_token_id(PyObject *token);

#endif
