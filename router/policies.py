"""Routing policies: which healthy replica gets a prompt, and the load state they choose from.

``kvstore`` weighs the cached prefix against the load
(:class:`~kvstore.router.scoring.Scorer`); ``round_robin``, ``random`` and
``least_loaded`` are the cache-blind baselines it is measured against. The
router service (``router.policy``) and ``kvstore simulate`` both choose
through this module and build the states with :func:`replica_state`, so a
comparison of policies measures the policies, not two copies of them.

A baseline picks among the candidates in the order the caller lists them:
the router lists them by name, so its choice does not depend on the order
replicas registered or came back to health.

Not thread-safe (a baseline may keep a turn or draw from an rng): the router
calls them from its event loop, the simulator from its one thread.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Protocol

from kvstore.router.backends import ReplicaLoad
from kvstore.router.config import PolicyName
from kvstore.router.load import PrefillLoad
from kvstore.router.scoring import ReplicaState

_NOTHING_REPORTED = ReplicaLoad(running=0, waiting=0, kv_usage=0.0)


def replica_state(prefill: PrefillLoad, reported: ReplicaLoad | None, now: float) -> ReplicaState:
    """What a policy knows of one replica: the router's prefill estimate and the load it last reported.

    ``reported`` is None where the replica reports nothing (the simulator);
    running requests are the larger of what it reported and what this router
    has in flight there, since a report lags the requests sent since.
    """
    if reported is None:
        reported = _NOTHING_REPORTED
    return ReplicaState(
        outstanding_tokens=prefill.outstanding(now),
        running_requests=max(reported.running, prefill.inflight_requests),
        waiting_requests=reported.waiting,
        kv_usage=reported.kv_usage,
    )


class Baseline(Protocol):
    """A cache-blind policy."""

    def choose(self, states: Mapping[str, ReplicaState]) -> str:
        """One of ``states``' replicas (the candidates, in the caller's order); ValueError when there is none."""
        ...


class RoundRobin:
    """Each candidate in turn."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, states: Mapping[str, ReplicaState]) -> str:
        names = _candidates(states)
        name = names[self._turn % len(names)]
        self._turn += 1
        return name


class RandomChoice:
    """A candidate drawn uniformly from ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, states: Mapping[str, ReplicaState]) -> str:
        return self._rng.choice(_candidates(states))


class LeastLoaded:
    """:func:`least_loaded`, ties drawn from ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, states: Mapping[str, ReplicaState]) -> str:
        return least_loaded(states, self._rng)


def least_loaded(states: Mapping[str, ReplicaState], rng: random.Random) -> str:
    """Least outstanding prefill, then fewest requests (running and waiting); ties at random."""
    _candidates(states)
    keys = {name: (s.outstanding_tokens, s.running_requests + s.waiting_requests) for name, s in states.items()}
    least = min(keys.values())
    tied = [name for name, key in keys.items() if key == least]
    return tied[0] if len(tied) == 1 else rng.choice(sorted(tied))


def make_baseline(policy: PolicyName | str, rng: random.Random) -> Baseline | None:
    """The baseline named ``policy``; None for ``kvstore`` (the Scorer decides). ValueError for another name."""
    if policy == "kvstore":
        return None
    if policy == "round_robin":
        return RoundRobin()
    if policy == "random":
        return RandomChoice(rng)
    if policy == "least_loaded":
        return LeastLoaded(rng)
    raise ValueError(f"unknown routing policy {policy!r}")


def _candidates(states: Mapping[str, ReplicaState]) -> list[str]:
    if not states:
        raise ValueError("no candidate replica: the caller must answer 503 before choosing")
    return list(states)
