"""The CPU arenas: exact LRU order, leases that pin slots, collisions, events; state machines for the invariants.

Every test runs on both arenas where the kernel is built: the books in C (``CpuArena``, over the compiled
``SlotTable``) and in Python (``PyCpuArena``); a lockstep state machine drives the two and compares every
answer and every piece of state either shows.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from tiers_helpers import arena_name, make_blocks

from kvstore.events import BlockRemoved, BlockStored, Medium
from kvstore.tiers import cpu_arena
from kvstore.tiers.arena import Arena, Lease, LeaseKind
from kvstore.tiers.blocks import BlockMeta, SlotGrant
from kvstore.tiers.cpu_arena import CpuArena, PyCpuArena, new_arena
from kvstore.tiers.errors import LeaseError
from kvstore.tiers.shared_memory import SharedSlots

SLOT_BYTES = 4096
ArenaType = type[CpuArena] | type[PyCpuArena]

ARENAS = [pytest.param(CpuArena, id="native"), pytest.param(PyCpuArena, id="python")]
if not cpu_arena.NATIVE:  # no kernel built: only the Python books
    ARENAS = ARENAS[1:]


@pytest.fixture(params=[param.values[0] for param in ARENAS], ids=[str(param.id) for param in ARENAS])
def arena_type(request: pytest.FixtureRequest) -> ArenaType:
    return request.param  # type: ignore[no-any-return]


def make_arena(arena_type: ArenaType, num_slots: int = 3) -> Arena:
    return arena_type(SharedSlots.create(arena_name(), num_slots, SLOT_BYTES, prefault=False), block_size=4)


@pytest.fixture
def arena(arena_type: ArenaType) -> Iterator[Arena]:
    cpu = make_arena(arena_type)
    yield cpu
    cpu.close()


def table(num_slots: int = 4, meta_type: type = BlockMeta) -> Any:
    """A bare compiled SlotTable (skips where the kernel is not built)."""
    if not cpu_arena.NATIVE:
        pytest.skip("the compiled SlotTable is not built")
    from kvstore.tiers._copyrows import SlotTable

    return SlotTable(num_slots, 4, meta_type, SlotGrant, LeaseError)


def test_the_compiled_slot_table_is_built_and_chosen() -> None:
    """``scripts/dev setup`` builds it with the copy kernel; without it the store keeps its books in Python."""
    assert cpu_arena.NATIVE, "kvstore.tiers._copyrows is missing: reinstall with a C compiler"
    slots = SharedSlots.create(arena_name(), 2, SLOT_BYTES, prefault=False)
    cpu = new_arena(slots, block_size=4)
    assert isinstance(cpu, CpuArena) and cpu.native
    cpu.close()


def test_the_slot_table_refuses_wrong_arguments_with_an_error() -> None:
    from kvstore.tiers._copyrows import SlotTable

    with pytest.raises(ValueError, match="bad shape"):
        SlotTable(0, 4, BlockMeta, SlotGrant, LeaseError)
    with pytest.raises(TypeError, match="grant_type"):
        SlotTable(4, 4, BlockMeta, list, LeaseError)
    with pytest.raises(TypeError, match="grant_type"):  # a C tuple type of another layout
        SlotTable(4, 4, BlockMeta, time.struct_time, LeaseError)
    bare = SlotTable.__new__(SlotTable)
    with pytest.raises(ValueError, match="not initialized"):
        bare.reserve([], 0.0, Medium.CPU, True)
    assert 5 not in bare
    books = table()
    with pytest.raises(TypeError, match="takes 4 arguments"):
        books.reserve([])
    with pytest.raises(TypeError):
        books.reserve(5, 0.0, Medium.CPU, True)  # not a sequence
    with pytest.raises(TypeError, match="initialized once"):
        books.__init__(4, 4, BlockMeta, SlotGrant, LeaseError)
    metas, _ = make_blocks(2)
    for bad in (
        BlockMeta("x", None, (1, 2, 3, 4)),  # type: ignore[arg-type]
        BlockMeta(-1, None, (1, 2, 3, 4)),
        BlockMeta(1 << 64, None, (1, 2, 3, 4)),
        BlockMeta(5, -2, (1, 2, 3, 4)),
        BlockMeta(5, None, (1, 2, 3)),
        BlockMeta(5, None, (1, 2, 3, -4)),
        BlockMeta(5, None, [1, 2, 3, 4]),  # type: ignore[arg-type]
        object(),
    ):
        with pytest.raises((TypeError, ValueError, AttributeError)):
            books.reserve([metas[0], bad], 0.0, Medium.CPU, True)  # a bad block anywhere: nothing reserved
        assert books.num_free_slots == 4 and books.num_leases == 0 and metas[0].block_hash not in books
        books.check()
    for bad_id in (0, -1, 1 << 70, "1", None, 1.0):
        with pytest.raises(LeaseError, match="unknown"):
            books.release([bad_id])
    assert books.acquire_prefix([BlockMeta(5, None, (1, 2, 3, 1 << 70))], 0.0, Medium.CPU) == []
    assert books.held_among([5, "x", -1, 1 << 80], True) == set()
    assert not books.holds("x") and not books.is_writing(None) and books.remove(-5) is False


def test_slot_reads_follow_only_the_type_they_were_set_up_for() -> None:
    """Fields are read from their slots only for the type ``use_meta_type`` was given, and only while that
    type's descriptors are the ones it found; otherwise by attribute, as Python would."""
    from kvstore.tiers._copyrows import use_meta_type

    class Borrowed:  # another class's descriptors: they do not describe this one's instances
        __slots__ = ()
        block_hash = BlockMeta.block_hash  # type: ignore[assignment]
        parent_hash = BlockMeta.parent_hash  # type: ignore[assignment]
        token_ids = BlockMeta.token_ids  # type: ignore[assignment]

    class Tagged(NamedTuple):  # the same fields, as tuple items behind properties: read by attribute
        block_hash: int
        parent_hash: int | None
        token_ids: tuple[int, ...]

    assert not use_meta_type(Borrowed) and not use_meta_type(Tagged) and not use_meta_type(int)

    class Other(msgspec.Struct, frozen=True, array_like=True, gc=False):
        block_hash: int
        parent_hash: int | None
        token_ids: tuple[int, ...]

    books = table(meta_type=Other)
    try:
        assert use_meta_type(Other)
        block = Other(5, None, (1, 2, 3, 4))
        (grant,), _, _, _ = books.reserve([block], 0.0, Medium.CPU, True)
        books.commit([grant.lease_id], False)
        assert [g.slot for g in books.acquire_prefix([block], 0.0, Medium.CPU)] == [grant.slot]
        assert books.acquire_prefix([Tagged(5, None, (1, 2, 3, 4))], 0.0, Medium.CPU) != []  # by attribute
        Other.block_hash = property(lambda self: 6)  # type: ignore[assignment,method-assign]
        assert books.acquire_prefix([block], 0.0, Medium.CPU) == []  # Python's answer: the slot is no longer read
    finally:
        assert use_meta_type(BlockMeta)


