"""``kvstore simulate``: routing policies replayed on a Mooncake trace, no model.

Each of ``--replicas`` simulated replicas has a finite LRU block cache (a
real :class:`~kvstore.block_pool.BlockPool` of ``--capacity-tokens``; see
:mod:`router.sim_replica`) and a FIFO work queue draining ``--drain-rate``
token equivalents per second. Requests arrive at their trace timestamps;
each is routed by the policy (:mod:`router.sim_policies`), served from that
replica's cache (cached prompt tokens are not prefilled), and adds its work
-- uncached prompt tokens plus output tokens -- to that replica's queue.

For ``kvstore`` (ours) every cache publishes its pool's real
``BlockStored``/``BlockRemoved`` events into a real
:class:`~router.index.PrefixIndex`, and requests are scored by the router's
:class:`~router.scoring.Scorer`. The prefix the index predicted is checked
against the cache's actual hit: ``index_mismatches`` must be 0.
``global_cache`` is the upper bound: one LRU of the replicas' total capacity
that every replica reads, requests placed on the least loaded replica.

Per policy: ``hit_rate`` (cached prompt tokens / prompt tokens; a full hit
still recomputes the last token), ``prefill_tokens_saved``,
``max_mean_load`` (max over mean of the work assigned to each replica over
the run) and queueing delay -- printed as a table, written as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvstore.config import CacheConfig, RouterConfig, load_config
from kvstore.errors import ConfigError
from kvstore.events import EventBatch, KVEvent
from kvstore.hashing import BlockHasher
from router.index import PrefixIndex
from router.mooncake import (
    DEFAULT_TRACE,
    HASH_MODES,
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRequest,
    TraceExpander,
    read_trace,
)
from router.scoring import Scorer
from router.sim_policies import CacheAware, LeastLoaded, Policy, RandomChoice, RoundRobin
from router.sim_replica import BlockCache, WorkQueue

IS_BENCHMARK = False
POLICIES = ("kvstore", "round_robin", "random", "least_loaded", "global_cache")
DEFAULT_CAPACITY_TOKENS = 1_000_000
"""Per replica. A Llama-3-70B-class model (GQA, fp16: 320 KiB/token) on 8 x 80 GB holds ~1M tokens of KV."""
DEFAULT_DRAIN_RATE = 10_000.0
"""Token equivalents per second per replica; 8 replicas then run the conversation trace at roughly 45% busy."""


class SimulationSettings(NamedTuple):
    replicas: int
    capacity_tokens: int  # per replica
    block_tokens: int
    drain_rate: float  # token equivalents per second per replica
    seed: int

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_tokens


class PolicyResult(NamedTuple):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    work_per_replica: list[float]  # total work assigned over the run, token equivalents
    waits_s: list[float]  # per request: queueing delay before its work starts
    index_mismatches: int  # cache-aware only: requests whose predicted prefix was not the actual hit
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_mean_load(self) -> float:
        mean = statistics.fmean(self.work_per_replica)
        return max(self.work_per_replica) / mean if mean > 0 else 1.0

    @property
    def mean_wait_s(self) -> float:
        return statistics.fmean(self.waits_s) if self.waits_s else 0.0

    @property
    def p99_wait_s(self) -> float:
        waits = sorted(self.waits_s)
        return waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "hit_rate": self.hit_rate,
            "max_mean_load": self.max_mean_load,
            "prefill_tokens_saved": self.cached_tokens,
            "prefill_tokens": self.prompt_tokens - self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "requests": self.requests,
            "work_per_replica": self.work_per_replica,
            "mean_wait_s": self.mean_wait_s,
            "p99_wait_s": self.p99_wait_s,
            "index_mismatches": self.index_mismatches,
            "wall_s": self.wall_s,
        }


def simulate_policy(
    policy: str,
    trace: Sequence[MooncakeRequest],
    settings: SimulationSettings,
    expander: TraceExpander,
    router_config: RouterConfig,
) -> PolicyResult:
    """Replay ``trace`` under one policy (module docstring) and measure it."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if expander.block_size != settings.block_tokens:
        raise ConfigError(f"expander block size {expander.block_size} != --block-tokens {settings.block_tokens}")
    started = time.perf_counter()
    block_tokens = settings.block_tokens
    rng = random.Random(settings.seed)
    names = [f"replica-{i}" for i in range(settings.replicas)]
    queues = [WorkQueue(settings.drain_rate) for _ in names]
    clock = [0.0]  # the current request's arrival time, stamped on published batches
    chooser: Policy
    if policy == "kvstore":
        index = PrefixIndex(CacheConfig(block_size=block_tokens))
        for name in names:
            index.add_producer(name, "gpu", [name], node=name)
        caches = [BlockCache(settings.capacity_blocks, block_tokens, _publisher(index, name, clock)) for name in names]
        chooser = CacheAware(names, queues, index, Scorer(router_config, block_tokens), block_tokens, rng)
    elif policy == "global_cache":
        caches = [BlockCache(settings.capacity_blocks * len(names), block_tokens)] * len(names)
        chooser = LeastLoaded(queues, rng)
    else:
        caches = [BlockCache(settings.capacity_blocks, block_tokens) for _ in names]
        if policy == "round_robin":
            chooser = RoundRobin(len(names))
        elif policy == "random":
            chooser = RandomChoice(len(names), rng)
        else:
            chooser = LeastLoaded(queues, rng)
    prompt_tokens = cached_tokens = output_tokens = mismatches = 0
    waits: list[float] = []
    for request in trace:
        now = request.timestamp_ms / 1000.0
        clock[0] = now
        expanded = expander.expand(request)
        choice = chooser.choose(request, expanded.external, now)
        hits = caches[choice.replica].serve(expanded.digests, expanded.token_ids)
        if choice.predicted_blocks is not None and choice.predicted_blocks != hits:
            mismatches += 1
        cached = min(hits * block_tokens, request.input_length - 1)
        prompt_tokens += request.input_length
        cached_tokens += cached
        output_tokens += request.output_length
        waits.append(queues[choice.replica].add(request.input_length - cached + request.output_length, now))
    return PolicyResult(
        len(trace),
        prompt_tokens,
        cached_tokens,
        output_tokens,
        [q.total_work for q in queues],
        waits,
        mismatches,
        time.perf_counter() - started,
    )


