/* The CPU arena's batch bookkeeping (tiers/_books.c), added to kvstore.tiers._copyrows at import. */
#ifndef KVSTORE_TIERS_BOOKS_H
#define KVSTORE_TIERS_BOOKS_H

#include <Python.h>

/* Adds LeaseCore, lease_many, match_prefix, commit_many and release_many to `module`; 0, or -1
 * with an exception set. */
int books_add(PyObject *module);

#endif