def test_hostile_metas_get_errors_or_answers_not_crashes() -> None:
    """A reserve takes BlockMetas only (their fields are read from their slots: no Python code runs). A prefix
    lookup reads other objects by attribute, and a getter may change the caller's list or the table itself:
    every meta is read first, from a tuple of the batch's own, and only then the table."""
    books = table(num_slots=8)
    metas, _ = make_blocks(4)
    (grant,), _, _, _ = books.reserve(metas[:1], 0.0, Medium.CPU, True)
    books.commit([grant.lease_id], False)

    class Meta:
        def __init__(self, block_hash: int, hook: Callable[[], Any] | None = None) -> None:
            self._hash, self.hook = block_hash, hook
            self.parent_hash, self.token_ids = metas[0].parent_hash, metas[0].token_ids

        @property
        def block_hash(self) -> int:
            if self.hook is not None:
                self.hook()
            return self._hash

    with pytest.raises(TypeError, match="expected BlockMeta, got Meta"):
        books.reserve([metas[1], Meta(11)], 0.0, Medium.CPU, True)
    assert books.num_leases == 0 and books.num_free_slots == 7
    batch: list[Any] = []
    batch += [Meta(metas[0].block_hash), Meta(metas[0].block_hash, batch.clear), *[Meta(20 + i) for i in range(5)]]
    found = books.acquire_prefix(batch, 0.0, Medium.CPU)  # the list emptied mid-read: the tuple still holds all
    assert [g.block_hash for g in found] == [metas[0].block_hash] * 2
    books.release([g.lease_id for g in found])
    # A getter that drops the block a prefix is about to lease: read first, so the lookup sees it gone.
    dropper = Meta(30, lambda: books.remove(metas[0].block_hash))
    assert books.acquire_prefix([Meta(metas[0].block_hash), dropper], 0.0, Medium.CPU) == []
    books.check()


