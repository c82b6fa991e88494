"""The CPU arena in Python objects: :class:`PyCpuArena`, for installs without a C compiler.

It keeps the books :class:`~kvstore.tiers.cpu_arena.CpuArena` keeps in C
arrays, with the same answers (the tests drive the two in lockstep and
compare every one); the slot states and the guarantees are in
:mod:`kvstore.tiers.arena`.

Data structures
---------------
- ``slots``: a :class:`~kvstore.tiers.shared_memory.SharedSlots` arena, one block per slot.
- ``_index``: external block hash -> slot, an ``OrderedDict`` in LRU order
  (least recently used first), so a hit moves a block to the tail in O(1)
  and eviction pops from the head.
- ``_meta[slot]``: the block whose bytes the slot holds or is receiving
  (hash, parent hash, tokens: the collision guard); ``_leases[slot]``: how
  many leases hold it; ``_free``: slots holding nothing, oldest freed first.
- ``_writing``: hash -> slot for blocks reserved but not committed, so two
  writers never fill two slots with one block.
- ``_held``: lease id -> :class:`~kvstore.tiers.arena.Lease`.

The arena records BlockStored / BlockRemoved (medium CPU) for its owner to
publish (:meth:`take_events`). Mutations run on one thread (the tier's
event loop); :meth:`snapshot_events` may run on another (the publisher's),
so index mutations and the snapshot copy hold ``_lock``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvstore.events import BlockStored, KVEvent, Medium
from kvstore.tiers.arena import Lease, LeaseKind, SlotsQueries
from kvstore.tiers.blocks import BlockMeta, SlotGrant
from kvstore.tiers.errors import LeaseError
from kvstore.tiers.shared_memory import SharedSlots
from kvstore.tiers.tier_events import MediumEvents


class PyCpuArena(SlotsQueries):
    """Blocks in shared-memory slots, LRU-evicted, with leases that pin slots during copies (an
    :class:`~kvstore.tiers.arena.Arena`). Not thread-safe except :meth:`snapshot_events`."""

    def __init__(self, slots: SharedSlots, *, block_size: int) -> None:
        self.slots = slots
        self.block_size = block_size
        self._index: OrderedDict[int, int] = OrderedDict()
        self._meta: list[BlockMeta | None] = [None] * slots.num_slots
        self._leases = [0] * slots.num_slots
        self._free: deque[int] = deque(range(slots.num_slots))
        self._num_leased = 0  # slots with at least one lease
        self._writing: dict[int, int] = {}
        self._held: dict[int, Lease] = {}
        self._next_lease = 1
        self._events = MediumEvents(Medium.CPU, block_size)
        self._lock = threading.Lock()
        self.record_events = True
        self.num_evictions = 0
        self.num_collisions = 0

    # ----------------------------------------------------------------- queries

    @property
    def native(self) -> bool:
        """Whether the books are kept in C (never, here)."""
        return False

    @property
    def num_blocks(self) -> int:
        """Cached (committed) blocks."""
        return len(self._index)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_leased_slots(self) -> int:
        """Slots pinned by a lease: the rest are free or evictable."""
        return self._num_leased

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def held_among(self, block_hashes: Sequence[int], *, writing: bool = False) -> set[int]:
        """Which of ``block_hashes`` are cached here (``writing``: or being written), by set operations."""
        held = self._index.keys() & block_hashes
        return held | (self._writing.keys() & block_hashes) if writing else held

    def is_writing(self, block_hash: int) -> bool:
        return block_hash in self._writing

    def slot_of(self, block_hash: int) -> int | None:
        """The slot of the cached block ``block_hash``, or None."""
        return self._index.get(block_hash)

    def lru_hashes(self) -> list[int]:
        """Cached block hashes, least recently used (next to be evicted) first."""
        return list(self._index)

    def holds(self, lease_id: int) -> bool:
        return lease_id in self._held

    def lease_ids(self) -> list[int]:
        """Every live lease's id, ascending."""
        return sorted(self._held)

    def lease(self, lease_id: int) -> Lease:
        """The live lease ``lease_id``; raises LeaseError if it is unknown or released."""
        try:
            return self._held[lease_id]
        except KeyError:
            raise LeaseError(f"lease {lease_id} is unknown or already released") from None

    # ---------------------------------------------------------------- mutation

    def reserve(self, meta: BlockMeta) -> Lease | None:
        """A write lease on a free slot for ``meta``'s bytes; None when no slot is free or
        the block is cached or being written already. Evict first to make room."""
        if meta.block_hash in self._index or meta.block_hash in self._writing or not self._free:
            return None
        slot = self._free.popleft()
        self._meta[slot] = meta
        self._writing[meta.block_hash] = slot
        return self._grant(slot, meta, LeaseKind.WRITE)

    def commit_many(self, lease_ids: Sequence[int]) -> list[Lease]:
        """:meth:`commit` each of ``lease_ids``, in order; returns their leases.

        Raises LeaseError, changing nothing, if any is not a live write lease or one is named twice.
        """
        leases = self._distinct(lease_ids)
        for lease in leases:
            if lease.kind is not LeaseKind.WRITE:
                raise LeaseError(f"lease {lease.lease_id} is a read lease: release it, only write leases commit")
        held, writing, index, pins = self._held, self._writing, self._index, self._leases
        unpinned = 0
        with self._lock:
            for lease in leases:
                del held[lease.lease_id]
                slot = lease.slot
                pins[slot] -= 1
                if pins[slot] == 0:
                    unpinned += 1
                del writing[lease.meta.block_hash]
                index[lease.meta.block_hash] = slot
        self._num_leased -= unpinned
        self._events.stored_many([lease.meta for lease in leases])
        return leases

    def release_many(self, lease_ids: Sequence[int]) -> list[Lease]:
        """:meth:`release` each of ``lease_ids``; returns their leases.

        Raises LeaseError, changing nothing, if any is unknown or released, or one is named twice.
        """
        leases = self._distinct(lease_ids)
        held, pins, index = self._held, self._leases, self._index
        for lease in leases:
            del held[lease.lease_id]
            slot = lease.slot
            pins[slot] -= 1
            if pins[slot]:
                continue
            self._num_leased -= 1
            if lease.kind is LeaseKind.WRITE:
                del self._writing[lease.meta.block_hash]
                self._free_slot(slot)
            elif index.get(lease.meta.block_hash) != slot:
                self._free_slot(slot)
        return leases

    # -------------------------------------------------- the lease protocol's batches (see arena.Arena)

    def reserve_grants(
        self, metas: Sequence[BlockMeta], now: float, *, evict: bool
    ) -> tuple[list[SlotGrant | None], int, int]:
        index, writing = self._index, self._writing
        duplicates = 0
        wanted: list[BlockMeta] = []
        positions: list[int] = []
        seen: set[int] = set()
        for position, meta in enumerate(metas):
            block_hash = meta.block_hash
            if block_hash in index:
                self.touch(block_hash)  # a repeated spill: the block stays, most recently used
                duplicates += 1
            elif block_hash in writing or block_hash in seen:
                duplicates += 1
            else:
                seen.add(block_hash)
                wanted.append(meta)
                positions.append(position)
        if evict and len(wanted) > len(self._free):
            self.drop_lru(len(wanted) - len(self._free))
        # The free slots taken in ascending order, so that a batch lands in as few runs of neighbouring slots as
        # the free list allows (a run is copied as one span); blocks past them get none.
        free = self._free
        slots = sorted(free.popleft() for _ in range(min(len(wanted), len(free))))
        grants: list[SlotGrant | None] = [None] * len(metas)
        slot_meta, pins, held, write = self._meta, self._leases, self._held, LeaseKind.WRITE
        lease_id = self._next_lease
        for position, meta, slot in zip(positions, wanted, slots, strict=False):
            slot_meta[slot] = meta
            writing[meta.block_hash] = slot
            held[lease_id] = Lease(self, lease_id, slot, meta, write, now)
            pins[slot] = 1  # free slots hold no lease: each grant pins a slot that was unpinned
            grants[position] = SlotGrant(lease_id, slot, meta.block_hash, Medium.CPU)
            lease_id += 1
        self._num_leased += len(slots)
        self._next_lease = lease_id
        return grants, duplicates, len(wanted) - len(slots)

    def commit_ids(
        self, lease_ids: Sequence[int], *, metas: bool = False
    ) -> tuple[int, float | None, list[BlockMeta] | None]:
        leases = self.commit_many(lease_ids)
        starts = [lease.granted_at for lease in leases if lease.granted_at is not None]
        return len(leases), min(starts, default=None), [lease.meta for lease in leases] if metas else None

    def release_ids(self, lease_ids: Sequence[int]) -> tuple[int, float | None]:
        reads = [lease for lease in self.release_many(lease_ids) if lease.kind is LeaseKind.READ]
        starts = [lease.granted_at for lease in reads if lease.granted_at is not None]
        return len(reads), min(starts, default=None)

    def acquire_prefix_grants(self, metas: Sequence[BlockMeta], now: float) -> list[SlotGrant]:
        index, slot_meta = self._index, self._meta
        found: list[tuple[int, BlockMeta]] = []  # (slot, stored meta)
        for meta in metas:
            slot = index.get(meta.block_hash)
            if slot is None:
                break
            stored = slot_meta[slot]
            assert stored is not None
            if stored.token_ids != meta.token_ids or stored.parent_hash != meta.parent_hash:
                break  # a collision: acquire() of that block counts it, once
            found.append((slot, stored))
        with self._lock:
            move = self._index.move_to_end
            for _, stored in found:
                move(stored.block_hash)
        return [
            SlotGrant(self._grant(slot, stored, LeaseKind.READ, now).lease_id, slot, stored.block_hash, Medium.CPU)
            for slot, stored in found
        ]

    def regrant(self, lease_ids: Sequence[int], now: float) -> None:
        for lease_id in lease_ids:
            lease = self._held.get(lease_id)
            if lease is not None:
                lease.granted_at = now

    # ---------------------------------------------------------------- one by one

    def commit(self, lease_id: int) -> None:
        """Publish a written slot as the most recently used block; ends the write lease."""
        self.commit_many([lease_id])

    def acquire(self, meta: BlockMeta) -> Lease | None:
        """A read lease on the cached block ``meta`` (now most recently used), or None on a miss.

        A cached block with ``meta``'s hash but other tokens or parent is a
        hash collision: counted, and a miss.
        """
        slot = self._index.get(meta.block_hash)
        if slot is None:
            return None
        stored = self._meta[slot]
        assert stored is not None
        if stored.token_ids != meta.token_ids or stored.parent_hash != meta.parent_hash:
            self.num_collisions += 1
            return None
        with self._lock:
            self._index.move_to_end(meta.block_hash)
        return self._grant(slot, stored, LeaseKind.READ)

    def touch(self, block_hash: int) -> None:
        """Mark a cached block most recently used (a repeated spill of it, say)."""
        if block_hash in self._index:
            with self._lock:
                self._index.move_to_end(block_hash)

    def release(self, lease_id: int) -> None:
        """End a lease. An uncommitted write lease abandons its slot; the last lease of a
        detached slot frees it."""
        self.release_many([lease_id])

    def evict_lru(self, count: int, keep: Callable[[int], bool] | None = None) -> list[Lease]:
        """See :meth:`kvstore.tiers.arena.Arena.evict_lru`."""
        if count <= 0:
            return []
        victims: list[int] = []
        leased = self._leases
        for block_hash, slot in self._index.items():
            if len(victims) == count:
                break
            if leased[slot] == 0:
                victims.append(block_hash)
        kept = [keep is None or keep(block_hash) for block_hash in victims]
        leases = []
        dropped: list[int] = []
        with self._lock:
            for block_hash, keeping in zip(victims, kept, strict=True):
                slot = self._index.pop(block_hash)
                self._events.removed_hashes((block_hash,))
                meta = self._meta[slot]
                assert meta is not None
                if keeping:
                    leases.append(self._grant(slot, meta, LeaseKind.READ))
                else:
                    dropped.append(slot)
        for slot in dropped:
            self._free_slot(slot)
        self.num_evictions += len(victims)
        return leases

    def drop_lru(self, count: int) -> int:
        """``evict_lru(count, keep=lambda block_hash: False)`` in one pass: up to ``count`` least recently
        used unleased blocks removed (BlockRemoved each) and their slots freed; returns how many."""
        if count <= 0:
            return 0
        victims: list[int] = []
        leased = self._leases
        for slot in self._index.values():
            if len(victims) == count:
                break
            if leased[slot] == 0:
                victims.append(slot)
        if not victims:
            return 0
        slot_meta = self._meta
        metas = [slot_meta[slot] for slot in victims]
        with self._lock:
            pop = self._index.pop
            for meta in metas:
                assert meta is not None
                pop(meta.block_hash)
        self._events.removed_many(metas)  # type: ignore[arg-type]  # not None: asserted above
        for slot in victims:
            slot_meta[slot] = None  # unleased (checked above): free at once
        self._free.extend(victims)
        self.num_evictions += len(victims)
        return len(victims)

    def remove(self, block_hash: int) -> bool:
        """Drop a cached block (BlockRemoved); its slot is freed once no lease holds it."""
        if block_hash not in self._index:
            return False
        with self._lock:
            slot = self._index.pop(block_hash)
        self._events.removed_hashes((block_hash,))
        if self._leases[slot] == 0:
            self._free_slot(slot)
        return True

    def take_events(self) -> list[KVEvent]:
        if not self.record_events:
            self._events.discard()
            return []
        return self._events.take()

    def discard_events(self) -> int:
        """Forget the events recorded since the last take (the owner publishes nowhere)."""
        return self._events.discard()

    def snapshot_events(self) -> list[BlockStored]:
        """Every cached block as a BlockStored (medium CPU). Safe from another thread."""
        with self._lock:
            # A cached slot's meta only changes after its index entry is popped (under the lock).
            metas = [self._meta[slot] for slot in self._index.values()]
        return self._events.snapshot(meta for meta in metas if meta is not None)

    def close(self) -> None:
        """Unmap the arena (and unlink it if owned). Leases still held become meaningless."""
        self._held.clear()
        self.slots.close()

    # ---------------------------------------------------------------- internal

    def _distinct(self, lease_ids: Sequence[int]) -> list[Lease]:
        """The live leases ``lease_ids``; raises LeaseError for an unknown or ended one, or one named twice."""
        held = self._held
        lease_ids = list(lease_ids)  # read once: a generator would look like ids named twice
        try:
            leases = [held[lease_id] for lease_id in lease_ids]
        except (KeyError, TypeError):
            leases = [self.lease(lease_id) for lease_id in lease_ids]  # names the bad id
        if len(set(lease_ids)) != len(leases):
            raise LeaseError("a lease id is listed twice")
        return leases

    def _grant(self, slot: int, meta: BlockMeta, kind: LeaseKind, now: float | None = None) -> Lease:
        lease = Lease(self, self._next_lease, slot, meta, kind, time.perf_counter() if now is None else now)
        self._next_lease += 1
        self._held[lease.lease_id] = lease
        self._leases[slot] += 1
        if self._leases[slot] == 1:
            self._num_leased += 1
        return lease

    def _free_slot(self, slot: int) -> None:
        assert self._leases[slot] == 0, f"slot {slot} freed with {self._leases[slot]} leases"
        self._meta[slot] = None
        self._free.append(slot)

    def check_invariants(self) -> None:
        """Assert the slot states of the module docstring; raises AssertionError naming the fault."""
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is twice in the free list"
        indexed = {slot: block_hash for block_hash, slot in self._index.items()}
        assert len(indexed) == len(self._index), "two hashes share a slot"
        writing = {slot: block_hash for block_hash, slot in self._writing.items()}
        held_per_slot = [0] * self.num_slots
        for lease_id, lease in self._held.items():
            assert lease.lease_id == lease_id
            held_per_slot[lease.slot] += 1
            if lease.kind is LeaseKind.WRITE:
                assert writing.get(lease.slot) == lease.meta.block_hash, f"{lease} is not in the writing map"
        assert held_per_slot == self._leases, "lease counts disagree with the leases held"
        assert self._num_leased == sum(1 for n in self._leases if n), "leased-slot count is off"
        for slot in range(self.num_slots):
            meta = self._meta[slot]
            if slot in free:
                assert meta is None and self._leases[slot] == 0, f"free slot {slot} is in use"
                assert slot not in indexed and slot not in writing
                continue
            assert meta is not None, f"slot {slot} is neither free nor holding a block"
            if slot in indexed:
                assert indexed[slot] == meta.block_hash, f"slot {slot} is indexed under another hash"
                assert slot not in writing
            elif slot in writing:
                assert self._leases[slot] == 1, f"slot {slot} being written has {self._leases[slot]} leases"
            else:
                assert self._leases[slot] >= 1, f"detached slot {slot} has no lease: it leaked"
            assert len(meta.token_ids) == self.block_size, f"slot {slot} holds a block of the wrong size"
