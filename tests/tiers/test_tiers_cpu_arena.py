"""CpuArena: exact LRU order, leases that pin slots, collisions, events; a state machine for the invariants."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from tiers_helpers import arena_name, make_blocks

from kvstore.events import BlockRemoved, BlockStored
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.cpu_arena import CpuArena, Lease, LeaseKind
from kvstore.tiers.errors import LeaseError
from kvstore.tiers.shared_memory import SharedSlots

SLOT_BYTES = 4096


@pytest.fixture
def arena() -> Iterator[CpuArena]:
    cpu = CpuArena(SharedSlots.create(arena_name(), 3, SLOT_BYTES, prefault=False), block_size=4)
    yield cpu
    cpu.close()


def store(cpu: CpuArena, meta: BlockMeta, fill: int) -> int:
    lease = cpu.reserve(meta)
    assert lease is not None
    cpu.slots.tensor[lease.slot].fill_(fill)
    cpu.commit(lease.lease_id)
    cpu.check_invariants()
    return lease.slot


def test_a_batch_takes_free_slots_in_ascending_runs_and_drops_evict_without_leases() -> None:
    cpu = CpuArena(SharedSlots.create(arena_name(), 8, SLOT_BYTES, prefault=False), block_size=4)
    try:
        metas, _ = make_blocks(9)
        first = cpu.reserve_many(metas[:4])
        assert [lease.slot for lease in first if lease is not None] == [0, 1, 2, 3]
        for lease in first:
            assert lease is not None
            cpu.commit(lease.lease_id)
        cpu.reserve_many(metas[4:5])[0].release()  # type: ignore[union-attr]  # slot 4 back at the free list's tail
        cpu.take_events()
        assert cpu.evict_lru(2, keep=lambda block_hash: False) == []  # not bound for disk: no lease, freed now
        assert cpu.take_events() == [BlockRemoved(block_hashes=[metas[0].block_hash], medium="CPU"),
                                     BlockRemoved(block_hashes=[metas[1].block_hash], medium="CPU")]  # fmt: skip
        # Free now, in list order: 5 6 7 4 0 1 -- a batch takes them in ascending order: runs 0-1 and 4-7.
        again = cpu.reserve_many([metas[0], metas[4], metas[5], metas[6], metas[7], metas[8]])
        assert [lease.slot for lease in again if lease is not None] == [0, 1, 4, 5, 6, 7]
        # Held, being written, or twice in one batch: None, as reserve() gives.
        assert cpu.reserve_many([metas[2], metas[0]]) == [None, None]
        cpu.check_invariants()
    finally:
        cpu.close()


def test_lru_order_and_eviction(arena: CpuArena) -> None:
    metas, _ = make_blocks(4)
    a, b, c, d = metas
    assert [store(arena, m, i) for i, m in enumerate((a, b, c))] == [0, 1, 2]
    assert arena.lru_hashes() == [a.block_hash, b.block_hash, c.block_hash]
    assert arena.reserve(d) is None  # full: the caller evicts first
    with arena.acquire(a) as hit:  # a hit makes a the most recently used
        assert hit is not None and hit.slot == 0
    assert arena.lru_hashes() == [b.block_hash, c.block_hash, a.block_hash]
    victims = arena.evict_lru(1)
    assert [v.meta for v in victims] == [b] and victims[0].kind is LeaseKind.READ
    assert arena.num_free_slots == 0  # b's bytes stay in slot 1 until its lease goes
    assert bytes(arena.view(victims[0].slot)[:2]) == b"\x01\x01"
    victims[0].release()
    arena.check_invariants()
    assert store(arena, d, 9) == 1  # b's slot, reused only now
    assert arena.lru_hashes() == [c.block_hash, a.block_hash, d.block_hash]
    assert arena.num_evictions == 1 and arena.used_bytes == 3 * SLOT_BYTES


def test_leased_blocks_are_never_evicted_or_reused(arena: CpuArena) -> None:
    metas, _ = make_blocks(5)
    for i, meta in enumerate(metas[:3]):
        store(arena, meta, i)
    reading = arena.acquire(metas[0])  # the LRU head, now leased (and moved to the tail)
    second = arena.acquire(metas[1])
    assert reading is not None and second is not None
    victims = arena.evict_lru(3)  # asks for 3, only the unleased one can go
    assert [v.meta for v in victims] == [metas[2]]
    for victim in victims:
        victim.release()
    assert arena.evict_lru(3) == []  # everything left is leased
    writer = arena.reserve(metas[3])
    assert writer is not None and writer.slot == 2  # the freed slot, not a leased one
    assert arena.reserve(metas[4]) is None
    arena.remove(metas[0].block_hash)  # removed while read: the slot waits for the reader
    assert metas[0].block_hash not in arena and arena.num_free_slots == 0
    arena.check_invariants()
    reading.release()
    assert arena.num_free_slots == 1
    second.release()
    writer.release()  # abandoning a write frees its slot and forgets the block
    assert arena.num_free_slots == 2 and not arena.is_writing(metas[3].block_hash)
    arena.check_invariants()


def test_write_lease_context_manager_aborts(arena: CpuArena) -> None:
    metas, _ = make_blocks(1)
    with arena.reserve(metas[0]) as lease:  # type: ignore[union-attr]
        assert arena.is_writing(metas[0].block_hash)
        assert arena.reserve(metas[0]) is None  # one writer per block
    assert arena.num_free_slots == 3 and metas[0].block_hash not in arena
    assert not arena.holds(lease.lease_id)
    arena.check_invariants()


def test_collision_is_a_counted_miss(arena: CpuArena) -> None:
    metas, _ = make_blocks(2)
    store(arena, metas[1], 1)
    impostor = BlockMeta(metas[1].block_hash, metas[1].parent_hash, (9, 9, 9, 9))
    assert arena.acquire(impostor) is None and arena.num_collisions == 1
    orphan = BlockMeta(metas[1].block_hash, None, metas[1].token_ids)
    assert arena.acquire(orphan) is None and arena.num_collisions == 2
    assert arena.acquire(metas[1]) is not None


def test_lease_misuse_raises(arena: CpuArena) -> None:
    metas, _ = make_blocks(1)
    store(arena, metas[0], 0)
    lease = arena.acquire(metas[0])
    assert lease is not None
    with pytest.raises(LeaseError, match="read lease"):
        arena.commit(lease.lease_id)
    lease.release()
    with pytest.raises(LeaseError, match="already released"):
        lease.release()
    with pytest.raises(LeaseError, match="unknown"):
        arena.release(12345)


def test_batch_misuse_raises_and_changes_nothing(arena: CpuArena) -> None:
    metas, _ = make_blocks(3)
    for index, meta in enumerate(metas[:2]):
        store(arena, meta, index)
    reads = arena.acquire_prefix(metas)  # the third is not cached: the prefix ends there
    assert [lease.meta for lease in reads] == metas[:2]
    (write,) = arena.reserve_many(metas[2:])
    assert write is not None
    with pytest.raises(LeaseError, match="read lease"):
        arena.commit_many([write.lease_id, reads[0].lease_id])
    with pytest.raises(LeaseError, match="unknown"):
        arena.release_many([reads[0].lease_id, 12345])
    with pytest.raises(LeaseError, match="twice"):
        arena.release_many([reads[1].lease_id, reads[1].lease_id])
    arena.check_invariants()
    assert arena.num_leased_slots == 3 and not arena.take_events()[2:]  # nothing committed
    arena.commit_many([write.lease_id])
    arena.release_many([lease.lease_id for lease in reads])
    assert arena.num_leased_slots == 0 and arena.num_blocks == 3
    arena.check_invariants()


def test_events_carry_tokens_and_parents(arena: CpuArena) -> None:
    metas, _ = make_blocks(2)
    store(arena, metas[0], 0)
    store(arena, metas[1], 1)
    arena.remove(metas[0].block_hash)
    events = arena.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
    first, second, removed = events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.medium == "CPU" and first.parent_block_hash is None and first.token_ids == [0, 1, 2, 3]
    assert second.parent_block_hash == metas[0].block_hash and second.block_hashes == [metas[1].block_hash]
    assert removed == BlockRemoved(block_hashes=[metas[0].block_hash], medium="CPU")
    assert arena.take_events() == []
    assert [e.block_hashes for e in arena.snapshot_events()] == [[metas[1].block_hash]]


# --------------------------------------------------------------------------- state machine


class ArenaMachine(RuleBasedStateMachine):
    """Random reserve/commit/acquire/release/evict/remove sequences keep every slot state consistent."""

    blocks = make_blocks(8)[0]
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.cpu = CpuArena(SharedSlots.create(arena_name(), 3, SLOT_BYTES, prefault=False), block_size=4)
        self.model_pinned: dict[int, int] = {}  # slot -> leases the test holds

    @rule(target=leases, index=st.integers(0, 7))
    def reserve(self, index: int) -> Lease | None:
        return self._hold(self.cpu.reserve(self.blocks[index]))

    @rule(target=leases, index=st.integers(0, 7))
    def acquire(self, index: int) -> Lease | None:
        return self._hold(self.cpu.acquire(self.blocks[index]))

    @rule(target=leases, count=st.integers(1, 3))
    def evict(self, count: int) -> Lease | None:
        victims = self.cpu.evict_lru(count)
        for victim in victims:
            assert self.model_pinned.get(victim.slot, 0) == 0, "evicted a slot the test holds a lease on"
        for victim in victims[1:]:
            victim.release()
        return self._hold(victims[0] if victims else None)

    @rule(indices=st.lists(st.integers(0, 7), max_size=4))
    def reserve_many_and_commit(self, indices: list[int]) -> None:
        for lease in self.cpu.reserve_many([self.blocks[i] for i in indices]):
            if lease is not None:
                self.cpu.commit(lease.lease_id)

    @rule(indices=st.lists(st.integers(0, 7), max_size=4))
    def acquire_prefix_and_release(self, indices: list[int]) -> None:
        metas = [self.blocks[i] for i in indices]
        leases = self.cpu.acquire_prefix(metas)
        assert [lease.meta for lease in leases] == metas[: len(leases)]
        assert len(leases) == len(metas) or metas[len(leases)].block_hash not in self.cpu
        self.cpu.check_invariants()
        self.cpu.release_many([lease.lease_id for lease in leases])

    @rule(indices=st.lists(st.integers(0, 7), max_size=4), commit=st.booleans())
    def reserve_many_then_end_as_batch(self, indices: list[int], commit: bool) -> None:
        ids = [lease.lease_id for lease in self.cpu.reserve_many([self.blocks[i] for i in indices]) if lease]
        self.cpu.check_invariants()
        if ids:
            with pytest.raises(LeaseError):
                self.cpu.commit_many([*ids, ids[0]])  # named twice: refused whole
            self.cpu.check_invariants()
        if commit:
            self.cpu.commit_many(ids)
        else:
            self.cpu.release_many(ids)

    @rule(count=st.integers(1, 3))
    def evict_dropping(self, count: int) -> None:
        assert self.cpu.evict_lru(count, keep=lambda block_hash: False) == []

    @rule(count=st.integers(1, 3))
    def drop_lru(self, count: int) -> None:
        lru = self.cpu.lru_hashes()
        unleased = [h for h in lru if not self.model_pinned.get(self.cpu._index[h], 0)][
            :count
        ]  # read leases: the test's
        assert self.cpu.drop_lru(count) == len(unleased)
        assert self.cpu.lru_hashes() == [h for h in lru if h not in unleased]

    @rule(lease=consumes(leases))
    def finish(self, lease: Lease | None) -> None:
        if lease is None:
            return
        self.model_pinned[lease.slot] -= 1
        if lease.kind is LeaseKind.WRITE:
            self.cpu.commit(lease.lease_id)
        else:
            lease.release()

    @rule(index=st.integers(0, 7))
    def remove(self, index: int) -> None:
        self.cpu.remove(self.blocks[index].block_hash)

    def _hold(self, lease: Lease | None) -> Lease | None:
        if lease is not None:
            self.model_pinned[lease.slot] = self.model_pinned.get(lease.slot, 0) + 1
        return lease

    @invariant()
    def consistent(self) -> None:
        self.cpu.check_invariants()  # among others: a slot with a live lease is never free
        assert self.cpu.num_free_slots <= self.cpu.num_slots - sum(1 for n in self.model_pinned.values() if n)

    def teardown(self) -> None:
        self.cpu.close()


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_events_are_built_per_block_in_order_when_taken_and_never_when_discarded(arena: CpuArena) -> None:
    metas, _ = make_blocks(4)
    for fill, meta in enumerate(metas[:3]):
        store(arena, meta, fill)
    assert arena.drop_lru(1) == 1  # metas[0] goes
    events = arena.take_events()
    assert [type(event) for event in events] == [BlockStored] * 3 + [BlockRemoved]
    assert [event.block_hashes for event in events] == [[meta.block_hash] for meta in (*metas[:3], metas[0])]
    assert isinstance(events[1], BlockStored) and events[1].parent_block_hash == metas[0].block_hash
    assert events[1].token_ids == list(metas[1].token_ids)
    store(arena, metas[3], 9)
    assert arena.discard_events() == 1 and arena.take_events() == []
