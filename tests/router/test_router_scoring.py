"""Scoring: the cost formula, tie breaking, temperature, and routing over a real index."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from kvstore.benchmarks.simulate.replica import BlockCache, Publish
from kvstore.config import CacheConfig
from kvstore.events import EventBatch, KVEvent
from kvstore.hashing import BlockHasher, to_external
from kvstore.router.config import RouterConfig
from kvstore.router.index import PrefixIndex
from kvstore.router.index_lookup import MediumCounts
from kvstore.router.load import PrefillLoad
from kvstore.router.scoring import ReplicaState, Scorer

IDLE = ReplicaState()


def test_cost_formula_uses_every_configured_weight() -> None:
    config = RouterConfig(
        gpu_hit_credit=1.0,
        cpu_hit_credit=0.75,
        storage_hit_credit=0.25,
        prefill_weight=2.0,
        outstanding_weight=0.5,
        running_weight=10.0,
        waiting_weight=20.0,
        kv_usage_weight=100.0,
    )
    scorer = Scorer(config, block_size=16)
    state = ReplicaState(outstanding_tokens=1000, running_requests=3, waiting_requests=2, kv_usage=0.5)
    # 10 blocks, credit 2 + 0.75*4 + 0.25*4 = 6 -> 4 blocks = 64 tokens to prefill.
    expected = 2.0 * 64 + 0.5 * 1000 + 10.0 * 3 + 20.0 * 2 + 100.0 * 0.5
    assert scorer.cost(state, MediumCounts(2, 4, 4), 10) == pytest.approx(expected)
    assert scorer.cost(IDLE, MediumCounts(10, 0, 0), 8) == 0.0  # never negative


def test_best_medium_wins_and_load_can_outweigh_a_hit() -> None:
    scorer = Scorer(RouterConfig(), block_size=16)
    matches = {"gpu": MediumCounts(8, 0, 0), "cpu": MediumCounts(0, 8, 0), "disk": MediumCounts(0, 0, 8)}
    states = {name: IDLE for name in [*matches, "cold"]}
    decision = scorer.choose(states, matches, 10, random.Random(0))
    assert decision.replica == "gpu" and decision.matched == MediumCounts(8, 0, 0) and decision.cached_blocks == 8
    assert decision.scores["gpu"] < decision.scores["cpu"] < decision.scores["disk"] < decision.scores["cold"]
    busy = dict(states, gpu=ReplicaState(outstanding_tokens=10_000))
    assert scorer.choose(busy, matches, 10, random.Random(0)).replica == "cpu"


def test_ties_are_broken_at_random_and_non_candidates_ignored() -> None:
    scorer = Scorer(RouterConfig(), block_size=16)
    matches = {"a": MediumCounts(4, 0, 0), "b": MediumCounts(4, 0, 0), "gone": MediumCounts(9, 0, 0)}
    states = {"a": IDLE, "b": IDLE, "c": IDLE}
    picks = Counter(scorer.choose(states, matches, 9, random.Random(seed)).replica for seed in range(200))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 60
    with pytest.raises(ValueError, match="no candidate"):
        scorer.choose({}, matches, 9, random.Random(0))


def test_temperature_samples_by_normalised_cost() -> None:
    scorer = Scorer(RouterConfig(temperature=0.5), block_size=16)
    matches = {"hot": MediumCounts(10, 0, 0)}
    states = {"hot": IDLE, "cold": IDLE}
    picks = Counter(scorer.choose(states, matches, 10, random.Random(seed)).replica for seed in range(2000))
    # Normalised costs 0 and 1: P(cold) = e^-2 / (1 + e^-2) ~ 0.12.
    assert picks["cold"] / 2000 == pytest.approx(math.exp(-2) / (1 + math.exp(-2)), abs=0.03)


def test_prefix_groups_concentrate_on_their_replica_while_load_stays_balanced() -> None:
    """8 prefix groups over 4 replicas, through the real index fed by real pools' events.

    The replicas run at about 65% of their capacity, so load matters: a group
    whose replica falls behind may spill part of its requests to a second
    one, but nearly all requests stay with their group's replica.
    """
    block_size = 16
    hasher = BlockHasher.from_config(CacheConfig(block_size=block_size))
    index = PrefixIndex(CacheConfig(block_size=block_size))
    scorer = Scorer(RouterConfig(), block_size)
    names = [f"r{i}" for i in range(4)]
    loads = {name: PrefillLoad(tokens_per_s=1000.0) for name in names}  # the router's view of each queue
    work = dict.fromkeys(names, 0)
    caches: dict[str, BlockCache] = {}
    for name in names:
        index.add_producer(name, "gpu", [name], "node")
        caches[name] = BlockCache(4096, block_size, _publisher(index, name))
    rng = random.Random(7)
    groups = [[rng.randrange(50_000) for _ in range(32 * block_size)] for _ in range(8)]
    placements: dict[int, Counter[str]] = {g: Counter() for g in range(8)}
    for i in range(480):
        now = i * 0.05
        group = rng.randrange(8)
        tokens = groups[group] + [rng.randrange(50_000) for _ in range(4 * block_size)]
        digests = hasher.hash_blocks(tokens)
        states = {n: ReplicaState(load.outstanding(now)) for n, load in loads.items()}
        decision = scorer.choose(states, index.lookup([to_external(d) for d in digests]), len(digests), rng)
        hits = caches[decision.replica].serve(digests, tokens)
        assert hits == decision.cached_blocks, "the index predicted the replica's real cache"
        loads[decision.replica].dispatched(len(tokens) - hits * block_size + 64, now)
        work[decision.replica] += len(tokens) - hits * block_size + 64
        if i >= 80:
            placements[group][decision.replica] += 1
    at_home = 0
    for group, where in placements.items():
        top = where.most_common(1)[0][1]
        assert top / sum(where.values()) > 0.5, f"group {group} spread over {dict(where)}"
        at_home += top
    assert at_home / sum(sum(where.values()) for where in placements.values()) >= 0.9
    assert len({where.most_common(1)[0][0] for where in placements.values()}) == 4, "every replica holds a group"
    assert max(work.values()) / (sum(work.values()) / len(work)) <= 1.5, work


def _publisher(index: PrefixIndex, name: str) -> Publish:
    seq = iter(range(1 << 62))

    def publish(events: list[KVEvent]) -> None:
        index.apply_batch(name, next(seq), EventBatch(0.0, events))

    return publish
