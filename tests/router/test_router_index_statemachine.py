"""Property test: the index against a plain model, over random store/remove/clear/reset sequences.

The model keeps, per (producer, medium), a multiset of hashes, and answers
lookups by brute force: for every replica, walk the query and take each
block's best medium among the sources that serve that replica.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvstore.router.index import PrefixIndex
from kvstore.router.index_lookup import MediumCounts

# producer -> (kind, media it may publish, replicas it serves per medium)
GPU_PRODUCERS = {"w0": ("r0", "a"), "w1": ("r1", "a"), "w2": ("r2", "b")}
TIERS = {"tier-a": ("a", False), "tier-b": ("b", True)}  # tier-b's disk is shared by the cluster
MEDIA = ("GPU", "CPU", "STORAGE")
HASHES = st.integers(min_value=1, max_value=6)


def serves(producer: str, medium: str) -> set[str]:
    if producer in GPU_PRODUCERS:
        return {GPU_PRODUCERS[producer][0]}
    node, shared = TIERS[producer]
    if medium == "STORAGE" and shared:
        return {replica for replica, _ in GPU_PRODUCERS.values()}
    return {replica for replica, n in GPU_PRODUCERS.values() if n == node}


def allowed_media(producer: str) -> tuple[str, ...]:
    return MEDIA if producer in GPU_PRODUCERS else MEDIA[1:]


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        for producer in [*GPU_PRODUCERS, *TIERS]:
            self._register(producer)
        self.model: dict[tuple[str, str], Counter[int]] = {}
        self.seq = 0

    def _register(self, producer: str) -> None:
        if producer in GPU_PRODUCERS:
            replica, node = GPU_PRODUCERS[producer]
            self.index.add_producer(producer, "gpu", [replica], node)
        else:
            node, shared = TIERS[producer]
            self.index.add_producer(producer, "tier", node=node, shared_storage=shared)

    def _apply(self, producer: str, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self.index.apply_batch(producer, self.seq, EventBatch(0.0, list(events)))
        self.seq += 1

    @rule(
        producer=st.sampled_from(sorted([*GPU_PRODUCERS, *TIERS])),
        medium_index=st.integers(0, 2),
        parent=st.none() | HASHES,
        hashes=st.lists(HASHES, min_size=1, max_size=5),
    )
    def store(self, producer: str, medium_index: int, parent: int | None, hashes: list[int]) -> None:
        media = allowed_media(producer)
        medium = media[medium_index % len(media)]
        self._apply(
            producer,
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium=medium,
                lora_name=None,
            ),
        )
        self.model.setdefault((producer, medium), Counter()).update(hashes)

    @rule(
        producer=st.sampled_from(sorted([*GPU_PRODUCERS, *TIERS])),
        medium_index=st.integers(0, 2),
        hashes=st.lists(HASHES, min_size=1, max_size=4),
    )
    def remove(self, producer: str, medium_index: int, hashes: list[int]) -> None:
        media = allowed_media(producer)
        medium = media[medium_index % len(media)]
        self._apply(producer, BlockRemoved(block_hashes=hashes, medium=medium))
        held = self.model.setdefault((producer, medium), Counter())
        for h in hashes:
            if held[h] > 0:
                held[h] -= 1
        held += Counter()  # drop zero counts

    @rule(producer=st.sampled_from(sorted([*GPU_PRODUCERS, *TIERS])), via_event=st.booleans())
    def clear(self, producer: str, via_event: bool) -> None:
        if via_event:
            self._apply(producer, AllBlocksCleared())
        else:
            self.index.reset_producer(producer)
        for medium in MEDIA:
            self.model.pop((producer, medium), None)

    @rule(producer=st.sampled_from(sorted([*GPU_PRODUCERS, *TIERS])))
    def reregister(self, producer: str) -> None:
        """Remove a producer (its blocks, and a gpu producer's replica) and register it again: slots get reused."""
        assert self.index.remove_producer(producer)
        self.index.check_invariants()
        self._register(producer)
        for medium in MEDIA:
            self.model.pop((producer, medium), None)

    @rule(query=st.lists(HASHES, min_size=1, max_size=8))
    def lookup(self, query: list[int]) -> None:
        expected: dict[str, MediumCounts] = {}
        for replica, _ in GPU_PRODUCERS.values():
            counts = [0, 0, 0]
            for h in query:
                best = next(
                    (
                        i
                        for i, medium in enumerate(MEDIA)
                        if any(
                            held[h] > 0 and m == medium and replica in serves(p, m)
                            for (p, m), held in self.model.items()
                        )
                    ),
                    None,
                )
                if best is None:
                    break
                counts[best] += 1
            if sum(counts):
                expected[replica] = MediumCounts(*counts)
        assert self.index.lookup(query) == expected

    @invariant()
    def matches_model(self) -> None:
        self.index.check_invariants()
        want: dict[str, dict[str, Counter[int]]] = {}
        for (producer, medium), held in self.model.items():
            if +held:
                want.setdefault(producer, {})[medium] = +held
        assert self.index.dump() == want


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
