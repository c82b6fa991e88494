"""Choosing a replica: the prefix it already holds against the load it already has.

Cost of sending a prompt of ``n`` blocks to replica ``r`` (all weights from
:class:`~kvstore.config.RouterConfig`), in token equivalents::

    credit(r)  = gpu_hit_credit * gpu(r) + cpu_hit_credit * cpu(r) + storage_hit_credit * storage(r)
    prefill(r) = block_size * max(0, n - credit(r))          # tokens still to prefill
    cost(r)    = prefill_weight * prefill(r)
               + outstanding_weight * outstanding_tokens(r)  # work queued or running there
               + running_weight * running_requests(r)
               + waiting_weight * waiting_requests(r)
               + kv_usage_weight * kv_usage(r)

``gpu(r)``, ``cpu(r)``, ``storage(r)`` are the leading blocks the replica
holds, each counted from its best medium (:meth:`kvstore.router.index.PrefixIndex.lookup`).
With the default weights (prefill and outstanding work both 1) the cost is
the work the replica must finish before this request's first token: the
request goes where queue + own prefill is smallest.

The lowest cost wins; ties (within 1e-9 relative) are broken with the
caller's ``rng``. With ``temperature > 0`` the replica is instead sampled
with probability proportional to ``exp(-c / temperature)``, where ``c`` is
the cost normalised to [0, 1] over the candidates.

The router and the simulator both call :meth:`Scorer.choose`; it is pure
(no state, no clock), so a decision is reproducible from its inputs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import NamedTuple

from kvstore.router.config import RouterConfig
from kvstore.router.index_lookup import NO_MATCH, MediumCounts

_TIE = 1e-9


class ReplicaState(NamedTuple):
    """What the router knows about one candidate replica's load."""

    outstanding_tokens: float = 0.0  # work queued or running there, in prefill-token equivalents
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0  # fraction of its KV pool in use, 0..1


class Decision(NamedTuple):
    replica: str
    scores: dict[str, float]  # cost per candidate replica (lower is better), in candidate order
    matched: MediumCounts  # the chosen replica's prefix, in blocks, by medium

    @property
    def cached_blocks(self) -> int:
        return self.matched.total


class Scorer:
    """Scores candidates with one configuration. Immutable; safe to share between threads."""

    __slots__ = ("_block_size", "_config")

    def __init__(self, config: RouterConfig, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._config = config
        self._block_size = block_size

    def cost(self, state: ReplicaState, matched: MediumCounts, num_prompt_blocks: int) -> float:
        """The cost of one candidate (module docstring)."""
        c = self._config
        credit = (
            c.gpu_hit_credit * matched.gpu + c.cpu_hit_credit * matched.cpu + c.storage_hit_credit * matched.storage
        )
        prefill = self._block_size * max(0.0, num_prompt_blocks - credit)
        return (
            c.prefill_weight * prefill
            + c.outstanding_weight * state.outstanding_tokens
            + c.running_weight * state.running_requests
            + c.waiting_weight * state.waiting_requests
            + c.kv_usage_weight * state.kv_usage
        )

    def choose(
        self,
        replica_states: Mapping[str, ReplicaState],
        prefix_matches: Mapping[str, MediumCounts],
        num_prompt_blocks: int,
        rng: random.Random,
    ) -> Decision:
        """Pick one of ``replica_states`` (the candidates: healthy replicas) for a prompt.

        ``prefix_matches`` is the index's answer for the prompt's block
        hashes (replicas it omits match nothing; replicas that are not
        candidates are ignored). ``num_prompt_blocks`` counts every block
        of the prompt, a trailing partial one included. Raises ValueError
        when there is no candidate.
        """
        if not replica_states:
            raise ValueError("no candidate replica: the caller must answer 503 before scoring")
        if num_prompt_blocks < 0:
            raise ValueError(f"num_prompt_blocks must be >= 0, got {num_prompt_blocks}")
        scores = {
            name: self.cost(state, prefix_matches.get(name, NO_MATCH), num_prompt_blocks)
            for name, state in replica_states.items()
        }
        if self._config.temperature > 0:
            replica = _sample(scores, self._config.temperature, rng)
        else:
            best = min(scores.values())
            margin = _TIE * max(1.0, abs(best))
            # (or every candidate, should no cost compare -- a NaN from a replica's load: never an empty draw)
            tied = [name for name, cost in scores.items() if cost - best <= margin] or list(scores)
            replica = tied[0] if len(tied) == 1 else rng.choice(tied)
        return Decision(replica, scores, prefix_matches.get(replica, NO_MATCH))


def _sample(scores: dict[str, float], temperature: float, rng: random.Random) -> str:
    low = min(scores.values())
    spread = max(scores.values()) - low
    names = list(scores)
    if spread <= 0:
        return rng.choice(names)
    weights = [math.exp(-(scores[name] - low) / spread / temperature) for name in names]
    return rng.choices(names, weights)[0]