def test_an_arena_dropped_with_leases_held_is_collected(arena_type: ArenaType) -> None:
    """Leases and their arena may reference each other while held: the cycle is the garbage collector's."""
    cpu = make_arena(arena_type)
    metas, _ = make_blocks(3)
    leases = [cpu.reserve(meta) for meta in metas]
    assert all(lease is not None for lease in leases)
    cpu.slots.close()
    gone = weakref.ref(cpu)
    del cpu, leases
    gc.collect()
    assert gone() is None


def reserve_many(cpu: Arena, metas: list[BlockMeta], *, evict: bool = False) -> list[SlotGrant | None]:
    grants, _, _ = cpu.reserve_grants(metas, time.perf_counter(), evict=evict)
    return grants


def store(cpu: Arena, meta: BlockMeta, fill: int) -> int:
    lease = cpu.reserve(meta)
    assert lease is not None
    cpu.slots.tensor[lease.slot].fill_(fill)
    cpu.commit(lease.lease_id)
    cpu.check_invariants()
    return lease.slot


def test_a_batch_takes_free_slots_in_ascending_runs_and_drops_evict_without_leases(arena_type: ArenaType) -> None:
    cpu = make_arena(arena_type, 8)
    try:
        metas, _ = make_blocks(10)
        first = reserve_many(cpu, metas[:4])
        assert [grant.slot for grant in first if grant is not None] == [0, 1, 2, 3]
        assert cpu.commit_ids([grant.lease_id for grant in first if grant is not None])[0] == 4
        (fifth,) = reserve_many(cpu, metas[4:5])
        assert fifth is not None
        cpu.release(fifth.lease_id)  # slot 4 back at the free list's tail
        cpu.take_events()
        assert cpu.evict_lru(2, keep=lambda block_hash: False) == []  # not bound for disk: no lease, freed now
        assert cpu.take_events() == [BlockRemoved(block_hashes=[metas[0].block_hash], medium="CPU"),
                                     BlockRemoved(block_hashes=[metas[1].block_hash], medium="CPU")]  # fmt: skip
        # Free now, in list order: 5 6 7 4 0 1 -- a batch takes them in ascending order: runs 0-1 and 4-7.
        again = reserve_many(cpu, [metas[0], metas[4], metas[5], metas[6], metas[7], metas[8]])
        assert [grant.slot for grant in again if grant is not None] == [0, 1, 4, 5, 6, 7]
        assert all(grant is None or grant.medium is Medium.CPU for grant in again)
        # Cached, being written, or twice in one batch: duplicates; past the free slots: no slot.
        grants, duplicates, no_slot = cpu.reserve_grants([metas[2], metas[0], metas[9], metas[9]], 0.0, evict=False)
        assert grants == [None, None, None, None] and (duplicates, no_slot) == (3, 1)
        # With evict, the least recently used unleased blocks make room: metas[3] (metas[2] was just touched).
        grants, duplicates, no_slot = cpu.reserve_grants([metas[9]], 0.0, evict=True)
        assert [grant.slot for grant in grants if grant] == [3] and (duplicates, no_slot) == (0, 0)
        assert metas[3].block_hash not in cpu and cpu.num_evictions == 3
        assert cpu.take_events() == [BlockRemoved(block_hashes=[metas[3].block_hash], medium="CPU")]
        cpu.check_invariants()
    finally:
        cpu.close()


