"""PrefixIndex scenarios: exact state after hand-written event sequences."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from kvstore.config import CacheConfig
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvstore.hashing import BlockHasher, HashMemo, to_external
from kvstore.router.index import PrefixIndex
from kvstore.router.index_lookup import NO_MATCH, MediumCounts
from kvstore.router.routing import Prompt, _block_hashes


def stored(hashes: list[int], parent: int | None = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[0] * 16 * len(hashes),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes: list[int], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


def apply(index: PrefixIndex, producer: str, *events: KVEvent) -> None:
    index.apply_batch(producer, 0, EventBatch(0.0, list(events)))
    index.check_invariants()


@pytest.fixture
def index() -> PrefixIndex:
    """Three workers (w0, w1 on node a; w2 on node b) and a tier actor on node a."""
    index = PrefixIndex()
    index.add_producer("w0", "gpu", ["r0"], "a")
    index.add_producer("w1", "gpu", ["r1"], "a")
    index.add_producer("w2", "gpu", ["r2"], "b")
    index.add_producer("tier-a", "tier", node="a")
    return index


def test_gpu_prefixes_per_replica(index: PrefixIndex) -> None:
    apply(index, "w0", stored([1, 2, 3]))
    apply(index, "w1", stored([1, 2]))
    apply(index, "w2", stored([1]), stored([9], parent=1))
    assert index.lookup([1, 2, 3, 4]) == {
        "r0": MediumCounts(3, 0, 0),
        "r1": MediumCounts(2, 0, 0),
        "r2": MediumCounts(1, 0, 0),
    }
    one = MediumCounts(1, 0, 0)
    assert index.lookup([1, 9]) == {"r0": one, "r1": one, "r2": MediumCounts(2, 0, 0)}
    assert index.lookup([7, 1]) == {}
    assert index.lookup([]) == {}
    assert len(index) == 4
    # Branches are separate prefixes: r0 holds 3 but not 9, so its prefix ends at 9.
    assert index.lookup([1, 9, 3]) == {"r0": one, "r1": one, "r2": MediumCounts(2, 0, 0)}


def test_prefix_ends_at_first_block_no_medium_holds(index: PrefixIndex) -> None:
    # r0 has blocks 1 and 3 but not 2: its prefix is 1 block, even though 3 is cached.
    apply(index, "w0", stored([1]), stored([3], parent=2))
    assert index.lookup([1, 2, 3]) == {"r0": MediumCounts(1, 0, 0)}


def test_tier_blocks_count_for_every_replica_of_its_node(index: PrefixIndex) -> None:
    apply(index, "w0", stored([1, 2]))
    apply(index, "tier-a", stored([1, 2, 3, 4], medium="CPU"), stored([5], parent=4, medium="STORAGE"))
    assert index.lookup([1, 2, 3, 4, 5, 6]) == {
        "r0": MediumCounts(2, 2, 1),  # best medium per block: GPU for 1-2, then CPU, then disk
        "r1": MediumCounts(0, 4, 1),
    }  # r2 is on node b: the tier of node a does not serve it
    index.add_producer("w3", "gpu", ["r3"], "a")  # a replica joining node a is served at once
    assert index.lookup([1, 2, 3])["r3"] == MediumCounts(0, 3, 0)


def test_shared_storage_serves_the_whole_cluster() -> None:
    index = PrefixIndex()
    index.add_producer("w0", "gpu", ["r0"], "a")
    index.add_producer("w1", "gpu", ["r1"], "b")
    index.add_producer("tier-a", "tier", node="a", shared_storage=True)
    apply(index, "tier-a", stored([1, 2], medium="STORAGE"), stored([1], medium="CPU"))
    assert index.lookup([1, 2]) == {"r0": MediumCounts(0, 1, 1), "r1": MediumCounts(0, 0, 2)}


def test_explicit_tier_replicas_and_gpu_producer_cpu_medium() -> None:
    index = PrefixIndex()
    index.add_producer("w0", "gpu", ["r0"], "a")
    index.add_producer("w1", "gpu", ["r1"], "a")
    index.add_producer("offload", "tier", ["r1"])
    apply(index, "offload", stored([1], medium="CPU"))
    apply(index, "w0", stored([1], medium="CPU"))  # a vLLM server offloading to its own CPU memory
    assert index.lookup([1]) == {"r0": MediumCounts(0, 1, 0), "r1": MediumCounts(0, 1, 0)}
    apply(index, "w0", removed([1], medium="cpu"))  # media are case-insensitive
    assert index.lookup([1]) == {"r1": MediumCounts(0, 1, 0)}


def test_duplicate_stores_are_reference_counted(index: PrefixIndex) -> None:
    apply(index, "w0", stored([1, 2]), stored([1, 2]), stored([2], parent=1))
    assert index.dump() == {"w0": {"GPU": Counter({1: 2, 2: 3})}}
    apply(index, "w0", removed([2]), removed([2]), removed([1]))
    assert index.dump() == {"w0": {"GPU": Counter({1: 1, 2: 1})}}
    assert index.lookup([1, 2]) == {"r0": MediumCounts(2, 0, 0)}
    apply(index, "w0", removed([2]))
    assert index.lookup([1, 2]) == {"r0": MediumCounts(1, 0, 0)}
    apply(index, "w0", removed([1]))
    assert index.lookup([1, 2]) == {} and len(index) == 0
    apply(index, "w0", removed([1]))  # one too many: counted, harmless
    assert index.stats().per_producer["w0"].unknown_removals == 1


def test_reset_and_clear_touch_only_that_producer(index: PrefixIndex) -> None:
    apply(index, "w0", stored([1, 2, 3]))
    apply(index, "w1", stored([1, 2]))
    apply(index, "tier-a", stored([1, 2, 3], medium="CPU"))
    index.reset_producer("w0")
    index.check_invariants()
    assert index.dump() == {"w1": {"GPU": Counter({1: 1, 2: 1})}, "tier-a": {"CPU": Counter({1: 1, 2: 1, 3: 1})}}
    apply(index, "tier-a", AllBlocksCleared())
    assert index.dump() == {"w1": {"GPU": Counter({1: 1, 2: 1})}}
    assert index.lookup([1, 2, 3]) == {"r1": MediumCounts(2, 0, 0)}


def test_remove_producer_forgets_replica_and_blocks(index: PrefixIndex) -> None:
    apply(index, "w0", stored([1, 2]))
    apply(index, "w2", stored([1]))
    assert index.remove_producer("w0") is True
    assert index.remove_producer("w0") is False
    index.check_invariants()
    assert index.replicas() == ["r1", "r2"]
    assert index.lookup([1, 2]) == {"r2": MediumCounts(1, 0, 0)}
    index.add_producer("w9", "gpu", ["r9"], "a")  # reuses r0's slot: must start empty
    assert index.lookup([1, 2]) == {"r2": MediumCounts(1, 0, 0)}


def test_blocks_outlive_their_parents_and_stay_removable(index: PrefixIndex) -> None:
    apply(index, "w0", stored([2], parent=1))  # the child first: found alone, but no prefix reaches it
    assert index.lookup([2]) == {"r0": MediumCounts(1, 0, 0)} and index.lookup([1, 2]) == {}
    apply(index, "w1", stored([1]))  # the parent appears on another replica
    assert index.lookup([1, 2]) == {"r1": MediumCounts(1, 0, 0)}
    apply(index, "w0", stored([1]))  # and on the child's replica: r0's prefix now spans both
    assert index.lookup([1, 2]) == {"r0": MediumCounts(2, 0, 0), "r1": MediumCounts(1, 0, 0)}
    apply(index, "w1", removed([1]), removed([1]))  # the second removal is of nothing w1 holds
    apply(index, "w0", removed([1]))  # the parent goes everywhere: its child is still indexed
    assert index.lookup([1, 2]) == {} and index.lookup([2]) == {"r0": MediumCounts(1, 0, 0)}
    assert len(index) == 1 and index.stats().per_producer["w1"].unknown_removals == 1
    apply(index, "w0", removed([2]))  # ...and still removable on its own
    assert len(index) == 0 and index.dump() == {}


def test_unusable_input_is_counted_not_raised(index: PrefixIndex) -> None:
    index.apply_batch("nobody", 0, EventBatch(0.0, [stored([1])]))
    apply(index, "tier-a", stored([1], medium="GPU"), stored([1], medium=None), stored([1], medium="TAPE"))
    apply(index, "w0", stored([5], parent=5))  # a self-parent is treated as a root
    stats = index.stats()
    assert stats.unknown_producer_batches == 1
    assert stats.per_producer["tier-a"].rejected_events == 3
    assert index.lookup([5]) == {"r0": MediumCounts(1, 0, 0)}
    assert stats.nodes == 1 and stats.per_producer["w0"].held_blocks == 1


def test_registration_errors() -> None:
    index = PrefixIndex()
    index.add_producer("w0", "gpu", ["r0"], "a")
    with pytest.raises(ValueError, match="already registered"):
        index.add_producer("w0", "gpu", ["r5"], "a")
    with pytest.raises(ValueError, match="already has a gpu producer"):
        index.add_producer("w1", "gpu", ["r0"], "a")
    with pytest.raises(ValueError, match="exactly one replica"):
        index.add_producer("w2", "gpu", ["r1", "r2"], "a")
    with pytest.raises(ValueError, match="needs its node"):
        index.add_producer("t", "tier")
    with pytest.raises(ValueError, match="kind"):
        index.add_producer("x", "disk", ["r3"])  # type: ignore[arg-type]
    assert index.producers() == ["w0"]


def test_lookup_at_many_replicas_is_per_replica_exact() -> None:
    index = PrefixIndex(CacheConfig())
    for r in range(1024):
        index.add_producer(f"w{r}", "gpu", [f"r{r}"], f"n{r // 8}")
        index.apply_batch(f"w{r}", 0, EventBatch(0.0, [stored(list(range(1, 2 + r % 32)))]))
    result = index.lookup(list(range(1, 40)))
    assert len(result) == 1024
    assert all(result[f"r{r}"] == MediumCounts(1 + r % 32, 0, 0) for r in range(1024))
    assert result.get("r-none", NO_MATCH) == NO_MATCH


def test_lookup_reads_hashes_no_further_than_the_first_block_nobody_holds(index: PrefixIndex) -> None:
    apply(index, "w0", stored([1, 2, 3]))
    apply(index, "w1", stored([1]))
    for tiered in (False, True):
        if tiered:
            apply(index, "tier-a", stored([1, 2], medium="CPU"))
        read: list[int] = []

        def lazily(hashes: list[int], read: list[int] = read) -> Iterator[int]:
            for h in hashes:
                read.append(h)
                yield h

        assert index.lookup(lazily([1, 2, 7, 8, 9]))["r0"] == MediumCounts(2, 0, 0)
        assert read == [1, 2, 7], "nothing past block 7, which no replica holds"
        read.clear()
        assert index.lookup(lazily([5, 1, 2])) == {} and read == [5]
        assert index.lookup(iter([])) == {}


@pytest.mark.parametrize(("lora", "salt"), [(None, None), ("adapter", None), (None, "tenant"), ("adapter", "tenant")])
def test_routing_hashes_a_prompt_as_the_hasher_does(lora: str | None, salt: str | None) -> None:
    hasher = BlockHasher.from_config(CacheConfig(block_size=4))
    tokens = list(range(50, 73))  # 5 full blocks and a partial one
    expected = [to_external(h) for h in hasher.hash_blocks(tokens, lora_name=lora, cache_salt=salt)]
    for capacity in (0, 64):  # no memo; a memo, asked twice (hashed, then remembered)
        memo = HashMemo(hasher, capacity)
        for _ in range(2):
            assert list(_block_hashes(memo, Prompt(tokens, salt, lora))) == expected
