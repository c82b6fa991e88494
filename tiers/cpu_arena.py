"""The CPU tier: an LRU cache of blocks in the node's shared-memory slots, with leases.

Data structures
---------------
- ``slots``: a :class:`~kvstore.tiers.shared_memory.SharedSlots` arena, one block per slot.
- ``_index``: external block hash -> slot, an ``OrderedDict`` in LRU order
  (least recently used first), so a hit moves a block to the tail in O(1)
  and eviction pops from the head.
- ``_meta[slot]``: the block whose bytes the slot holds or is receiving
  (hash, parent hash, tokens: the collision guard); ``_leases[slot]``: how
  many leases hold it; ``_free``: slots holding nothing.
- ``_writing``: hash -> slot for blocks reserved but not committed, so two
  writers never fill two slots with one block.

Slot states (checked by :meth:`CpuArena.check_invariants`)
----------------------------------------------------------
========  ===============  ===========  ==========================================
state     in ``_free``     in index     leases
========  ===============  ===========  ==========================================
free      yes              no           0; no meta
written   no               no           exactly 1 write lease (reserve -> commit)
cached    no               yes          any number of read leases
detached  no               no           >= 1 read lease (evicted or removed while
                                        read, e.g. drained to disk); freed by the
                                        last release
========  ===============  ===========  ==========================================

Batches: a worker's spill or promotion names tens to hundreds of blocks,
and on small blocks the per-block Python costs as much as the copy. The
batch operations (:meth:`CpuArena.reserve_many`, :meth:`~CpuArena.match_prefix`
then :meth:`~CpuArena.lease_matched`, :meth:`~CpuArena.commit_many`,
:meth:`~CpuArena.release_many`, :meth:`~CpuArena.drop_lru`,
:meth:`~CpuArena.held_among`) keep every per-block guarantee -- one lease
per slot, one event per block, a batch naming a bad lease changes nothing --
in one pass over the batch, with set operations on the index where they
can, and record events unbuilt (:mod:`~kvstore.tiers.tier_events`).
Where the compiled kernel is built, the inner loops of those passes run in C
(``tiers/_books.c``, in ``kvstore.tiers._copyrows``) over the same objects,
and leases are built there with one allocation each: on 16 KiB blocks the
Python loops cost about as much as the copy. The Python loops stay for
installs without a C compiler; the tests drive both in lockstep and compare
every answer and every piece of state.

A leased slot is never evicted and never reused: that is what makes a copy
into or out of a slot safe while the index changes around it. Eviction
takes the least recently used *unleased* cached block.

The arena records BlockStored / BlockRemoved (medium CPU) for its owner to
publish (:meth:`take_events`). Mutations run on one thread (the tier's
event loop); :meth:`snapshot_events` may run on another (the publisher's),
so index mutations and the snapshot copy hold ``_lock``.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from kvstore.events import BlockStored, KVEvent, Medium
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.errors import LeaseError
from kvstore.tiers.shared_memory import SharedSlots
from kvstore.tiers.tier_events import MediumEvents

_books: ModuleType | None
try:  # the batch loops in C (tiers/_books.c); without a C compiler the Python loops below do the same
    from kvstore.tiers import _copyrows as _books
except ImportError:
    _books = None

if TYPE_CHECKING:

    class _LeaseFields:
        _arena: CpuArena
        lease_id: int
        slot: int
        meta: BlockMeta
        kind: LeaseKind
        granted_at: float | None

elif _books is not None:
    _LeaseFields = _books.LeaseCore  # built by the C loops with one allocation, no __init__ call
else:

    class _LeaseFields:
        __slots__ = ("_arena", "granted_at", "kind", "lease_id", "meta", "slot")


class LeaseKind(enum.Enum):
    WRITE = "write"  # filling a reserved slot; commit() publishes it
    READ = "read"  # copying a cached (or detached) block out


class Lease(_LeaseFields):
    """A hold on one slot. Release exactly once (or use ``with``); a write lease may be committed instead."""

    __slots__ = ()

    def __init__(self, arena: CpuArena, lease_id: int, slot: int, meta: BlockMeta, kind: LeaseKind) -> None:
        self._arena = arena
        self.lease_id = lease_id
        self.slot = slot
        self.meta = meta
        self.kind = kind
        self.granted_at = None  # set when the lease is handed out (LeaseBook)

    def release(self) -> None:
        self._arena.release(self.lease_id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._arena.holds(self.lease_id):
            self._arena.release(self.lease_id)

    def __repr__(self) -> str:
        return f"Lease({self.lease_id}, {self.kind.value}, slot={self.slot}, hash={self.meta.block_hash:#x})"


class CpuArena:
    """Blocks in shared-memory slots, LRU-evicted, with leases that pin slots during copies.

    Not thread-safe except :meth:`snapshot_events` (see the module docstring).
    """

    # The batch loops in C where the kernel is built (None: the Python loops; the tests run both).
    _native: ModuleType | None = _books

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
        self.num_evictions = 0
        self.num_collisions = 0

    # ----------------------------------------------------------------- queries

    @property
    def native(self) -> ModuleType | None:
        """The compiled module whose batch loops this arena runs (``kvstore.tiers._copyrows``), or None."""
        return self._native

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.slots.slot_bytes

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

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.slots.slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.slots.num_slots * self.slots.slot_bytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def held_among(self, block_hashes: Sequence[int], *, writing: bool = False) -> set[int]:
        """Which of ``block_hashes`` are cached here (``writing``: or being written), by set operations."""
        held = self._index.keys() & block_hashes
        return held | (self._writing.keys() & block_hashes) if writing else held

    def is_writing(self, block_hash: int) -> bool:
        return block_hash in self._writing

    def lru_hashes(self) -> list[int]:
        """Cached block hashes, least recently used (next to be evicted) first."""
        return list(self._index)

    def holds(self, lease_id: int) -> bool:
        return lease_id in self._held

    def lease(self, lease_id: int) -> Lease:
        """The live lease ``lease_id``; raises LeaseError if it is unknown or released."""
        try:
            return self._held[lease_id]
        except KeyError:
            raise LeaseError(f"lease {lease_id} is unknown or already released") from None

    def view(self, slot: int) -> memoryview:
        return self.slots.view(slot)

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

    def reserve_many(self, metas: Sequence[BlockMeta]) -> list[Lease | None]:
        """:meth:`reserve` for each of ``metas`` (None where it gives None), the free slots taken in
        ascending order so that a batch lands in as few runs of neighbouring slots as the free list allows
        (a run is copied as one span)."""
        index, writing, free = self._index, self._writing, self._free
        wanted = [meta for meta in metas if meta.block_hash not in index and meta.block_hash not in writing]
        if len({meta.block_hash for meta in wanted}) != len(wanted):  # one hash twice: the later is a duplicate
            return [self.reserve(meta) for meta in metas]
        slots = sorted(free.popleft() for _ in range(min(len(wanted), len(free))))
        taken: dict[int, int] = dict(zip((meta.block_hash for meta in wanted), slots, strict=False))
        native = self._native
        if native is not None and len(taken) == len(metas):  # every block new and given a slot: the common case
            pairs = list(zip(slots, metas, strict=True))  # taken's order: the slots ascending, in the batch's order
            try:  # it checks every pair before it changes anything
                granted, _ = native.lease_many(
                    Lease, self, self._held, self._leases, self._meta, None, self._next_lease, pairs, LeaseKind.WRITE
                )
            except BaseException:
                free.extendleft(reversed(slots))  # the slots go back where they were taken from
                raise
            writing.update(taken)
            self._num_leased += len(granted)  # free slots held no lease
            self._next_lease += len(granted)
            return granted
        leases: list[Lease | None] = []
        # Free slots hold no lease: each grant below pins a slot that was unpinned (as _grant would).
        slot_meta, pins, held, write = self._meta, self._leases, self._held, LeaseKind.WRITE
        lease_id = self._next_lease
        for meta in metas:
            slot = taken.pop(meta.block_hash, None)
            if slot is None:
                leases.append(None)
                continue
            slot_meta[slot] = meta
            writing[meta.block_hash] = slot
            lease = held[lease_id] = Lease(self, lease_id, slot, meta, write)
            pins[slot] = 1
            lease_id += 1
            leases.append(lease)
        self._num_leased += lease_id - self._next_lease
        self._next_lease = lease_id
        return leases

    def commit_many(self, lease_ids: Sequence[int]) -> list[Lease]:
        """:meth:`commit` each of ``lease_ids``, in order; returns their leases.

        Raises LeaseError, changing nothing, if any is not a live write lease or one is named twice.
        """
        native = self._native
        if native is not None:
            with self._lock:
                done = native.commit_many(
                    self._held, self._leases, self._writing, self._index, lease_ids, LeaseKind.WRITE
                )
            if done is not None:  # None: one id failed the checks, nothing changed; the loop below names it
                committed, unpinned = done
                self._num_leased -= unpinned
                self._events.stored_many([lease.meta for lease in committed])
                return committed
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

    def acquire_prefix(self, metas: Sequence[BlockMeta]) -> list[Lease]:
        """:meth:`acquire` the longest prefix of ``metas`` cached here; one read lease per block of it.

        Stops before the first block that is not a clean hit: a miss, or a hash collision, which is
        left to the caller's :meth:`acquire` of that block to count (so it is counted once).
        """
        return self.lease_matched(self.match_prefix(metas))

    def match_prefix(self, metas: Sequence[BlockMeta]) -> list[tuple[int, BlockMeta]]:
        """(slot, stored meta) of the longest prefix of ``metas`` cached here with equal tokens and
        parent; changes nothing (:meth:`lease_matched` leases them)."""
        index, slot_meta = self._index, self._meta
        if self._native is not None:
            return self._native.match_prefix(index, slot_meta, metas)
        found: list[tuple[int, BlockMeta]] = []
        for meta in metas:
            slot = index.get(meta.block_hash)
            if slot is None:
                break
            stored = slot_meta[slot]
            assert stored is not None
            if stored.token_ids != meta.token_ids or stored.parent_hash != meta.parent_hash:
                break
            found.append((slot, stored))
        return found

    def lease_matched(self, found: Sequence[tuple[int, BlockMeta]]) -> list[Lease]:
        """Read leases on blocks :meth:`match_prefix` just found (nothing changed in between), now
        most recently used."""
        if not found:
            return []
        native = self._native
        if native is not None:
            with self._lock:  # lease_many moves each block to the index's end
                leases, pinned = native.lease_many(
                    Lease, self, self._held, self._leases, None, self._index, self._next_lease, found, LeaseKind.READ
                )
            self._next_lease += len(leases)
            self._num_leased += pinned
            return leases
        with self._lock:
            move = self._index.move_to_end
            for _, stored in found:
                move(stored.block_hash)
        # _grant inlined for the batch: a slot's first lease pins it.
        held, pins, read = self._held, self._leases, LeaseKind.READ
        lease_id = self._next_lease
        leases = []
        pinned = 0
        for slot, stored in found:
            lease = held[lease_id] = Lease(self, lease_id, slot, stored, read)
            leases.append(lease)
            lease_id += 1
            pins[slot] += 1
            if pins[slot] == 1:
                pinned += 1
        self._next_lease = lease_id
        self._num_leased += pinned
        return leases

    def release_many(self, lease_ids: Sequence[int]) -> list[Lease]:
        """:meth:`release` each of ``lease_ids``; returns their leases.

        Raises LeaseError, changing nothing, if any is unknown or released, or one is named twice.
        """
        native = self._native
        if native is not None:
            done = native.release_many(
                self._held, self._leases, self._writing, self._index, self._meta, lease_ids, LeaseKind.WRITE
            )
            if done is not None:  # None: one id failed the checks, nothing changed; the loop below names it
                released, unpinned, freed = done
                self._num_leased -= unpinned
                self._free.extend(freed)
                return released
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
        """Detach up to ``count`` least recently used unleased blocks (BlockRemoved each).

        A block for which ``keep(hash)`` is true (all of them without ``keep``) comes back with a
        read lease: its bytes stay in the slot (to be written to disk, say) until that lease is
        released, which frees it. The others' slots are freed at once.
        """
        victims: list[int] = []
        leased = self._leases
        for block_hash, slot in self._index.items():
            if len(victims) == count:
                break
            if leased[slot] == 0:
                victims.append(block_hash)
        leases = []
        dropped: list[int] = []
        with self._lock:
            for block_hash in victims:
                if keep is None or keep(block_hash):
                    leases.append(self._detach(block_hash, locked=True))
                else:
                    dropped.append(self._index.pop(block_hash))
        for slot in dropped:
            meta = self._meta[slot]
            assert meta is not None
            self._events.removed(meta)
            self._free_slot(slot)
        self.num_evictions += len(victims)
        return leases

    def drop_lru(self, count: int) -> int:
        """``evict_lru(count, keep=lambda block_hash: False)`` in one pass: up to ``count`` least recently
        used unleased blocks removed (BlockRemoved each) and their slots freed; returns how many."""
        if count <= 0:
            return 0
        if self._native is not None:
            with self._lock:
                freed, dropped = self._native.drop_lru(self._index, self._leases, self._meta, count)
            self._events.removed_many(dropped)
            self._free.extend(freed)
            self.num_evictions += len(freed)
            return len(freed)
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
        self._detach(block_hash).release()
        return True

    def take_events(self) -> list[KVEvent]:
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
        try:
            leases = [held[lease_id] for lease_id in lease_ids]
        except (KeyError, TypeError):
            leases = [self.lease(lease_id) for lease_id in lease_ids]  # names the bad id
        if len(set(lease_ids)) != len(leases):
            raise LeaseError("a lease id is listed twice")
        return leases

    def _grant(self, slot: int, meta: BlockMeta, kind: LeaseKind) -> Lease:
        lease = Lease(self, self._next_lease, slot, meta, kind)
        self._next_lease += 1
        self._held[lease.lease_id] = lease
        self._leases[slot] += 1
        if self._leases[slot] == 1:
            self._num_leased += 1
        return lease

    def _detach(self, block_hash: int, *, locked: bool = False) -> Lease:
        """Take a block out of the index, returning a read lease that keeps its slot (``locked``: the
        caller holds ``_lock``)."""
        if locked:
            slot = self._index.pop(block_hash)
        else:
            with self._lock:
                slot = self._index.pop(block_hash)
        meta = self._meta[slot]
        assert meta is not None
        self._events.removed(meta)
        return self._grant(slot, meta, LeaseKind.READ)

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