def test_lru_order_and_eviction(arena: Arena) -> None:
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


def test_leased_blocks_are_never_evicted_or_reused(arena: Arena) -> None:
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


def test_write_lease_context_manager_aborts(arena: Arena) -> None:
    metas, _ = make_blocks(1)
    with arena.reserve(metas[0]) as lease:  # type: ignore[union-attr]
        assert arena.is_writing(metas[0].block_hash)
        assert arena.reserve(metas[0]) is None  # one writer per block
    assert arena.num_free_slots == 3 and metas[0].block_hash not in arena
    assert not arena.holds(lease.lease_id)
    arena.check_invariants()


def test_collision_is_a_counted_miss(arena: Arena) -> None:
    metas, _ = make_blocks(2)
    store(arena, metas[1], 1)
    impostor = BlockMeta(metas[1].block_hash, metas[1].parent_hash, (9, 9, 9, 9))
    assert arena.acquire(impostor) is None and arena.num_collisions == 1
    orphan = BlockMeta(metas[1].block_hash, None, metas[1].token_ids)
    assert arena.acquire(orphan) is None and arena.num_collisions == 2
    assert arena.acquire(metas[1]) is not None


def test_a_read_lease_outliving_its_block_frees_its_slot_even_after_the_block_is_stored_again(
    arena: Arena,
) -> None:
    metas, _ = make_blocks(1)
    first = store(arena, metas[0], 1)
    (reader,) = arena.acquire_prefix_grants(metas, 0.0)
    assert arena.remove(metas[0].block_hash)  # detached: the reader still copies out of the old slot
    again = store(arena, metas[0], 2)
    assert again != first and arena.num_free_slots == 1
    assert arena.release_ids([reader.lease_id]) == (1, 0.0)
    assert arena.num_free_slots == 2 and arena.lru_hashes() == [metas[0].block_hash]
    arena.check_invariants()
    others, _ = make_blocks(2, first_token=100)
    assert sorted(grant.slot for grant in reserve_many(arena, others) if grant) == sorted({0, 1, 2} - {again})


def test_a_prefix_ends_before_a_block_with_other_tokens_or_another_parent(arena: Arena) -> None:
    metas, _ = make_blocks(3)
    for fill, meta in enumerate(metas[:3]):
        store(arena, meta, fill)
    other_tokens = BlockMeta(metas[1].block_hash, metas[1].parent_hash, (9, 9, 9, 9))
    other_parent = BlockMeta(metas[1].block_hash, 12345, metas[1].token_ids)
    for impostor in (other_tokens, other_parent):
        (grant,) = arena.acquire_prefix_grants([metas[0], impostor, metas[2]], 0.0)
        assert grant[:3] == (grant.lease_id, 0, metas[0].block_hash) and arena.num_collisions == 0  # acquire() counts
        arena.release(grant.lease_id)
    assert len(arena.acquire_prefix_grants(metas, 0.0)) == 3


def test_lease_misuse_raises(arena: Arena) -> None:
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


