"""Routing policies of the simulator: ours (the router's index and scorer) and baselines.

Every policy answers one question per request -- which replica -- from what
a router could know at that moment: the request, its block hashes, the
replicas' queues (and, for ours, the prefix index fed by the replicas' KV
events). ``global_cache`` uses :class:`LeastLoaded` for placement; its
shared cache is set up by the simulator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from router.index import PrefixIndex
from router.mooncake import MooncakeRequest
from router.scoring import ReplicaState, Scorer
from router.sim_replica import WorkQueue


class Choice(NamedTuple):
    replica: int  # index into the simulator's replicas
    predicted_blocks: int | None  # the prefix the policy expects to hit there (None: cache-blind)


class Policy(Protocol):
    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice: ...


class RoundRobin:
    def __init__(self, num_replicas: int) -> None:
        self._n = num_replicas
        self._next = 0

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        replica = self._next
        self._next = (replica + 1) % self._n
        return Choice(replica, None)


class RandomChoice:
    def __init__(self, num_replicas: int, rng: random.Random) -> None:
        self._n = num_replicas
        self._rng = rng

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        return Choice(self._rng.randrange(self._n), None)


class LeastLoaded:
    """Least outstanding work; ties at random."""

    def __init__(self, queues: Sequence[WorkQueue], rng: random.Random) -> None:
        self._queues = queues
        self._rng = rng

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        loads = [q.outstanding(now) for q in self._queues]
        low = min(loads)
        return Choice(self._rng.choice([i for i, load in enumerate(loads) if load <= low]), None)


class CacheAware:
    """Ours: the router's PrefixIndex lookup and Scorer, exactly as the router calls them."""

    def __init__(
        self,
        names: Sequence[str],
        queues: Sequence[WorkQueue],
        index: PrefixIndex,
        scorer: Scorer,
        block_tokens: int,
        rng: random.Random,
    ) -> None:
        self._names = list(names)
        self._slot = {name: i for i, name in enumerate(self._names)}
        self._queues = queues
        self._index = index
        self._scorer = scorer
        self._block_tokens = block_tokens
        self._rng = rng

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        matches = self._index.lookup(block_hashes)
        states = {
            name: ReplicaState(outstanding_tokens=queue.outstanding(now), running_requests=queue.in_flight(now))
            for name, queue in zip(self._names, self._queues, strict=True)
        }
        num_blocks = math.ceil(request.input_length / self._block_tokens)
        decision = self._scorer.choose(states, matches, num_blocks, self._rng)
        return Choice(self._slot[decision.replica], decision.matched.total)
