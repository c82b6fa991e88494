"""What the store asks of a CPU arena, and the leases it hands out one by one.

Two arenas keep the same books: :class:`~kvstore.tiers.cpu_arena.CpuArena`
in C arrays (``tiers/_slots.c``, built at install), and
:class:`~kvstore.tiers.cpu_arena_py.PyCpuArena` in Python objects, for
installs without a C compiler. :func:`~kvstore.tiers.cpu_arena.new_arena`
picks the first that is built; the tests drive both in lockstep and compare
every answer.

Slot states (each arena's ``check_invariants`` asserts them):

========  ============  ========  ==========================================
state     free list     index     leases
========  ============  ========  ==========================================
free      yes           no        0
written   no            yes [1]_  exactly 1 write lease (reserve -> commit)
cached    no            yes       any number of read leases
detached  no            no        >= 1 read lease (evicted or removed while
                                  read, e.g. drained to disk); freed by the
                                  last release
========  ============  ========  ==========================================

.. [1] as being written: a lookup does not find it, a second reserve of the
   same block is refused.

A leased slot is never evicted and never reused: that is what makes a copy
into or out of a slot safe while the index changes around it. Eviction takes
the least recently used *unleased* cached block.

The lease protocol's hot path works in batches and hands out
:class:`~kvstore.tiers.blocks.SlotGrant` tuples directly
(``reserve_grants``, ``commit_ids``, ``release_ids``,
``acquire_prefix_grants``); the disk tier's staging and the tests hold
:class:`Lease` objects, made one at a time.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.events import BlockStored, KVEvent
    from kvstore.tiers.blocks import BlockMeta, SlotGrant
    from kvstore.tiers.shared_memory import SharedSlots


class LeaseKind(enum.Enum):
    WRITE = "write"  # filling a reserved slot; commit() publishes it
    READ = "read"  # copying a cached (or detached) block out


class Lease:
    """A hold on one slot. Release exactly once (or use ``with``); a write lease may be committed instead."""

    __slots__ = ("_arena", "granted_at", "kind", "lease_id", "meta", "slot")

    def __init__(
        self,
        arena: Arena,
        lease_id: int,
        slot: int,
        meta: BlockMeta,
        kind: LeaseKind,
        granted_at: float | None = None,
    ) -> None:
        self._arena = arena
        self.lease_id = lease_id
        self.slot = slot
        self.meta = meta
        self.kind = kind
        self.granted_at = granted_at  # when the lease was handed out (None: not yet)

    def release(self) -> None:
        self._arena.release(self.lease_id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._arena.holds(self.lease_id):
            self._arena.release(self.lease_id)

    def __repr__(self) -> str:
        return f"Lease({self.lease_id}, {self.kind.value}, slot={self.slot}, hash={self.meta.block_hash:#x})"


class SlotsQueries:
    """What both arenas answer from their ``slots`` alone (and ``num_blocks``, which each keeps its way)."""

    slots: SharedSlots

    @property
    def num_blocks(self) -> int:
        raise NotImplementedError

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.slots.slot_bytes

    @property
    def used_bytes(self) -> int:
        return self.num_blocks * self.slots.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.slots.num_slots * self.slots.slot_bytes

    def view(self, slot: int) -> memoryview:
        return self.slots.view(slot)


class Arena(Protocol):
    """A CPU arena: blocks in shared-memory slots, LRU-evicted, with leases that pin slots during copies.

    Driven from one thread (the tier's event loop), but for :meth:`snapshot_events`, which may run on the
    event publisher's.
    """

    slots: SharedSlots
    block_size: int
    record_events: bool  # False: no event is recorded (nobody could read it)

    @property
    def num_slots(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_slots(self) -> int: ...
    @property
    def num_leased_slots(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...
    @property
    def num_collisions(self) -> int: ...
    @property
    def native(self) -> bool: ...

    def __contains__(self, block_hash: int) -> bool: ...
    def held_among(self, block_hashes: Sequence[int], *, writing: bool = False) -> set[int]: ...
    def is_writing(self, block_hash: int) -> bool: ...
    def slot_of(self, block_hash: int) -> int | None:
        """The slot of the cached block ``block_hash``, or None."""
        ...

    def lru_hashes(self) -> list[int]: ...
    def holds(self, lease_id: int) -> bool: ...
    def lease_ids(self) -> list[int]:
        """Every live lease's id, ascending."""
        ...

    def lease(self, lease_id: int) -> Lease: ...
    def view(self, slot: int) -> memoryview: ...

    # -- the lease protocol's batches

    def reserve_grants(
        self, metas: Sequence[BlockMeta], now: float, *, evict: bool
    ) -> tuple[list[SlotGrant | None], int, int]:
        """Write grants (granted at ``now``) on free slots for ``metas``, in order: (grants, duplicates, no_slot).

        None for a block cached already (it becomes the most recently used), being written, or named
        earlier in the batch -- counted in ``duplicates`` -- and for one no slot was left for (``no_slot``).
        ``evict``: first drop as many least recently used unleased blocks as the batch needs. Slots are
        handed out in ascending order (a batch lands in as few runs as the free list allows).
        """
        ...

    def commit_ids(
        self, lease_ids: Sequence[int], *, metas: bool = False
    ) -> tuple[int, float | None, list[BlockMeta] | None]:
        """Publish written slots as cached blocks, most recently used: (count, earliest grant time, metas).

        ``metas``: also return the blocks committed, in order. Raises LeaseError, changing nothing, if any
        id is not a live write lease or one is named twice.
        """
        ...

    def release_ids(self, lease_ids: Sequence[int]) -> tuple[int, float | None]:
        """End leases: (read leases ended, their earliest grant time). Raises LeaseError, changing nothing,
        if any id is unknown or ended or named twice."""
        ...

    def acquire_prefix_grants(self, metas: Sequence[BlockMeta], now: float) -> list[SlotGrant]:
        """Read grants on the longest prefix of ``metas`` cached with equal tokens and parent (each now most
        recently used). Stops before a miss or a collision, which it does not count."""
        ...

    def regrant(self, lease_ids: Sequence[int], now: float) -> None:
        """The leases handed out at ``now`` (their offload time counts from it)."""
        ...

    # -- one by one

    def reserve(self, meta: BlockMeta) -> Lease | None: ...
    def acquire(self, meta: BlockMeta) -> Lease | None: ...
    def commit(self, lease_id: int) -> None: ...
    def release(self, lease_id: int) -> None: ...
    def touch(self, block_hash: int) -> None: ...
    def evict_lru(self, count: int, keep: Callable[[int], bool] | None = None) -> list[Lease]:
        """Detach up to ``count`` least recently used unleased blocks (BlockRemoved each, in LRU order).

        A block for which ``keep(hash)`` is true (all of them without ``keep``) comes back with a read
        lease: its bytes stay in the slot (to be written to disk, say) until that lease is released, which
        frees it. The others' slots are freed at once.
        """
        ...

    def drop_lru(self, count: int) -> int: ...
    def remove(self, block_hash: int) -> bool: ...

    # -- events and lifetime

    def take_events(self) -> list[KVEvent]: ...
    def discard_events(self) -> int: ...
    def snapshot_events(self) -> list[BlockStored]: ...
    def close(self) -> None: ...
    def check_invariants(self) -> None: ...
