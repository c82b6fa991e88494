"""``kvstore simulate``: routing policies replayed on a Mooncake trace in simulated time, no model.

The time model
--------------
Requests arrive at their trace timestamps divided by ``speedup``. Each of
``replicas`` simulated replicas has

- a finite LRU block cache: a real :class:`~kvstore.block_pool.BlockPool`
  of ``capacity_tokens`` (:class:`~kvstore.benchmarks.simulate.replica.BlockCache`). A
  request's blocks are looked up and entered when it is routed there;
- a prefill server (:class:`~kvstore.benchmarks.simulate.replica.PrefillServer`): the
  uncached prompt tokens are computed in arrival order, in steps of at most
  ``step_tokens`` tokens, at ``prefill_tps`` tokens/s -- an approximation of
  continuous batching with chunked prefill (a request joins at the next step
  boundary; a step's duration is its tokens over the throughput);
- decode beside it: after its first token a request produces the rest of
  its ``output_length`` at ``decode_tps`` tokens/s (memory-bound batched
  decode barely slows prefill; the approximation ignores that slowdown).

``TTFT = first token - arrival``: queueing behind earlier prefill plus the
request's own uncached prefill, rounded up to step boundaries.

What the policies see
---------------------
Only what a router can know (:mod:`kvstore.benchmarks.simulate.policies`): its own dispatch
records (:class:`~kvstore.router.load.PrefillLoad` per replica: prefill tokens sent
there, drained at ``prefill_tps`` -- the router's ``router.prefill_tps`` --
and released when the response returns after the last output token) and,
for ``kvstore`` and ``dynamo``, a real :class:`~kvstore.router.index.PrefixIndex`
fed with each cache's real ``BlockStored``/``BlockRemoved`` events. The
``kvstore`` policy is :meth:`kvstore.router.scoring.Scorer.choose` fed as the
router service feeds it, and the cache-blind baselines are the router's own
(:mod:`kvstore.router.policies`). ``global_cache`` is the hit-rate upper bound:
one LRU of the replicas' total capacity that every replica reads, placement
by least load. The index's predicted prefix is checked against each cache's
actual hit (``index_mismatches``, always 0).

What is measured, per policy
----------------------------
``hit_rate`` (cached prompt tokens / prompt tokens; a full hit still
recomputes the last token), ``prefill_tokens_saved``, TTFT p50/p90/p99,
``max_mean_load`` (work -- prefill plus output tokens -- assigned per replica
over the whole run, max over mean), ``window_load_imbalance_p99`` (per ``window_s`` of
simulated time, each replica's outstanding prefill tokens averaged over the
window; max over mean across replicas, p99 over the windows with any work:
the bursts that a whole-run average hides) and ``utilization`` (prefill-busy share of
the replicas' time until the last first token).

Discrete events: arrivals in trace order, step ends and response
completions from one heap; window samples at their own times in between.
Cost: O(replicas) per decision for the load-aware policies (their state is
read for every replica), O(prompt blocks) per cache operation and index
lookup.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvstore.benchmarks.mooncake import MOONCAKE_BLOCK_TOKENS, MooncakeRequest, TraceExpander
from kvstore.benchmarks.simulate.policies import CacheAware, CacheBlind, DynamoStyle, FleetView, Policy
from kvstore.benchmarks.simulate.replica import BlockCache, PrefillServer
from kvstore.config import CacheConfig
from kvstore.errors import ConfigError
from kvstore.events import EventBatch, KVEvent
from kvstore.router.config import RouterConfig
from kvstore.router.index import PrefixIndex
from kvstore.router.policies import LeastLoaded, make_baseline
from kvstore.router.scoring import Scorer

POLICIES = ("kvstore", "dynamo", "round_robin", "random", "least_loaded", "global_cache")
DEFAULT_CAPACITY_TOKENS = 1_000_000
"""Per replica. A Llama-3-70B-class model (GQA, fp16: 320 KiB/token) on 8 x 80 GB holds ~1M tokens of KV."""
DEFAULT_UTILIZATION = 0.8
"""Default offered prefill load: the trace's prompt tokens, uncached, over the fleet's prefill capacity."""
DEFAULT_WINDOW_S = 10.0
MIN_WINDOW_S = 0.01  # an hour of simulated time is then 360,000 samples; a microsecond would be 3.6e9

_STEP_END, _DONE = 0, 1  # event kinds; a step end sorts before a completion at the same instant


class SimulationSettings(NamedTuple):
    replicas: int
    capacity_tokens: int  # per replica
    block_tokens: int
    prefill_tps: float  # prefill tokens per second, per replica
    decode_tps: float  # output tokens per second, per request
    step_tokens: int  # prefill token budget per step
    speedup: float  # trace time / simulated time
    window_s: float  # load-imbalance sampling period, simulated seconds
    seed: int

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_tokens

    def validate(self) -> None:
        """Raise ConfigError naming the first bad setting."""
        checks = (
            (self.replicas >= 1, "--replicas must be >= 1"),
            (
                self.block_tokens >= 1 and MOONCAKE_BLOCK_TOKENS % self.block_tokens == 0,
                f"--block-tokens must divide the trace's {MOONCAKE_BLOCK_TOKENS}-token blocks",
            ),
            (self.capacity_blocks >= 1, "--capacity-tokens must hold at least one block"),
            (self.prefill_tps > 0 and math.isfinite(self.prefill_tps), "--prefill-tps must be > 0"),
            (self.decode_tps > 0 and math.isfinite(self.decode_tps), "--decode-tps must be > 0"),
            (self.step_tokens >= 1, "--step-tokens must be >= 1"),
            (self.speedup > 0 and math.isfinite(self.speedup), "--speedup must be > 0"),
            (
                self.window_s >= MIN_WINDOW_S and math.isfinite(self.window_s),
                f"--window-s must be at least {MIN_WINDOW_S:g} s (each window is a sample kept in memory)",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def offered_prefill_tps(trace: Sequence[MooncakeRequest]) -> float | None:
    """Prompt tokens per second of trace time (None when the trace spans no time)."""
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 if trace else 0.0
    return sum(r.input_length for r in trace) / span_s if span_s > 0 else None


def speedup_for_utilization(
    trace: Sequence[MooncakeRequest], replicas: int, prefill_tps: float, target: float
) -> float:
    """The speedup at which the trace's prompt tokens, none cached, are ``target`` of the fleet's prefill capacity."""
    if not 0 < target <= 10:
        raise ConfigError("--utilization must be in (0, 10]")
    offered = offered_prefill_tps(trace)
    if offered is None:
        raise ConfigError("the trace spans no time: pass --speedup")
    return target * replicas * prefill_tps / offered


class PolicyResult(NamedTuple):
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    work_per_replica: list[float]  # prefill + output tokens assigned over the run
    ttfts_s: list[float]  # per request, in trace order
    window_imbalance: list[float]  # per window with any work: max/mean of mean outstanding prefill
    busy_s: float  # prefill-busy seconds, summed over replicas
    makespan_s: float  # first arrival to last first token
    index_mismatches: int  # cache-aware only: requests whose predicted prefix was not the actual hit
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def max_mean_load(self) -> float:
        mean = statistics.fmean(self.work_per_replica)
        return max(self.work_per_replica) / mean if mean > 0 else 1.0

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts_s, q)

    @property
    def window_imbalance_p99(self) -> float:
        return percentile(self.window_imbalance, 0.99) if self.window_imbalance else 1.0

    @property
    def utilization(self) -> float:
        replicas = len(self.work_per_replica)
        return self.busy_s / (replicas * self.makespan_s) if self.makespan_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "hit_rate": self.hit_rate,
            "max_mean_load": self.max_mean_load,
            "prefill_tokens_saved": self.cached_tokens,
            "prefill_tokens": self.prompt_tokens - self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "requests": self.requests,
            "ttft_p50_s": self.ttft(0.50),
            "ttft_p90_s": self.ttft(0.90),
            "ttft_p99_s": self.ttft(0.99),
            "ttft_mean_s": statistics.fmean(self.ttfts_s) if self.ttfts_s else 0.0,
            "window_load_imbalance_p99": self.window_imbalance_p99,
            "utilization": self.utilization,
            "work_per_replica": self.work_per_replica,
            "index_mismatches": self.index_mismatches,
            "wall_s": self.wall_s,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def build_policy(
    policy: str,
    settings: SimulationSettings,
    view: FleetView,
    router_config: RouterConfig,
    rng: random.Random,
    clock: list[float],
) -> tuple[Policy, list[BlockCache]]:
    """The policy's chooser and the replicas' caches (publishing into an index where the policy reads one)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    names, blocks, block_tokens = view.names, settings.capacity_blocks, settings.block_tokens
    if policy in ("kvstore", "dynamo"):
        index = PrefixIndex(CacheConfig(block_size=block_tokens))
        for name in names:
            index.add_producer(name, "gpu", [name], node=name)
        caches = [BlockCache(blocks, block_tokens, _publisher(index, name, clock)) for name in names]
        if policy == "kvstore":
            return CacheAware(view, index, Scorer(router_config, block_tokens), block_tokens, rng), caches
        return DynamoStyle(view, index, block_tokens, rng), caches
    if policy == "global_cache":
        return CacheBlind(view, LeastLoaded(rng)), [BlockCache(blocks * len(names), block_tokens)] * len(names)
    baseline = make_baseline(policy, rng)
    assert baseline is not None, policy
    return CacheBlind(view, baseline), [BlockCache(blocks, block_tokens) for _ in names]