def test_batch_misuse_raises_and_changes_nothing(arena: Arena) -> None:
    metas, _ = make_blocks(3)
    for index, meta in enumerate(metas[:2]):
        store(arena, meta, index)
    reads = arena.acquire_prefix_grants(metas, 0.0)  # the third is not cached: the prefix ends there
    assert [grant.block_hash for grant in reads] == [meta.block_hash for meta in metas[:2]]
    (write,) = reserve_many(arena, metas[2:])
    assert write is not None
    with pytest.raises(LeaseError, match="read lease"):
        arena.commit_ids([write.lease_id, reads[0].lease_id])
    with pytest.raises(LeaseError, match="unknown"):
        arena.release_ids([reads[0].lease_id, 12345])
    with pytest.raises(LeaseError, match="twice"):
        arena.release_ids([reads[1].lease_id, reads[1].lease_id])
    with pytest.raises(LeaseError, match="twice"):
        arena.commit_ids([write.lease_id, write.lease_id])
    arena.check_invariants()
    assert arena.num_leased_slots == 3 and not arena.take_events()[2:]  # nothing committed
    assert arena.commit_ids([write.lease_id], metas=True)[::2] == (1, [metas[2]])
    arena.release_ids([grant.lease_id for grant in reads])
    assert arena.num_leased_slots == 0 and arena.num_blocks == 3
    arena.check_invariants()


def test_events_carry_tokens_and_parents(arena: Arena) -> None:
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
    arena_type: ArenaType = CpuArena if cpu_arena.NATIVE else PyCpuArena

    def __init__(self) -> None:
        super().__init__()
        self.cpu = make_arena(self.arena_type)
        self.model_pinned: dict[int, int] = {}  # slot -> leases the test holds

    @rule(target=leases, index=st.integers(0, 7))
    def reserve(self, index: int) -> Lease | None:
        return self._hold(self.cpu.reserve(self.blocks[index]))

    @rule(target=leases, index=st.integers(0, 7))
    def acquire(self, index: int) -> Lease | None:
        return self._hold(self.cpu.acquire(self.blocks[index]))

    @rule(target=leases, count=st.integers(1, 3))
    def evict(self, count: int) -> Lease | None:
        victims = self.cpu.evict_lru(count, keep=lambda block_hash: True)
        for victim in victims:
            assert self.model_pinned.get(victim.slot, 0) == 0, "evicted a slot the test holds a lease on"
            assert self.cpu.lease(victim.lease_id).meta == victim.meta  # rebuilt from the slot, equal
        for victim in victims[1:]:
            victim.release()
        return self._hold(victims[0] if victims else None)

    @rule(indices=st.lists(st.integers(0, 7), max_size=4), evict=st.booleans())
    def reserve_many_and_commit(self, indices: list[int], evict: bool) -> None:
        grants = reserve_many(self.cpu, [self.blocks[i] for i in indices], evict=evict)
        for grant in grants:
            if grant is not None:
                assert self.model_pinned.get(grant.slot, 0) == 0, "reserved a slot the test holds a lease on"
                self.cpu.commit(grant.lease_id)

    @rule(indices=st.lists(st.integers(0, 7), max_size=4))
    def acquire_prefix_and_release(self, indices: list[int]) -> None:
        metas = [self.blocks[i] for i in indices]
        grants = self.cpu.acquire_prefix_grants(metas, 0.0)
        assert [grant.block_hash for grant in grants] == [meta.block_hash for meta in metas[: len(grants)]]
        assert len(grants) == len(metas) or metas[len(grants)].block_hash not in self.cpu
        self.cpu.check_invariants()
        self.cpu.release_ids([grant.lease_id for grant in grants])

    @rule(indices=st.lists(st.integers(0, 7), max_size=4), commit=st.booleans())
    def reserve_many_then_end_as_batch(self, indices: list[int], commit: bool) -> None:
        ids = [grant.lease_id for grant in reserve_many(self.cpu, [self.blocks[i] for i in indices]) if grant]
        self.cpu.check_invariants()
        if ids:
            with pytest.raises(LeaseError):
                self.cpu.commit_ids([*ids, ids[0]])  # named twice: refused whole
            self.cpu.check_invariants()
        if commit:
            self.cpu.commit_ids(ids)
        else:
            self.cpu.release_ids(ids)

    @rule(count=st.integers(1, 3))
    def evict_dropping(self, count: int) -> None:
        assert self.cpu.evict_lru(count, keep=lambda block_hash: False) == []

    @rule(count=st.integers(1, 3))
    def drop_lru(self, count: int) -> None:
        lru = self.cpu.lru_hashes()
        pinned = {self.cpu.lease(lease_id).slot for lease_id in self.cpu.lease_ids()}
        unleased = [h for h in lru if self.cpu.slot_of(h) not in pinned][:count]
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


