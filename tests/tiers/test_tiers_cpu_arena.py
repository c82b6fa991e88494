"""CpuArena: exact LRU order, leases that pin slots, collisions, events; a state machine for the invariants.

Every test runs twice where the compiled batch loops are built: on them (``CpuArena``) and on the Python
loops beside them (``PythonLoopsArena``); a lockstep state machine drives the two and compares every answer.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec
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


class PythonLoopsArena(CpuArena):
    """The arena on its Python batch loops: what an install without a C compiler runs."""

    _native = None


ARENAS = [pytest.param(CpuArena, id="native"), pytest.param(PythonLoopsArena, id="python")]
if CpuArena._native is None:  # no kernel built: both are the Python loops
    ARENAS = ARENAS[1:]


@pytest.fixture(params=[param.values[0] for param in ARENAS], ids=[str(param.id) for param in ARENAS])
def arena_type(request: pytest.FixtureRequest) -> type[CpuArena]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def arena(arena_type: type[CpuArena]) -> Iterator[CpuArena]:
    cpu = arena_type(SharedSlots.create(arena_name(), 3, SLOT_BYTES, prefault=False), block_size=4)
    yield cpu
    cpu.close()


def test_the_compiled_batch_loops_are_built() -> None:
    """``scripts/dev setup`` builds them with the copy kernel; without them every batch runs the Python loops."""
    assert CpuArena._native is not None, "kvstore.tiers._copyrows is missing: reinstall with a C compiler"
    assert PythonLoopsArena._native is None


def test_the_compiled_loops_refuse_wrong_arguments_with_an_error() -> None:
    native = CpuArena._native
    if native is None:
        pytest.skip("the compiled batch loops are not built")
    with pytest.raises(TypeError, match="subclass of LeaseCore"):
        native.lease_many(int, None, {}, [], None, None, 1, [], None)
    with pytest.raises(IndexError, match="outside the arena"):
        native.lease_many(Lease, None, {}, [0], None, None, 1, [(5, None)], None)
    with pytest.raises(TypeError, match="9 arguments"):
        native.lease_many(Lease)
    with pytest.raises(TypeError, match="must be a dict"):
        native.match_prefix([], [], [])
    with pytest.raises(TypeError, match="pins must be a list"):
        native.commit_many({}, (), {}, {}, [], None)
    assert native.release_many({}, [], {}, {}, [], [1], None) is None  # an unknown id: refused, nothing changed
    assert native.release_many({}, [], {}, {}, [], [[1]], None) is None  # an unhashable one too
    # An id that is not an int exactly is left to the Python loop (whose lookup may run Python code).
    metas, _ = make_blocks(1)
    held = {1: Lease(None, 1, 0, metas[0], LeaseKind.READ)}  # type: ignore[arg-type]  # no arena needed here
    assert native.release_many(held, [1], {}, {}, [metas[0]], [True], LeaseKind.WRITE) is None
    assert 1 in held  # untouched
    with pytest.raises(TypeError, match="subclass of tuple"):
        native.grant_many(list, [], None, 0.0)
    with pytest.raises(TypeError, match="subclass of tuple"):  # a C tuple type of another layout
        native.grant_many(time.struct_time, [], None, 0.0)
    with pytest.raises(TypeError, match="expected a lease"):
        native.earliest_grant([object()], None)
    with pytest.raises(ValueError, match="differ in length"):
        native.drop_lru({}, [0], [], 1)


def test_the_compiled_loops_read_meta_fields_from_slots_only_for_blockmeta_itself() -> None:
    native = CpuArena._native
    if native is None:
        pytest.skip("the compiled batch loops are not built")
    assert native.use_meta_type(BlockMeta)  # done at import; doing it again changes nothing

    class Tagged(NamedTuple):  # the same fields, as tuple items behind properties: read by attribute
        block_hash: int
        parent_hash: int | None
        token_ids: tuple[int, ...]

    assert not native.use_meta_type(Tagged) and not native.use_meta_type(int)
    metas, _ = make_blocks(2)
    stored = [Tagged(meta.block_hash, meta.parent_hash, meta.token_ids) for meta in metas]
    index, slot_meta = {metas[0].block_hash: 0, metas[1].block_hash: 1}, [metas[0], stored[1]]
    assert native.match_prefix(index, slot_meta, [stored[0], metas[1]]) == [(0, metas[0]), (1, stored[1])]
    with pytest.raises(AttributeError):
        native.match_prefix(index, slot_meta, [object()])


def test_hostile_callers_get_errors_not_crashes() -> None:
    """Python code run from inside a C loop (a field's getter, a comparison) may change or free what the loop
    reads; deleted lease fields are refused. Each of these crashed the interpreter in a first version."""
    native = CpuArena._native
    if native is None:
        pytest.skip("the compiled batch loops are not built")

    class Meta:
        def __init__(self, block_hash: int, token_ids: Any = (1, 2, 3, 4), parent_hash: Any = None) -> None:
            self._hash, self.token_ids, self.parent_hash, self.hook = block_hash, token_ids, parent_hash, None

        @property
        def block_hash(self) -> int:
            if self.hook is not None:
                self.hook()
            return self._hash

    pairs: list[Any] = []
    first = Meta(10)
    first.hook = pairs.clear  # the caller's list emptied mid-loop: the loop reads its own copy
    pairs += [(0, first)] + [(1, Meta(11 + i)) for i in range(20)]
    index = OrderedDict((10 + i, 0) for i in range(30))
    leases, _ = native.lease_many(Lease, None, {}, [0, 0], None, index, 1, pairs, LeaseKind.READ)
    assert len(leases) == 21
    slot_meta: list[Any] = [Meta(10, parent_hash=Meta(99))]

    class Tokens(tuple):  # type: ignore[type-arg]
        def __eq__(self, other: object) -> bool:
            slot_meta[0] = None  # frees the stored meta the loop is comparing with
            return True

        __hash__ = tuple.__hash__

    assert native.match_prefix({10: 0}, slot_meta, [Meta(10, token_ids=Tokens((1, 2, 3, 4)))]) == []
    pins = [0] * 8
    shrinking = Meta(10)
    shrinking.hook = pins.clear
    with pytest.raises(IndexError):
        native.lease_many(Lease, None, {}, pins, None, OrderedDict([(10, 0)]), 1, [(7, shrinking)], LeaseKind.READ)


@pytest.mark.parametrize("field", ["meta", "slot", "kind", "lease_id"])
def test_a_lease_with_a_deleted_field_is_an_error(arena: CpuArena, field: str) -> None:
    metas, _ = make_blocks(1)
    (lease,) = arena.reserve_many(metas)
    assert lease is not None
    lease_id = lease.lease_id
    delattr(lease, field)
    with pytest.raises(AttributeError):
        arena.release_many([lease_id])


def test_leasing_a_prefix_that_is_no_longer_cached_leaves_no_lease(arena: CpuArena) -> None:
    metas, _ = make_blocks(2)
    for fill, meta in enumerate(metas):
        store(arena, meta, fill)
    found = arena.match_prefix(metas)
    arena.remove(metas[1].block_hash)
    with pytest.raises(KeyError):
        arena.lease_matched(found)  # a caller's mistake: something changed between the two
    assert arena.num_leased_slots == 0 and not arena._held
    arena.check_invariants()


def test_slot_reads_follow_only_the_type_they_were_set_up_for() -> None:
    native = CpuArena._native
    if native is None:
        pytest.skip("the compiled batch loops are not built")

    class Borrowed:  # another class's descriptors: they do not describe this one's instances
        __slots__ = ()
        block_hash = BlockMeta.block_hash  # type: ignore[assignment]
        parent_hash = BlockMeta.parent_hash  # type: ignore[assignment]
        token_ids = BlockMeta.token_ids  # type: ignore[assignment]

    assert not native.use_meta_type(Borrowed)

    class Other(msgspec.Struct, frozen=True, array_like=True, gc=False):
        block_hash: int
        parent_hash: int | None
        token_ids: tuple[int, ...]

    try:
        assert native.use_meta_type(Other)
        block = Other(5, None, (1, 2, 3, 4))
        assert native.match_prefix({5: 0}, [block], [block]) == [(0, block)]
        Other.block_hash = property(lambda self: 6)  # type: ignore[assignment,method-assign]
        assert native.match_prefix({5: 0}, [block], [block]) == []  # Python's answer: the slot is no longer read
    finally:
        assert native.use_meta_type(BlockMeta)


def test_an_arena_dropped_with_leases_held_is_collected(arena_type: type[CpuArena]) -> None:
    """Leases and their arena reference each other while held: the cycle is the garbage collector's to free
    (the compiled lease type takes part in collection)."""
    cpu = arena_type(SharedSlots.create(arena_name(), 3, SLOT_BYTES, prefault=False), block_size=4)
    metas, _ = make_blocks(3)
    leases = cpu.reserve_many(metas)
    assert all(lease is not None for lease in leases)
    cpu.slots.close()
    gone = weakref.ref(cpu)
    del cpu, leases
    gc.collect()
    assert gone() is None


def store(cpu: CpuArena, meta: BlockMeta, fill: int) -> int:
    lease = cpu.reserve(meta)
    assert lease is not None
    cpu.slots.tensor[lease.slot].fill_(fill)
    cpu.commit(lease.lease_id)
    cpu.check_invariants()
    return lease.slot


def test_a_batch_takes_free_slots_in_ascending_runs_and_drops_evict_without_leases(arena_type: type[CpuArena]) -> None:
    cpu = arena_type(SharedSlots.create(arena_name(), 8, SLOT_BYTES, prefault=False), block_size=4)
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


def test_a_read_lease_outliving_its_block_frees_its_slot_even_after_the_block_is_stored_again(
    arena: CpuArena,
) -> None:
    metas, _ = make_blocks(1)
    first = store(arena, metas[0], 1)
    (reader,) = arena.acquire_prefix(metas)
    assert arena.remove(metas[0].block_hash)  # detached: the reader still copies out of the old slot
    again = store(arena, metas[0], 2)
    assert again != first and arena.num_free_slots == 1
    arena.release_many([reader.lease_id])
    assert arena.num_free_slots == 2 and first in arena._free and arena.lru_hashes() == [metas[0].block_hash]
    arena.check_invariants()


def test_a_prefix_ends_before_a_block_with_other_tokens_or_another_parent(arena: CpuArena) -> None:
    metas, _ = make_blocks(3)
    for fill, meta in enumerate(metas[:3]):
        store(arena, meta, fill)
    other_tokens = BlockMeta(metas[1].block_hash, metas[1].parent_hash, (9, 9, 9, 9))
    other_parent = BlockMeta(metas[1].block_hash, 12345, metas[1].token_ids)
    for impostor in (other_tokens, other_parent):
        assert [slot for slot, _ in arena.match_prefix([metas[0], impostor, metas[2]])] == [0]
        (lease,) = arena.acquire_prefix([metas[0], impostor, metas[2]])
        assert lease.meta is metas[0] and arena.num_collisions == 0  # counted by acquire(), once
        lease.release()
    assert len(arena.acquire_prefix(metas)) == 3


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
    arena_type: type[CpuArena] = CpuArena

    def __init__(self) -> None:
        super().__init__()
        self.cpu = self.arena_type(SharedSlots.create(arena_name(), 3, SLOT_BYTES, prefault=False), block_size=4)
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


class PythonLoopsArenaMachine(ArenaMachine):
    arena_type = PythonLoopsArena


TestPythonLoopsArenaMachine = PythonLoopsArenaMachine.TestCase
TestPythonLoopsArenaMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


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


# --------------------------------------------------------------------------- the two loops in lockstep


def _seen(answer: Any) -> Any:
    """An answer in comparable form: leases by their fields, lists item by item."""
    if isinstance(answer, Lease):
        return (answer.lease_id, answer.slot, answer.meta, answer.kind, answer.granted_at)
    if isinstance(answer, list):
        return [_seen(item) for item in answer]
    return answer


class LockstepMachine(RuleBasedStateMachine):
    """The compiled and the Python batch loops, driven with the same calls, give the same answers, raise the
    same errors and leave the same state: slots, pins, LRU order, free-list order, leases and events."""

    blocks = make_blocks(8)[0]
    # Same hash and parent as a stored block, other tokens (or same tokens, another parent): collisions.
    impostors = [BlockMeta(meta.block_hash, meta.parent_hash, (7, 7, 7, 7)) for meta in blocks[:4]] + [
        BlockMeta(meta.block_hash, 12345, meta.token_ids) for meta in blocks[4:]
    ]

    def __init__(self) -> None:
        super().__init__()
        self.twins: list[CpuArena] = [
            kind(SharedSlots.create(arena_name(), 4, SLOT_BYTES, prefault=False), block_size=4)
            for kind in (CpuArena, PythonLoopsArena)
        ]
        self.held: list[int] = []  # lease ids live in both

    def _both(self, call: Callable[[CpuArena], Any]) -> Any:
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
        status, leases = answer
        if status == "ok":
            self.held += [lease[0] for lease in leases if lease is not None]

    def _ended(self, answer: Any, ids: list[int]) -> None:
        if answer[0] == "ok":
            self.held = [lease_id for lease_id in self.held if lease_id not in ids]

    @rule(indices=st.lists(st.integers(0, 7), max_size=5))
    def reserve_many(self, indices: list[int]) -> None:
        self._track(self._both(lambda cpu: cpu.reserve_many([self.blocks[i] for i in indices])))

    @rule(indices=st.lists(st.integers(0, 7), max_size=5))
    def store_many(self, indices: list[int]) -> None:
        answer = self._both(lambda cpu: cpu.reserve_many([self.blocks[i] for i in indices]))
        ids = [lease[0] for lease in answer[1] if lease is not None]
        self._both(lambda cpu: cpu.commit_many(ids))

    @rule(indices=st.lists(st.integers(0, 7), max_size=5), impostor=st.none() | st.integers(0, 4))
    def acquire_prefix(self, indices: list[int], impostor: int | None) -> None:
        self._track(self._both(lambda cpu: cpu.acquire_prefix(self._metas(indices, impostor))))

    @rule(index=st.integers(0, 7), impostor=st.booleans())
    def acquire(self, index: int, impostor: bool) -> None:
        meta = self.impostors[index] if impostor else self.blocks[index]
        answer = self._both(lambda cpu: cpu.acquire(meta))
        self._track((answer[0], [answer[1]]))

    @rule(picks=st.lists(st.integers(0, 50), max_size=4), extra=st.none() | st.sampled_from([0, 999, -1]))
    def commit_many(self, picks: list[int], extra: int | None) -> None:
        ids = self._ids(picks, extra)
        self._ended(self._both(lambda cpu: cpu.commit_many(ids)), ids)

    @rule(picks=st.lists(st.integers(0, 50), max_size=4), extra=st.none() | st.sampled_from([0, 999, -1]))
    def release_many(self, picks: list[int], extra: int | None) -> None:
        ids = self._ids(picks, extra)
        self._ended(self._both(lambda cpu: cpu.release_many(ids)), ids)

    @rule(count=st.integers(0, 5))
    def drop_lru(self, count: int) -> None:
        self._both(lambda cpu: cpu.drop_lru(count))

    @rule(count=st.integers(1, 3), keep_odd=st.booleans())
    def evict_lru(self, count: int, keep_odd: bool) -> None:
        self._track(
            self._both(lambda cpu: cpu.evict_lru(count, keep=lambda block_hash: keep_odd and block_hash % 2 == 1))
        )

    @rule(index=st.integers(0, 7))
    def remove(self, index: int) -> None:
        self._both(lambda cpu: cpu.remove(self.blocks[index].block_hash))

    @invariant()
    def same_state(self) -> None:
        states = []
        for cpu in self.twins:
            cpu.check_invariants()
            states.append(
                (
                    cpu.lru_hashes(),
                    list(cpu._free),
                    list(cpu._leases),
                    list(cpu._meta),
                    dict(cpu._writing),
                    {lease_id: _seen(lease) for lease_id, lease in cpu._held.items()},
                    cpu.num_leased_slots,
                    cpu.num_evictions,
                    cpu.num_collisions,
                    cpu.take_events(),
                )
            )
        assert states[0] == states[1]
        assert sorted(self.held) == sorted(self.twins[0]._held)

    def teardown(self) -> None:
        for cpu in self.twins:
            cpu.close()


TestLockstepMachine = LockstepMachine.TestCase
TestLockstepMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
