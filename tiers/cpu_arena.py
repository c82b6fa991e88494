"""The CPU tier: an LRU cache of blocks in the node's shared-memory slots, with leases.

:class:`CpuArena` keeps its books in C arrays (``SlotTable``, from
``tiers/_slots.c`` in ``kvstore.tiers._copyrows``): the index, the LRU
order, the free list, each slot's state, pins and collision guard (hash,
parent, token ids), and the leases. Nothing is a Python object per block but
what a call hands back: on 16 KiB blocks the books kept as Python objects
(an ``OrderedDict`` entry, a lease object and the caller's ``BlockMeta`` per
block, freed when the slot was reused) cost as much as the copy.

:func:`new_arena` makes one, or, where the kernel is not built (no C
compiler at install), a :class:`~kvstore.tiers.cpu_arena_py.PyCpuArena`,
which keeps the same books in Python objects. The slot states and the
guarantees both keep are in :mod:`kvstore.tiers.arena`.

Design
------
- The lease protocol's batches are one C call each: ``reserve_grants``
  (classify, evict, take slots in ascending runs, copy the guards in, lease,
  build the grants), ``commit_ids``, ``release_ids``,
  ``acquire_prefix_grants``. Each checks all its input before it changes
  anything, so a bad lease id or a malformed block changes nothing.
- A write lease keeps the caller's ``BlockMeta`` until its commit, which
  hands it to the BlockStored event (or drops it when nobody subscribes).
  A cached block keeps only its guard: a ``BlockMeta`` is rebuilt from the
  slot for a disk write, a read lease's ``meta`` and the publisher's
  snapshot.
- Events: when :attr:`record_events` is off (the store has no publisher)
  nothing is recorded, not even the evicted hashes.
- Threads: every call runs under the GIL and none releases it or runs
  Python code in the middle of a change, so :meth:`snapshot_events` on the
  publisher's thread sees each block either before or after a change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.events import BlockStored, KVEvent, Medium
from kvstore.tiers.arena import Arena, Lease, LeaseKind, SlotsQueries
from kvstore.tiers.blocks import BlockMeta, SlotGrant
from kvstore.tiers.cpu_arena_py import PyCpuArena
from kvstore.tiers.errors import LeaseError
from kvstore.tiers.shared_memory import SharedSlots
from kvstore.tiers.tier_events import MediumEvents

_SlotTable: Any
try:  # the books in C (tiers/_slots.c); without a C compiler PyCpuArena keeps them in Python
    from kvstore.tiers._copyrows import SlotTable as _SlotTable
except ImportError:
    _SlotTable = None

NATIVE = _SlotTable is not None  # whether new_arena() keeps the books in C

__all__ = ["NATIVE", "Arena", "CpuArena", "Lease", "LeaseKind", "PyCpuArena", "new_arena"]

if TYPE_CHECKING:
    from kvstore.tiers._copyrows import SlotTable


def new_arena(slots: SharedSlots, *, block_size: int) -> Arena:
    """The arena over ``slots``: books in C where the kernel is built, else in Python."""
    if NATIVE:
        return CpuArena(slots, block_size=block_size)
    return PyCpuArena(slots, block_size=block_size)


class CpuArena(SlotsQueries):
    """Blocks in shared-memory slots, LRU-evicted, with leases that pin slots during copies; the books in C
    (an :class:`~kvstore.tiers.arena.Arena`). Raises RuntimeError where the kernel is not built."""

    def __init__(self, slots: SharedSlots, *, block_size: int) -> None:
        if _SlotTable is None:
            raise RuntimeError("kvstore.tiers._copyrows is not built: use PyCpuArena (new_arena picks it)")
        self.slots = slots
        self.block_size = block_size
        self._table: SlotTable = _SlotTable(slots.num_slots, block_size, BlockMeta, SlotGrant, LeaseError)
        self._events = MediumEvents(Medium.CPU, block_size)
        self.record_events = True

    # ----------------------------------------------------------------- queries

    @property
    def native(self) -> bool:
        """Whether the books are kept in C (always, here)."""
        return True

    @property
    def num_blocks(self) -> int:
        """Cached (committed) blocks."""
        return self._table.num_blocks

    @property
    def num_free_slots(self) -> int:
        return self._table.num_free_slots

    @property
    def num_leased_slots(self) -> int:
        """Slots pinned by a lease: the rest are free or evictable."""
        return self._table.num_leased_slots

    @property
    def num_evictions(self) -> int:
        return self._table.num_evictions

    @property
    def num_collisions(self) -> int:
        return self._table.num_collisions

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._table

    def held_among(self, block_hashes: Sequence[int], *, writing: bool = False) -> set[int]:
        """Which of ``block_hashes`` are cached here (``writing``: or being written)."""
        return self._table.held_among(block_hashes, writing)

    def is_writing(self, block_hash: int) -> bool:
        return self._table.is_writing(block_hash)

    def slot_of(self, block_hash: int) -> int | None:
        """The slot of the cached block ``block_hash``, or None."""
        return self._table.slot_of(block_hash)

    def lru_hashes(self) -> list[int]:
        """Cached block hashes, least recently used (next to be evicted) first."""
        return self._table.lru_hashes()

    def holds(self, lease_id: int) -> bool:
        return self._table.holds(lease_id)

    def lease_ids(self) -> list[int]:
        """Every live lease's id, ascending."""
        return [lease_id for lease_id, _, _ in self._table.leases()]

    def lease(self, lease_id: int) -> Lease:
        """The live lease ``lease_id`` (a new object each call); raises LeaseError if it is unknown or released."""
        slot, write, meta, granted_at = self._table.lease_info(lease_id)
        return Lease(self, lease_id, slot, meta, LeaseKind.WRITE if write else LeaseKind.READ, granted_at)

    # -------------------------------------------------- the lease protocol's batches (see arena.Arena)

    def reserve_grants(
        self, metas: Sequence[BlockMeta], now: float, *, evict: bool
    ) -> tuple[list[SlotGrant | None], int, int]:
        grants, duplicates, no_slot, removed = self._table.reserve(metas, now, Medium.CPU, evict)
        if removed and self.record_events:
            self._events.removed_hashes(removed)
        return grants, duplicates, no_slot

    def commit_ids(
        self, lease_ids: Sequence[int], *, metas: bool = False
    ) -> tuple[int, float | None, list[BlockMeta] | None]:
        count, earliest, committed = self._table.commit(lease_ids, metas or self.record_events)
        if self.record_events and committed:
            self._events.stored_many(committed)
        return count, earliest, committed if metas else None

    def release_ids(self, lease_ids: Sequence[int]) -> tuple[int, float | None]:
        return self._table.release(lease_ids)

    def acquire_prefix_grants(self, metas: Sequence[BlockMeta], now: float) -> list[SlotGrant]:
        return self._table.acquire_prefix(metas, now, Medium.CPU)

    def regrant(self, lease_ids: Sequence[int], now: float) -> None:
        self._table.regrant(lease_ids, now)

    # ---------------------------------------------------------------- one by one

    def reserve(self, meta: BlockMeta) -> Lease | None:
        """A write lease on a free slot for ``meta``'s bytes; None when no slot is free or the block is
        cached or being written already. Evicts nothing, and a cached block stays where it is in the LRU order."""
        if meta.block_hash in self._table:
            return None
        now = time.perf_counter()
        grants, _, _, _ = self._table.reserve((meta,), now, Medium.CPU, False)
        grant = grants[0]
        if grant is None:
            return None
        return Lease(self, grant.lease_id, grant.slot, meta, LeaseKind.WRITE, now)

    def acquire(self, meta: BlockMeta) -> Lease | None:
        """A read lease on the cached block ``meta`` (now most recently used), or None on a miss. A cached
        block with ``meta``'s hash but other tokens or parent is a hash collision: counted, and a miss."""
        now = time.perf_counter()
        got = self._table.acquire(meta, now)
        if got is None:
            return None
        lease_id, slot = got
        return Lease(self, lease_id, slot, meta, LeaseKind.READ, now)

    def commit(self, lease_id: int) -> None:
        """Publish a written slot as the most recently used block; ends the write lease."""
        self.commit_ids((lease_id,))

    def release(self, lease_id: int) -> None:
        """End a lease. An uncommitted write lease abandons its slot; the last lease of a detached slot frees it."""
        self._table.release((lease_id,))

    def touch(self, block_hash: int) -> None:
        """Mark a cached block most recently used (a repeated spill of it, say)."""
        self._table.touch(block_hash)

    def evict_lru(self, count: int, keep: Callable[[int], bool] | None = None) -> list[Lease]:
        """See :meth:`kvstore.tiers.arena.Arena.evict_lru`."""
        if count <= 0:
            return []
        now = time.perf_counter()
        kept, removed = self._table.evict(count, True if keep is None else keep, now)
        if self.record_events:
            self._events.removed_hashes(removed)
        return [Lease(self, lease_id, slot, meta, LeaseKind.READ, now) for lease_id, slot, meta in kept]

    def drop_lru(self, count: int) -> int:
        """Up to ``count`` least recently used unleased blocks removed (BlockRemoved each) and their slots
        freed; returns how many."""
        if count <= 0:
            return 0
        _, removed = self._table.evict(count, None, 0.0)
        if self.record_events:
            self._events.removed_hashes(removed)
        return len(removed)

    def remove(self, block_hash: int) -> bool:
        """Drop a cached block (BlockRemoved); its slot is freed once no lease holds it."""
        if not self._table.remove(block_hash):
            return False
        if self.record_events:
            self._events.removed_hashes((block_hash,))
        return True

    # ---------------------------------------------------------------- events and lifetime

    def take_events(self) -> list[KVEvent]:
        return self._events.take()

    def discard_events(self) -> int:
        """Forget the events recorded since the last take (the owner publishes nowhere)."""
        return self._events.discard()

    def snapshot_events(self) -> list[BlockStored]:
        """Every cached block as a BlockStored (medium CPU), least recently used first. Safe from another thread."""
        return self._events.snapshot(self._table.cached_metas())

    def close(self) -> None:
        """Unmap the arena (and unlink it if owned). Leases still held become meaningless."""
        self._table.drop_leases()
        self.slots.close()

    def check_invariants(self) -> None:
        """Assert the slot states of :mod:`kvstore.tiers.arena`; raises AssertionError naming the fault."""
        self._table.check()
