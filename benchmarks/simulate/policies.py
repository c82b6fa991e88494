"""Routing policies of the simulator: the router's own (its index, scorer and baselines) and Dynamo's.

Every policy answers one question per request -- which replica -- from what
a router could know at that moment: the request, its block hashes, its own
dispatch records (:class:`FleetView`) and, for the cache-aware ones, the
prefix index fed by the replicas' KV events. None of them reads a replica's
true queue: the simulator keeps that to itself.

- ``kvstore`` (:class:`CacheAware`): :meth:`kvstore.router.scoring.Scorer.choose`
  on the states :func:`kvstore.router.policies.replica_state` builds, as the
  router service calls them.
- ``round_robin``, ``random``, ``least_loaded`` (:class:`CacheBlind`): the
  router's baselines (:mod:`kvstore.router.policies`) on the same states.
- ``dynamo`` (:class:`DynamoStyle`): modelled on the cost NVIDIA Dynamo's KV
  router publishes, ``overlap_weight * prefill blocks + decode blocks``:
  prefill blocks are the prompt's blocks not cached on the replica's GPU,
  decode blocks the KV blocks of the requests in flight there (a prefix
  block shared by several of them counted once) -- a load signal in memory
  held, not in work queued.

``global_cache`` places with the ``least_loaded`` baseline; its one shared
cache is set up by the simulator.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvstore.benchmarks.mooncake import MooncakeRequest
from kvstore.router.index import PrefixIndex
from kvstore.router.load import PrefillLoad
from kvstore.router.policies import Baseline, replica_state
from kvstore.router.scoring import ReplicaState, Scorer

DYNAMO_OVERLAP_WEIGHT = 1.0
"""Dynamo's default ``--kv-overlap-score-weight``."""


class Choice(NamedTuple):
    replica: int  # index into the simulator's replicas
    predicted_blocks: int | None  # the prefix the policy expects to hit there (None: cache-blind)


class Policy(Protocol):
    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice: ...


class FleetView:
    """The router's side of the fleet: per replica, what it dispatched there and what came back.

    ``dispatched`` / ``finished`` mirror the router service: a request counts
    from the moment it is sent until its response returns (after its last
    output token). The KV blocks of in-flight requests are kept for the
    Dynamo-style cost only.
    """

    def __init__(self, names: Sequence[str], prefill_tps: float, block_tokens: int) -> None:
        self.names = list(names)
        self.slot = {name: i for i, name in enumerate(self.names)}  # replica name -> its index
        self.loads = [PrefillLoad(prefill_tps) for _ in self.names]
        self._block_tokens = block_tokens
        self._prompt_blocks: list[Counter[int]] = [Counter() for _ in self.names]
        self._output_blocks = [0] * len(self.names)

    def dispatched(
        self, replica: int, block_hashes: Sequence[int], output_tokens: int, prefill: int, now: float
    ) -> None:
        self.loads[replica].dispatched(prefill, now)
        self._prompt_blocks[replica].update(block_hashes)
        self._output_blocks[replica] += -(-output_tokens // self._block_tokens)

    def finished(self, replica: int, block_hashes: Sequence[int], output_tokens: int, prefill: int) -> None:
        self.loads[replica].finished(prefill)
        held = self._prompt_blocks[replica]
        held.subtract(block_hashes)
        for block_hash in block_hashes:
            if held[block_hash] <= 0:
                del held[block_hash]
        self._output_blocks[replica] -= -(-output_tokens // self._block_tokens)

    def states(self, now: float) -> dict[str, ReplicaState]:
        """Each replica's state as the router service builds it, in replica order (no replica reports its load)."""
        return {name: replica_state(load, None, now) for name, load in zip(self.names, self.loads, strict=True)}

    def decode_blocks(self, replica: int) -> int:
        """KV blocks held by the replica's in-flight requests (shared prompt blocks once)."""
        return len(self._prompt_blocks[replica]) + self._output_blocks[replica]


class CacheBlind:
    """One of the router's baselines, choosing from the router's view of the fleet."""

    def __init__(self, view: FleetView, baseline: Baseline) -> None:
        self._view = view
        self._baseline = baseline

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        return Choice(self._view.slot[self._baseline.choose(self._view.states(now))], None)


class CacheAware:
    """Ours: the router's PrefixIndex lookup and Scorer, as the router service calls them."""

    def __init__(
        self, view: FleetView, index: PrefixIndex, scorer: Scorer, block_tokens: int, rng: random.Random
    ) -> None:
        self._view = view
        self._index = index
        self._scorer = scorer
        self._block_tokens = block_tokens
        self._rng = rng

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        matches = self._index.lookup(block_hashes)
        num_blocks = math.ceil(request.input_length / self._block_tokens)
        decision = self._scorer.choose(self._view.states(now), matches, num_blocks, self._rng)
        return Choice(self._view.slot[decision.replica], decision.matched.total)


class DynamoStyle:
    """Lowest ``overlap_weight * prefill_blocks + decode_blocks``; ties at random (module docstring)."""

    def __init__(
        self,
        view: FleetView,
        index: PrefixIndex,
        block_tokens: int,
        rng: random.Random,
        overlap_weight: float = DYNAMO_OVERLAP_WEIGHT,
    ) -> None:
        self._view = view
        self._index = index
        self._block_tokens = block_tokens
        self._rng = rng
        self._overlap_weight = overlap_weight

    def choose(self, request: MooncakeRequest, block_hashes: list[int], now: float) -> Choice:
        matches = self._index.lookup(block_hashes)
        prompt_blocks = request.input_length / self._block_tokens
        best: list[int] = []
        best_cost = math.inf
        for replica, name in enumerate(self._view.names):
            match = matches.get(name)
            overlap = match.gpu if match is not None else 0
            cost = self._overlap_weight * max(0.0, prompt_blocks - overlap) + self._view.decode_blocks(replica)
            if cost < best_cost:
                best, best_cost = [replica], cost
            elif cost == best_cost:
                best.append(replica)
        replica = best[0] if len(best) == 1 else self._rng.choice(best)
        match = matches.get(self._view.names[replica])
        return Choice(replica, match.gpu if match is not None else 0)