class PyArenaMachine(ArenaMachine):
    arena_type = PyCpuArena


TestPyArenaMachine = PyArenaMachine.TestCase
TestPyArenaMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_events_are_built_per_block_in_order_when_taken_and_never_when_discarded(arena: Arena) -> None:
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


def test_with_events_off_nothing_is_recorded(arena: Arena) -> None:
    arena.record_events = False
    metas, _ = make_blocks(4)
    for fill, meta in enumerate(metas):
        if fill == 3:
            arena.drop_lru(1)
        store(arena, meta, fill)
    arena.remove(metas[1].block_hash)
    assert arena.take_events() == [] and arena.discard_events() == 0
    assert [event.block_hashes for event in arena.snapshot_events()] == [[metas[2].block_hash], [metas[3].block_hash]]


# --------------------------------------------------------------------------- the two arenas in lockstep


def _seen(answer: Any) -> Any:
    """An answer in comparable form: leases by their fields but the grant time, lists item by item, and a time
    read off the clock (a lease made one by one is granted when made) as "clock"."""
    if isinstance(answer, float) and answer not in (1.0, 2.0):
        return "clock"
    if isinstance(answer, Lease):
        return (answer.lease_id, answer.slot, answer.meta, answer.kind)
    if isinstance(answer, list | tuple) and not isinstance(answer, SlotGrant):
        return [_seen(item) for item in answer]
    return answer