def _publisher(index: PrefixIndex, producer: str, clock: list[float]) -> Callable[[list[KVEvent]], None]:
    """The callback a cache publishes through: one batch per request, seq counting from 0."""
    next_seq = 0

    def publish(events: list[KVEvent]) -> None:
        nonlocal next_seq
        index.apply_batch(producer, next_seq, EventBatch(clock[0], events))
        next_seq += 1

    return publish


# ---------------------------------------------------------------- command line


def run(args: argparse.Namespace) -> int:
    settings = SimulationSettings(
        replicas=args.replicas,
        capacity_tokens=args.capacity_tokens,
        block_tokens=args.block_tokens,
        drain_rate=args.drain_rate,
        seed=args.seed,
    )
    _validate(settings, args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:
        if policy not in POLICIES:
            raise ConfigError(f"--policies: unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    config = load_config(args.config, overrides=args.set)
    trace = read_trace(args.trace, args.limit)
    if not trace:
        raise ConfigError(f"trace {args.trace} holds no requests")
    hasher = BlockHasher(config.cache.hash_algo, config.cache.hash_seed, settings.block_tokens)
    expander = TraceExpander(hasher, args.hash)
    started = time.perf_counter()
    for request in trace:  # hash every block once, shared by all policies
        expander.expand(request, with_tokens=False)
    hashing_s = time.perf_counter() - started
    results = {policy: simulate_policy(policy, trace, settings, expander, config.router) for policy in policies}
    _print_table(results, settings, len(trace), args)
    if args.json:
        report = {
            "trace": str(args.trace),
            "requests": len(trace),
            "replicas": settings.replicas,
            "capacity_tokens": settings.capacity_tokens,
            "block_tokens": settings.block_tokens,
            "drain_rate": settings.drain_rate,
            "seed": settings.seed,
            "hash_mode": args.hash,
            "hashing_s": hashing_s,
            "router": {f: getattr(config.router, f) for f in config.router.__struct_fields__},
            "policies": {name: result.as_json() for name, result in results.items()},
        }
        if "kvstore" in results and "global_cache" in results and results["global_cache"].hit_rate > 0:
            report["kvstore_hit_rate_vs_global_cache"] = results["kvstore"].hit_rate / results["global_cache"].hit_rate
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _validate(settings: SimulationSettings, args: argparse.Namespace) -> None:
    if settings.replicas < 1:
        raise ConfigError("--replicas must be >= 1")
    if settings.block_tokens < 1 or MOONCAKE_BLOCK_TOKENS % settings.block_tokens:
        raise ConfigError(f"--block-tokens must divide the trace's {MOONCAKE_BLOCK_TOKENS}-token blocks")
    if settings.capacity_blocks < 1:
        raise ConfigError("--capacity-tokens must hold at least one block")
    if settings.drain_rate <= 0:
        raise ConfigError("--drain-rate must be > 0")
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit must be >= 1")


def _print_table(
    results: dict[str, PolicyResult], settings: SimulationSettings, requests: int, args: argparse.Namespace
) -> None:
    print(
        f"routing simulation: {requests} requests, {settings.replicas} replicas x "
        f"{settings.capacity_tokens:,} tokens of cache, {settings.block_tokens}-token blocks, "
        f"{settings.drain_rate:,.0f} tokens/s per replica"
    )
    header = f"{'policy':<14}{'hit rate':>10}{'saved tokens':>16}{'max/mean load':>15}{'mean wait s':>13}"
    print(header + f"{'p99 wait s':>12}{'seconds':>9}")
    for name, r in results.items():
        print(
            f"{name:<14}{r.hit_rate:>10.3f}{r.cached_tokens:>16,}{r.max_mean_load:>15.3f}"
            f"{r.mean_wait_s:>13.2f}{r.p99_wait_s:>12.2f}{r.wall_s:>9.1f}"
        )
    ours, best = results.get("kvstore"), results.get("global_cache")
    if ours is not None and best is not None and best.hit_rate > 0:
        print(f"kvstore hit rate / global cache hit rate: {ours.hit_rate / best.hit_rate:.3f}")
    if ours is not None and ours.index_mismatches:
        print(f"warning: the index mispredicted {ours.index_mismatches} prefixes")


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("simulate", help="replay a Mooncake trace over simulated replicas, per routing policy")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument(
        "--capacity-tokens",
        type=int,
        default=DEFAULT_CAPACITY_TOKENS,
        help=f"KV cache per replica, in tokens (default {DEFAULT_CAPACITY_TOKENS:,})",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first K requests of the trace")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, help="tokens per simulated block")
    p.add_argument(
        "--drain-rate",
        type=float,
        default=DEFAULT_DRAIN_RATE,
        help=f"work each replica completes per second, in tokens (default {DEFAULT_DRAIN_RATE:,.0f})",
    )
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ", ".join(POLICIES))
    p.add_argument("--seed", type=int, default=0, help="seed of the tie-breaking and random policies")
    p.add_argument(
        "--hash",
        choices=HASH_MODES,
        default="tokens",
        help="block hashes: our BlockHasher over the expanded tokens, or a derived chain (faster)",
    )
    p.add_argument("--config", default=None, help="kvstore TOML config (router weights, hash algorithm and seed)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override (repeatable)"
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)
