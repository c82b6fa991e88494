"""Choosing a replica for a prompt: hash its blocks, look them up, score the candidates.

The candidates are the healthy replicas; each is seen as a
:class:`~kvstore.router.scoring.ReplicaState` built by
:func:`~kvstore.router.policies.replica_state`. The Scorer always runs, so
every decision carries its per-candidate costs; under a baseline policy the
baseline picks the replica and the costs stay for comparison.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from kvstore.hashing import BlockHasher, HashMemo
from kvstore.openai.errors import ApiError
from kvstore.router.config import PolicyName
from kvstore.router.index import PrefixIndex
from kvstore.router.index_lookup import NO_MATCH, MediumCounts
from kvstore.router.policies import Baseline, make_baseline, replica_state
from kvstore.router.replicas import Replica
from kvstore.router.scoring import Decision, Scorer


class Prompt(NamedTuple):
    """What routing reads of a request: its tokens (as the replica tokenises them) and what salts its hashes.

    No tokens (a body the router cannot tokenise exactly) routes on load alone.
    """

    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    model: str | None = None  # the model the client named: only replicas that serve it are candidates


class RouteResult(NamedTuple):
    decision: Decision
    matched: dict[str, MediumCounts]  # per candidate: leading blocks it holds, by medium
    prompt_blocks: int  # blocks of the prompt, a trailing partial one included
    route_s: float


class Router:
    """Routes prompts with one hasher, index and scorer; baselines are made on first use and keep their state."""

    def __init__(
        self, hasher: BlockHasher, index: PrefixIndex, scorer: Scorer, rng: random.Random, memo_blocks: int = 0
    ) -> None:
        """``memo_blocks``: how many block hashes to remember for prompts that share prefixes (:class:`HashMemo`)."""
        self._hasher = hasher
        self._memo = HashMemo(hasher, memo_blocks)
        self._index = index
        self._scorer = scorer
        self._rng = rng
        self._baselines: dict[PolicyName, Baseline | None] = {}

    def route(self, prompt: Prompt, candidates: Sequence[Replica], policy: PolicyName) -> RouteResult:
        """Choose one of ``candidates`` for the prompt under ``policy``. Raises ApiError(503) when there is none."""
        start = time.perf_counter()
        if not candidates:
            raise ApiError(503, "no healthy replica is available; retry later")
        matches = self._index.lookup(_block_hashes(self._memo, prompt))
        now = time.monotonic()
        states = {r.spec.name: replica_state(r.prefill, r.load, now) for r in candidates}
        num_blocks = -(-len(prompt.token_ids) // self._hasher.block_size)
        decision = self._scorer.choose(states, matches, num_blocks, self._rng)
        baseline = self._baseline(policy)
        if baseline is not None:
            replica = baseline.choose({name: states[name] for name in sorted(states)})
            decision = Decision(replica, decision.scores, matches.get(replica, NO_MATCH))
        matched = {name: matches.get(name, NO_MATCH) for name in states}
        return RouteResult(decision, matched, num_blocks, time.perf_counter() - start)

    def _baseline(self, policy: PolicyName) -> Baseline | None:
        if policy not in self._baselines:
            self._baselines[policy] = make_baseline(policy, self._rng)
        return self._baselines[policy]


def _block_hashes(memo: HashMemo, prompt: Prompt) -> Iterator[int]:
    """The prompt's block hashes (external), each computed only when the lookup asks for it.

    The lookup stops at the first block no replica holds, so a prompt no
    replica has seen costs one hash rather than one per block; a block an
    earlier prompt hashed comes from the memo -- chained hashing is most of
    what routing a long prompt costs.
    """
    return memo.iter_external(prompt.token_ids, lora_name=prompt.lora_name, cache_salt=prompt.cache_salt)