class LockstepMachine(RuleBasedStateMachine):
    """The books in C and in Python, driven with the same calls, give the same answers (grants, leases, counts),
    raise the same errors and show the same state: LRU order, free and leased slots, leases, events, counters.
    Free-list order shows in the slots later reserves are given."""

    blocks = make_blocks(8)[0]
    # Same hash and parent as a stored block, other tokens (or same tokens, another parent): collisions.
    impostors = [BlockMeta(meta.block_hash, meta.parent_hash, (7, 7, 7, 7)) for meta in blocks[:4]] + [
        BlockMeta(meta.block_hash, 12345, meta.token_ids) for meta in blocks[4:]
    ]

    def __init__(self) -> None:
        super().__init__()
        self.twins: list[Arena] = [make_arena(kind, 4) for kind in (CpuArena, PyCpuArena)]
        self.held: list[int] = []  # lease ids live in both

    def _both(self, call: Callable[[Arena], Any]) -> Any:
        answers = []
        for cpu in self.twins:
            try:
                answers.append(("ok", _seen(call(cpu))))
            except LeaseError as exc:
                answers.append(("raised", str(exc)))
        assert answers[0] == answers[1], f"native {answers[0]} != python {answers[1]}"
        return answers[0]

    def _metas(self, indices: list[int], impostor: int | None) -> list[BlockMeta]:
        metas = [self.blocks[i] for i in indices]
        if impostor is not None and metas:
            metas[impostor % len(metas)] = self.impostors[indices[impostor % len(metas)]]
        return metas

    def _ids(self, picks: list[int], extra: int | None) -> list[int]:
        ids = [self.held[pick % len(self.held)] for pick in picks] if self.held else []
        return [*ids, extra] if extra is not None else ids

    def _track(self, answer: Any) -> None:
        status, handed = answer
        if status == "ok":
            self.held += [item[0] for item in handed if item is not None]

    def _ended(self, answer: Any, ids: list[int]) -> None:
        if answer[0] == "ok":
            self.held = [lease_id for lease_id in self.held if lease_id not in ids]

    @rule(indices=st.lists(st.integers(0, 7), max_size=6), evict=st.booleans())
    def reserve_grants(self, indices: list[int], evict: bool) -> None:
        answer = self._both(lambda cpu: cpu.reserve_grants([self.blocks[i] for i in indices], 1.0, evict=evict))
        self._track((answer[0], answer[1][0]) if answer[0] == "ok" else answer)

    @rule(indices=st.lists(st.integers(0, 7), max_size=5), evict=st.booleans())
    def store_many(self, indices: list[int], evict: bool) -> None:
        answer = self._both(lambda cpu: cpu.reserve_grants([self.blocks[i] for i in indices], 1.0, evict=evict))
        ids = [grant[0] for grant in answer[1][0] if grant is not None]
        self._both(lambda cpu: cpu.commit_ids(ids, metas=True))

    @rule(indices=st.lists(st.integers(0, 7), max_size=5), impostor=st.none() | st.integers(0, 4))
    def acquire_prefix(self, indices: list[int], impostor: int | None) -> None:
        self._track(self._both(lambda cpu: cpu.acquire_prefix_grants(self._metas(indices, impostor), 2.0)))

    @rule(index=st.integers(0, 7), impostor=st.booleans(), write=st.booleans())
    def one_lease(self, index: int, impostor: bool, write: bool) -> None:
        meta = self.impostors[index] if impostor else self.blocks[index]
        answer = self._both(lambda cpu: cpu.reserve(meta) if write else cpu.acquire(meta))
        self._track((answer[0], [answer[1]]))

    @rule(picks=st.lists(st.integers(0, 50), max_size=4), extra=st.none() | st.sampled_from([0, 999, -1]))
    def commit_ids(self, picks: list[int], extra: int | None) -> None:
        ids = self._ids(picks, extra)
        self._ended(self._both(lambda cpu: cpu.commit_ids(ids, metas=True)), ids)

    @rule(picks=st.lists(st.integers(0, 50), max_size=4), extra=st.none() | st.sampled_from([0, 999, -1]))
    def release_ids(self, picks: list[int], extra: int | None) -> None:
        ids = self._ids(picks, extra)
        self._ended(self._both(lambda cpu: cpu.release_ids(ids)), ids)

    @rule(count=st.integers(0, 5))
    def drop_lru(self, count: int) -> None:
        self._both(lambda cpu: cpu.drop_lru(count))

    @rule(count=st.integers(1, 3), keep_odd=st.booleans())
    def evict_lru(self, count: int, keep_odd: bool) -> None:
        self._track(
            self._both(lambda cpu: cpu.evict_lru(count, keep=lambda block_hash: keep_odd and block_hash % 2 == 1))
        )

    @rule(index=st.integers(0, 7), touch=st.booleans())
    def remove_or_touch(self, index: int, touch: bool) -> None:
        block_hash = self.blocks[index].block_hash
        self._both(lambda cpu: cpu.touch(block_hash) if touch else cpu.remove(block_hash))

    @invariant()
    def same_state(self) -> None:
        states = []
        hashes = [meta.block_hash for meta in self.blocks]
        for cpu in self.twins:
            cpu.check_invariants()
            states.append(
                (
                    cpu.lru_hashes(),
                    [cpu.slot_of(block_hash) for block_hash in hashes],
                    cpu.num_free_slots,
                    cpu.num_leased_slots,
                    [_seen(cpu.lease(lease_id)) for lease_id in cpu.lease_ids()],
                    cpu.held_among(hashes),
                    cpu.held_among(hashes, writing=True),
                    cpu.num_blocks,
                    cpu.num_evictions,
                    cpu.num_collisions,
                    cpu.take_events(),
                    cpu.snapshot_events(),
                )
            )
        assert states[0] == states[1]
        assert sorted(self.held) == self.twins[0].lease_ids()

    def teardown(self) -> None:
        for cpu in self.twins:
            cpu.close()


TestLockstepMachine = LockstepMachine.TestCase
TestLockstepMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
if not cpu_arena.NATIVE:
    TestLockstepMachine = pytest.mark.skip(reason="the compiled SlotTable is not built")(TestLockstepMachine)