def simulate_policy(
    policy: str,
    trace: Sequence[MooncakeRequest],
    settings: SimulationSettings,
    expander: TraceExpander,
    router_config: RouterConfig,
) -> PolicyResult:
    """Replay ``trace`` under one policy (module docstring) and measure it."""
    settings.validate()
    if expander.block_size != settings.block_tokens:
        raise ConfigError(f"expander block size {expander.block_size} != --block-tokens {settings.block_tokens}")
    started = time.perf_counter()
    block_tokens = settings.block_tokens
    names = [f"replica-{i}" for i in range(settings.replicas)]
    view = FleetView(names, router_config.prefill_tps or settings.prefill_tps, block_tokens)
    clock = [0.0]  # now, stamped on published batches
    chooser, caches = build_policy(policy, settings, view, router_config, random.Random(settings.seed), clock)
    servers = [PrefillServer(settings.prefill_tps, settings.step_tokens) for _ in names]
    n = len(trace)
    t0 = trace[0].timestamp_ms if n else 0.0
    arrival = [(r.timestamp_ms - t0) / 1000.0 / settings.speedup for r in trace]
    first_token = [0.0] * n
    replica_of = [0] * n
    prefill_of = [0] * n
    hashes_of: list[list[int]] = [[] for _ in range(n)]
    work = [0.0] * len(names)
    heap: list[tuple[float, int, int]] = []  # (time, kind, replica for a step end | request for a completion)
    imbalance: list[float] = []
    next_window = settings.window_s
    decode_tps = settings.decode_tps

    def sample_windows(until: float) -> None:
        nonlocal next_window
        while next_window <= until:
            loads = [server.take_area(next_window) for server in servers]  # mean outstanding x window
            mean = sum(loads) / len(loads)
            if mean > 0:
                imbalance.append(max(loads) / mean)
            next_window += settings.window_s

    def advance(until: float) -> None:
        while heap and heap[0][0] <= until:
            now, kind, who = heapq.heappop(heap)
            sample_windows(now)
            clock[0] = now
            if kind == _STEP_END:
                done, next_end = servers[who].end_step()
                if next_end is not None:
                    heapq.heappush(heap, (next_end, _STEP_END, who))
                for rid in done:
                    first_token[rid] = now
                    finish = now + max(0, trace[rid].output_length - 1) / decode_tps
                    heapq.heappush(heap, (finish, _DONE, rid))
            else:
                view.finished(replica_of[who], hashes_of[who], trace[who].output_length, prefill_of[who])
                hashes_of[who] = []
        if math.isfinite(until):  # at the end, windows stop with the last event
            sample_windows(until)

    prompt_tokens = cached_tokens = output_tokens = mismatches = 0
    for rid, request in enumerate(trace):
        now = arrival[rid]
        advance(now)
        clock[0] = now
        expanded = expander.expand(request)
        choice = chooser.choose(request, expanded.external, now)
        replica = choice.replica
        hits = caches[replica].serve(expanded.digests, expanded.token_ids)
        if choice.predicted_blocks is not None and choice.predicted_blocks != hits:
            mismatches += 1
        cached = min(hits * block_tokens, request.input_length - 1)
        prefill = request.input_length - cached
        replica_of[rid], prefill_of[rid], hashes_of[rid] = replica, prefill, expanded.external
        view.dispatched(replica, expanded.external, request.output_length, prefill, now)
        step_end = servers[replica].submit(rid, prefill, now)
        if step_end is not None:
            heapq.heappush(heap, (step_end, _STEP_END, replica))
        prompt_tokens += request.input_length
        cached_tokens += cached
        output_tokens += request.output_length
        work[replica] += prefill + request.output_length
    advance(math.inf)
    return PolicyResult(
        requests=n,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=output_tokens,
        work_per_replica=work,
        ttfts_s=[first_token[i] - arrival[i] for i in range(n)],
        window_imbalance=imbalance,
        busy_s=(prompt_tokens - cached_tokens) / settings.prefill_tps,
        makespan_s=max(first_token, default=0.0),
        index_mismatches=mismatches,
        wall_s=time.perf_counter() - started,
    )


def _publisher(index: PrefixIndex, producer: str, clock: list[float]) -> Callable[[list[KVEvent]], None]:
    """The callback a cache publishes through: one batch per request, seq counting from 0."""
    next_seq = 0

    def publish(events: list[KVEvent]) -> None:
        nonlocal next_seq
        index.apply_batch(producer, next_seq, EventBatch(clock[0], events))
        next_seq += 1

    return publish
