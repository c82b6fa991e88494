"""A worker's side (TierLink) over an in-process tier (LocalTierClient): spill and promote through the arena."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tiers_helpers import IDENTITY, AnswersInFlight, arena_name, hashes, linked_tier, make_blocks, tier_config

from kvstore.tiers.blocks import BlockMeta, SlotGrant
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.errors import InvalidBlockError, LeaseError, TierError, TierTimeoutError
from kvstore.tiers.link import MAX_UNANSWERED, Promoted, TierLink


def test_spill_then_promote_into_other_pool_blocks(tmp_path: Path) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=3, disk_blocks=32), IDENTITY, arena_name=arena_name())
    link = TierLink(client, IDENTITY)
    try:
        metas, data = make_blocks(5)
        pool = torch.zeros((10, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
        pool[[6, 2, 8, 0, 4]] = data
        assert link.spill(metas, pool, [6, 2, 8, 0, 4]) == 5
        assert link.lookup(hashes(metas)) == (5, ("STORAGE", "STORAGE", "CPU", "CPU", "CPU"))
        assert link.spill(metas[4:], pool, [4]) == 0  # held in CPU already

        other = torch.zeros_like(pool)
        free = [9, 8, 7, 6, 5]
        chunks: list[int] = []

        def allocate(count: int) -> Sequence[int]:
            chunks.append(count)
            return [free.pop(0) for _ in range(count)]

        promoted = link.promote(metas, other, allocate)
        assert chunks == [3, 2]  # a 3-slot arena: the prefix comes in two chunks
        assert promoted.block_ids == (9, 8, 7, 6, 5)
        assert torch.equal(other[[9, 8, 7, 6, 5]], data)
        # Promoting 0 and 1 pushed 3 and 4 out of the 3-slot arena (written back), so they come from disk.
        assert promoted.media == ("STORAGE", "STORAGE", "CPU", "STORAGE", "STORAGE")
        client.check_invariants()
    finally:
        link.close()
        client.close()


class LateCommits:
    """A client whose commits sent without waiting run only when their answer is asked for.

    That is what an async tier actor may do: run a caller's later call (the next chunk's reserve)
    before an earlier one it was sent (the last chunk's commit).
    """

    ordered = False  # it runs a commit after the reserve sent behind it

    def __init__(self, client: LocalTierClient) -> None:
        self.client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        self.calls.append("reserve")
        return self.client.reserve(blocks, arena)

    def commit_later(self, lease_ids: Sequence[int]) -> Any:
        outer = self

        class Late:
            def done(self) -> bool:
                return False

            def result(self) -> int:
                outer.calls.append("commit")
                return outer.client.commit(lease_ids)

        return Late()


def test_a_spill_larger_than_the_arena_waits_for_each_chunks_commit_before_the_next_reserve(
    tmp_path: Path,
) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=3, disk_blocks=32), IDENTITY, arena_name=arena_name())
    late = LateCommits(client)
    link = TierLink(late, IDENTITY)  # type: ignore[arg-type]  # a TierClient by its methods
    try:
        metas, data = make_blocks(8)
        # A reserve run before the last chunk's commit would find all 3 slots write-leased and grant
        # nothing: the chunk's blocks would be lost. Every block is stored.
        assert link.spill(metas, data, range(8)) == 8
        assert late.calls == ["reserve", "commit", "reserve", "commit", "reserve"]
        link.settle()
        assert link.lookup(hashes(metas)) == (8, ("STORAGE",) * 5 + ("CPU",) * 3)
        assert client.store.stats().not_stored == {"CPU": {}, "STORAGE": {}}
        client.check_invariants()
    finally:
        link.close()
        client.close()


def test_a_reserve_answer_of_the_wrong_length_is_a_tier_error_and_its_grants_are_released(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=4)) as (client, link):
        metas, data = make_blocks(3)
        reserve = client.reserve
        client.reserve = lambda blocks, arena=None: reserve(blocks, arena)[:-1]  # type: ignore[method-assign]
        with pytest.raises(TierError, match="2 grants for 3 blocks"):
            link.spill(metas, data, range(3))
        # The two grants it saw are given back; the one the answer lost stays with the tier, never copied into.
        assert client.store.cpu.num_leased_slots == 1 and client.store.cpu.num_blocks == 0
        client.store.check_invariants()


def test_failed_allocation_releases_the_leases(tmp_path: Path) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=4), IDENTITY, arena_name=arena_name())
    link = TierLink(client, IDENTITY)
    try:
        metas, data = make_blocks(2)
        link.spill(metas, data, [0, 1])

        def no_room(count: int) -> Sequence[int]:
            raise MemoryError("pool is full")

        with pytest.raises(MemoryError):
            link.promote(metas, data, no_room)
        assert client.store.cpu.num_leased_slots == 0
        client.check_invariants()
        assert link.promote(make_blocks(1, first_token=99)[0], data, no_room) == Promoted((), ())
    finally:
        link.close()
        client.close()


def test_a_pool_that_does_not_fit_is_the_callers_error_and_leaves_no_lease(tmp_path: Path) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=4), IDENTITY, arena_name=arena_name())
    link = TierLink(client, IDENTITY)
    try:
        metas, data = make_blocks(2)
        with pytest.raises(InvalidBlockError, match="row 2"):  # a row beyond the pool
            link.spill(metas, data, [0, 2])
        with pytest.raises(InvalidBlockError, match="bytes"):  # blocks of another size
            link.spill(metas, torch.zeros((2, 10)), [0, 1])
        with pytest.raises(ValueError, match="2 blocks but 1 block ids"):
            link.spill(metas, data, [0])
        assert link.spill(metas, data, [0, 1]) == 2  # the refused calls stored nothing
        with pytest.raises(InvalidBlockError, match="row 5"):
            link.promote(metas, data, lambda n: [5, 0][:n])
        with pytest.raises(ValueError, match="returned 1 block ids"):
            link.promote(metas, data, lambda n: [0])
        assert client.store.cpu.num_leased_slots == 0
        client.check_invariants()
    finally:
        link.close()
        client.close()


def test_commit_and_release_are_not_waited_for_but_ordered_before_later_calls(tmp_path: Path) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=8), IDENTITY, arena_name=arena_name())
    link = TierLink(client, IDENTITY)
    try:
        metas, data = make_blocks(4)
        assert link.spill(metas, data, range(4)) == 4
        # No settle: the commit was sent before this lookup, so the tier answers it first.
        assert client.lookup(hashes(metas)) == (4, ("CPU",) * 4)
        target = torch.zeros_like(data)
        assert link.promote(metas, target, lambda n: list(range(n))).block_ids == (0, 1, 2, 3)
        assert torch.equal(target, data)
        client.check_invariants()  # sent after the release: no lease is left
        assert client.store.cpu.num_leased_slots == 0
    finally:
        link.close()
        client.close()


def test_an_error_of_a_commit_sent_without_waiting_is_reported_by_collect_not_by_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=8), IDENTITY, arena_name=arena_name())
    link = TierLink(client, IDENTITY)
    try:
        assert link.ordered  # a store with no disk answers on the caller's thread
        metas, data = make_blocks(3)
        store = client.store

        async def refused(lease_ids: Sequence[int]) -> int:
            raise LeaseError("injected: the tier does not know these leases")

        monkeypatch.setattr(store, "commit", refused)
        assert link.spill(metas[:2], data, [0, 1]) == 2  # returned after the copy; the commit's answer is in
        assert link.lookup(hashes(metas)) == (0, ())  # an earlier call's error is not this call's
        monkeypatch.undo()
        [(op, error)] = link.collect()
        assert op == "commit" and isinstance(error, LeaseError) and "injected" in str(error)
        assert link.collect() == []  # reported once
        client.release(store.cpu.lease_ids())  # the refused commit's write leases
        assert link.spill(metas[2:], data, [2]) == 1
        assert link.lookup(hashes(metas[2:])) == (1, ("CPU",))
        client.check_invariants()
    finally:
        link.close()
        client.close()


@contextmanager
def in_flight(
    tmp_path: Path, *, cpu_blocks: int, ordered: bool
) -> Iterator[tuple[LocalTierClient, AnswersInFlight, TierLink]]:
    """A link over an :class:`AnswersInFlight` client of a real in-process store with ``cpu_blocks`` slots."""
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=cpu_blocks), IDENTITY, arena_name=arena_name())
    tier = AnswersInFlight(client, ordered=ordered)
    link = TierLink(tier, IDENTITY)  # type: ignore[arg-type]  # a TierClient by its methods
    try:
        yield client, tier, link
    finally:
        link.close()
        client.close()


def test_on_an_ordered_client_no_call_waits_for_an_earlier_answer(tmp_path: Path) -> None:
    with in_flight(tmp_path, cpu_blocks=3, ordered=True) as (client, tier, link):
        assert link.ordered
        metas, data = make_blocks(5)
        # Five blocks through a 3-slot arena: two chunks, the second's reserve sent with the first's commit
        # still unanswered -- the tier ran that commit first, so its slots are free to evict.
        assert link.spill(metas, data, range(5)) == 5
        assert link.spill(metas[:1], data, [0]) == 1  # evicted, spilled again: behind another unanswered commit
        target = torch.zeros_like(data)
        # The arena holds blocks 3, 4 and 0 now (1 and 2 evicted).
        assert link.promote(metas[3:], target, lambda n: [3, 4][:n]).block_ids == (3, 4)
        assert torch.equal(target[3:], data[3:])
        assert tier.calls == ["reserve", "reserve", "reserve", "acquire"]  # never a wait
        assert len(link.collect()) == 0 and len(link._pending) == 4  # nothing arrived: nothing collected
        tier.arrive()
        assert link.collect() == [] and link._pending == []
        client.check_invariants()


def test_on_an_unordered_client_each_chunk_waits_for_the_answers_before_it(tmp_path: Path) -> None:
    with in_flight(tmp_path, cpu_blocks=3, ordered=False) as (_client, tier, link):
        metas, data = make_blocks(5)
        assert link.spill(metas, data, range(5)) == 5
        assert tier.calls == ["reserve", "waited for commit", "reserve"]
        assert link.lookup(hashes(metas)) == (0, ())  # the first three were evicted by the second chunk
        assert tier.calls[-1] == "waited for commit"


def test_on_an_ordered_client_an_earlier_calls_error_never_fails_a_later_call(tmp_path: Path) -> None:
    with in_flight(tmp_path, cpu_blocks=3, ordered=True) as (_client, tier, link):
        metas, data = make_blocks(6)
        tier.refuse = LeaseError("injected: refused")
        assert link.spill(metas[:1], data, [0]) == 1
        tier.arrive()  # the refusal is in before the next spill, and before each of its chunks
        assert link.spill(metas[1:], data, range(1, 6)) == 5  # two chunks through 3 slots: neither raises it
        tier.arrive()
        errors = link.collect()
        assert [(op, str(exc)) for op, exc in errors] == [("commit", "injected: refused")]
        tier.refuse = LeaseError("injected: again")
        assert link.spill(metas[:1], data, [0]) == 1
        tier.refuse = LeaseError("injected: a third time")
        assert link.spill(metas[1:2], data, [1]) == 1
        with pytest.raises(LeaseError, match="again"):  # settle() waits for the answers and raises the first
            link.settle()
        [(op, error)] = link.collect()  # the other is kept, not lost
        assert op == "commit" and "third" in str(error)
        assert link.collect() == []


def test_on_an_unordered_client_an_earlier_calls_error_is_raised_before_the_next_call_does_anything(
    tmp_path: Path,
) -> None:
    with in_flight(tmp_path, cpu_blocks=8, ordered=False) as (_client, tier, link):
        metas, data = make_blocks(2)
        tier.refuse = LeaseError("injected: refused")
        assert link.spill(metas[:1], data, [0]) == 1
        with pytest.raises(LeaseError, match="injected"):
            link.spill(metas[1:], data, [1])
        assert tier.calls == ["reserve", "waited for commit"]  # it raised before it reserved


def test_on_an_ordered_client_an_answer_that_never_comes_is_waited_for_past_the_bound(tmp_path: Path) -> None:
    with in_flight(tmp_path, cpu_blocks=64, ordered=True) as (_client, tier, link):
        metas, data = make_blocks(MAX_UNANSWERED + 2)
        for index in range(MAX_UNANSWERED + 2):
            assert link.spill(metas[index : index + 1], data, [index]) == 1
        # Never arrived: each call past the bound waited for the oldest (here its answer is read at once).
        assert tier.calls.count("waited for commit") == 2  # the 33rd and 34th calls
        assert len(link._pending) == MAX_UNANSWERED


def test_a_wait_that_finds_the_tier_gone_does_not_wait_again_for_the_answers_behind_it(tmp_path: Path) -> None:
    with in_flight(tmp_path, cpu_blocks=8, ordered=True) as (_client, tier, link):
        metas, data = make_blocks(3)
        tier.refuse = TierTimeoutError("injected: no answer in time")
        for index in range(3):
            assert link.spill(metas[index : index + 1], data, [index]) == 1
        errors = link.collect(wait=True)
        assert [type(exc) for _, exc in errors] == [TierTimeoutError]
        assert tier.calls.count("waited for commit") == 1  # the two behind it were dropped, not waited for
        assert link._pending == []
