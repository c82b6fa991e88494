"""Keeping a serving process's start-up objects out of the garbage collector's way.

A serving process (the router, ``kvstore serve``, a worker) imports torch,
FastAPI and the rest before it serves: about 220,000 objects that live as
long as the process does. CPython's cyclic collector walks every tracked
object on each full (generation 2) collection: 53 ms in the router's
process on the development machine, during which every stream it relays
stands still. Full collections are rare while serving (CPython runs one
once the objects that survived since the last reach a quarter of those it
kept then), but each is that long a stall.

:func:`freeze_startup_heap`, called once start-up is done, collects what
start-up left behind and moves everything still alive to the permanent
generation (``gc.freeze``, which CPython documents for this use): later
collections walk only what serving allocates (the same full collection
then takes microseconds). Objects frozen are never
collected, so it is called where the process serves until it exits, never in
a library path a test might run many times.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
