"""The router service: replicas, their event streams, routing and dispatch.

State
-----
- ``_replicas``: name -> :class:`_Replica` (backend, node, health, load as
  last polled, requests and prefill tokens this router has in flight there).
- ``index``: the prefix index, fed by one :class:`EventListener` thread that
  subscribes to every producer (replica GPU streams, node tier streams).

Invariants
----------
- Only healthy replicas are candidates. A replica is marked unhealthy when a
  dispatch fails with ReplicaUnavailable or ``unhealthy_after`` consecutive
  load polls fail; its producers are then dropped from the index (its blocks
  vanish from routing within one health interval) and re-subscribed -- a
  fresh replay/snapshot -- when it answers again.
- A request is retried at most once, on another replica, and only when the
  first failed before returning anything.

Thread model: HTTP handlers and the health task run on one asyncio loop;
the listener thread writes the index, which is internally locked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.hashing import BlockHasher, to_external
from kvstore.metrics import EventStreamCollector
from kvstore.openai.protocol import ApiError, ModelLimits, ParsedPrompt
from kvstore.openai.tokenizer import Tokenizer
from kvstore.router.backends import (
    ReplicaBackend,
    ReplicaLoad,
    ReplicaPoll,
    ReplicaRejected,
    ReplicaResult,
    ReplicaUnavailable,
)
from kvstore.router.config import RouterSettings
from kvstore.router.fleet_metrics import MergedPagesCollector
from kvstore.router.index import PrefixIndex
from kvstore.router.index_lookup import MediumCounts
from kvstore.router.load import PrefillLoad
from kvstore.router.scoring import Decision, ReplicaState, Scorer, least_loaded
from kvstore.subscriber import EventListener

logger = logging.getLogger(__name__)


class ProducerSpec(NamedTuple):
    """One KV event stream; ``rekey`` when it hashes differently from us (e.g. a vLLM fleet).

    ``curve_server_key``: the publisher's CURVE public key (Z85) when it runs with CURVE
    (``events.curve_public_key`` of its config); None for a plain publisher.
    """

    name: str
    endpoint: str
    replay_endpoint: str | None
    rekey: bool = False
    topic: str = ""
    curve_server_key: str | None = None


class ReplicaSpec(NamedTuple):
    """A replica: where to send requests, and the stream of its own (GPU) cache."""

    name: str
    node: str | None
    backend: ReplicaBackend
    events: ProducerSpec


class _Replica:
    def __init__(self, spec: ReplicaSpec, prefill_tps: float) -> None:
        self.spec = spec
        self.healthy = True
        self.failed_polls = 0
        self.load = ReplicaLoad(0, 0, 0.0)
        self.prefill = PrefillLoad(prefill_tps)
        self.last_ok = time.monotonic()
        self.metrics_text = ""  # its Prometheus page as of the last poll


TierLocator = Callable[[], Awaitable[tuple[str, str | None]]]
"""Where a tier's event stream is now: (endpoint, replay endpoint). Raises when the tier does not answer."""


class _TierWatch:
    def __init__(self, locate: TierLocator) -> None:
        self.locate = locate
        self.up = True  # subscribed to the endpoints in its ProducerSpec


class RouteResult(NamedTuple):
    decision: Decision
    matched: dict[str, MediumCounts]  # per candidate: leading blocks it holds, by medium
    prompt_blocks: int  # blocks of the prompt, a trailing partial one included
    route_s: float


_NO_MATCH = MediumCounts(0, 0, 0)


def medium_dict(counts: MediumCounts) -> dict[str, int]:
    return {"GPU": counts.gpu, "CPU": counts.cpu, "STORAGE": counts.storage}


class RouterService:
    """Routes prompts to replicas by cached prefix and load, and proxies completions."""

    def __init__(
        self,
        config: RouterSettings,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        *,
        registry: CollectorRegistry | None = None,
        seed: int | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits
        self.hasher = BlockHasher.from_config(config.cache)
        self.index = PrefixIndex(config.cache)
        self.scorer = Scorer(config.router, config.cache.block_size)
        self.listener = EventListener(self.index, sync_timeout_s=config.router.sync_timeout_s)
        self._replicas: dict[str, _Replica] = {}
        self._tier_producers: dict[str, ProducerSpec] = {}
        self._tier_watch: dict[str, _TierWatch] = {}
        self._metrics_sources: dict[str, Callable[[], Awaitable[str]]] = {}
        self._metrics_pages: dict[str, str] = {}
        self._rng = random.Random(seed)
        self._round_robin = -1
        self._health_task: asyncio.Task[None] | None = None
        self.registry = registry or CollectorRegistry()
        self._decisions = Counter("kvstore_router_decisions", "Routing decisions.", ["replica"], registry=self.registry)
        self._route_seconds = Histogram(
            "kvstore_router_route_seconds",
            "Time to choose a replica (hash + lookup + score).",
            registry=self.registry,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self._requests = Counter(
            "kvstore_router_requests", "Completion requests by outcome.", ["outcome"], registry=self.registry
        )
        self._retries = Counter(
            "kvstore_router_retries", "Requests retried on another replica.", registry=self.registry
        )
        self._cached_tokens = Counter(
            "kvstore_router_cached_tokens", "Prompt tokens served from cache, by medium.", ["medium"],
            registry=self.registry,
        )  # fmt: skip
        self._healthy = Gauge("kvstore_router_healthy_replicas", "Replicas routed to.", registry=self.registry)
        self._healthy.set_function(lambda: sum(r.healthy for r in self._replicas.values()))
        self.registry.register(EventStreamCollector(self.listener))
        self.registry.register(MergedPagesCollector(self._replica_pages))

    # --------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self.listener.start()
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="router-health")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        self.listener.close()
        for replica in self._replicas.values():
            await replica.spec.backend.close()

    # ---------------------------------------------------------------- registry

    def add_replica(self, spec: ReplicaSpec) -> None:
        """Register (or replace) a replica and subscribe to its event stream."""
        if spec.name in self._replicas:
            self.remove_replica(spec.name)
        self._replicas[spec.name] = _Replica(spec, self.config.router.prefill_tps)
        self.index.add_producer(spec.events.name, "gpu", [spec.name], spec.node, rekey=spec.events.rekey)
        self._listen(spec.events)

    def remove_replica(self, name: str) -> None:
        """Forget a replica and its blocks (its producer's registration removes the replica from the index)."""
        replica = self._replicas.pop(name, None)
        if replica is None:
            return
        self.listener.remove_producer(replica.spec.events.name)
        self.index.remove_producer(replica.spec.events.name)

    def add_tier_producer(
        self,
        node: str,
        producer: ProducerSpec,
        *,
        shared_storage: bool = False,
        locate: TierLocator | None = None,
    ) -> None:
        """A node tier's stream: its blocks count for every replica of ``node``.

        With ``shared_storage`` its STORAGE blocks count for every replica of the cluster.
        ``locate``, when given, is asked on every health poll where the tier's event
        endpoints are now (see :meth:`poll_tiers`).
        """
        self._tier_producers[producer.name] = producer
        self.index.add_producer(producer.name, "tier", node=node, shared_storage=shared_storage, rekey=producer.rekey)
        self._listen(producer)
        if locate is not None:
            self._tier_watch[producer.name] = _TierWatch(locate)

    def remove_tier_producer(self, name: str) -> None:
        self._tier_watch.pop(name, None)
        if self._tier_producers.pop(name, None) is not None:
            self.listener.remove_producer(name)
            self.index.remove_producer(name)

    def tier_producers(self) -> dict[str, ProducerSpec]:
        """The tier streams subscribed to now, by producer name."""
        return dict(self._tier_producers)

    async def poll_tiers(self) -> None:
        """Follow every watched tier: down, its blocks leave the index; moved, resubscribe to its new endpoints.

        A tier actor that died serves nothing until it is back, so its CPU and
        STORAGE blocks must not attract requests; a restarted one binds new
        ports, and a subscription to the old ones would wait forever. A new
        subscription starts with a replay (or a snapshot): what the tier holds.
        """
        watched = list(self._tier_watch.items())
        found = await asyncio.gather(*(watch.locate() for _, watch in watched), return_exceptions=True)
        for (name, watch), where in zip(watched, found, strict=True):
            spec = self._tier_producers.get(name)
            if spec is None:
                continue
            if isinstance(where, BaseException):
                if watch.up:
                    logger.warning("tier %s did not answer (%s); dropping its blocks from the index", name, where)
                    self.listener.remove_producer(name, reset=True)
                    watch.up = False
                continue
            endpoint, replay_endpoint = where
            moved = (endpoint, replay_endpoint) != (spec.endpoint, spec.replay_endpoint)
            if watch.up and not moved:
                continue
            if watch.up:
                self.listener.remove_producer(name, reset=True)
            if moved:
                spec = spec._replace(endpoint=endpoint, replay_endpoint=replay_endpoint)
                self._tier_producers[name] = spec
            logger.info("tier %s answers at %s; resubscribing", name, endpoint)
            self._listen(spec)
            watch.up = True

    def add_metrics_source(self, name: str, fetch: Callable[[], Awaitable[str]]) -> None:
        """Another Prometheus page (e.g. a node's tier actor) polled with the replicas and merged into /metrics."""
        self._metrics_sources[name] = fetch

    def replica_names(self) -> list[str]:
        return list(self._replicas)

    def _listen(self, producer: ProducerSpec) -> None:
        self.listener.add_producer(
            producer.name,
            producer.endpoint,
            producer.replay_endpoint,
            topic=producer.topic,
            curve_server_key=producer.curve_server_key,
        )

    # ----------------------------------------------------------------- routing

    def route(self, prompt: ParsedPrompt) -> RouteResult:
        """Choose a replica for the prompt. Raises ApiError(503) when none is healthy."""
        start = time.perf_counter()
        candidates = [r for r in self._replicas.values() if r.healthy]
        if not candidates:
            raise ApiError(503, "no healthy replica is available; retry later")
        hashes = self.hasher.hash_blocks(prompt.token_ids, lora_name=prompt.lora_name, cache_salt=prompt.cache_salt)
        matches = self.index.lookup([to_external(h) for h in hashes])
        now = time.monotonic()
        states = {
            r.spec.name: ReplicaState(
                outstanding_tokens=r.prefill.outstanding(now),
                running_requests=max(r.load.running, r.prefill.inflight_requests),
                waiting_requests=r.load.waiting,
                kv_usage=r.load.kv_usage,
            )
            for r in candidates
        }
        num_blocks = -(-len(prompt.token_ids) // self.hasher.block_size)
        decision = self.scorer.choose(states, matches, num_blocks, self._rng)
        policy = self.config.router.policy
        if policy != "kvstore":
            # A cache-blind baseline picks; the scores stay the Scorer's, for comparison.
            replica = self._baseline_choice(policy, states)
            decision = Decision(replica, decision.scores, matches.get(replica, _NO_MATCH))
        elapsed = time.perf_counter() - start
        self._route_seconds.observe(elapsed)
        self._decisions.labels(decision.replica).inc()
        matched = {name: matches.get(name, _NO_MATCH) for name in states}
        return RouteResult(decision, matched, num_blocks, elapsed)

    def _baseline_choice(self, policy: str, states: dict[str, ReplicaState]) -> str:
        names = sorted(states)
        if policy == "round_robin":
            self._round_robin += 1
            return names[self._round_robin % len(names)]
        if policy == "random":
            return self._rng.choice(names)
        assert policy == "least_loaded", policy
        return least_loaded(states, self._rng)

    async def complete(self, prompt: ParsedPrompt) -> dict[str, Any]:
        """Route, dispatch (retrying once elsewhere on ReplicaUnavailable) and build the OpenAI response."""
        request_id = f"cmpl-{uuid.uuid4().hex}"
        routed = self.route(prompt)
        tried: list[str] = []
        target = routed.decision.replica
        while True:
            tried.append(target)
            try:
                result = await self._dispatch(target, prompt, request_id, routed)
                break
            except ReplicaRejected as exc:
                self._requests.labels("rejected").inc()
                raise ApiError(400, str(exc)) from None
            except ReplicaUnavailable as exc:
                logger.warning("replica %s failed request %s: %s", target, request_id, exc)
                self._mark_unhealthy(target)
                retry = self._retry_target(prompt, tried)
                if retry is None or len(tried) >= 2:
                    self._requests.labels("failed").inc()
                    raise ApiError(503, f"replica {target} failed and no other replica could serve: {exc}") from None
                self._retries.inc()
                target = retry
        self._requests.labels("ok").inc()
        for medium, tokens in result.cached_tokens_by_medium.items():
            self._cached_tokens.labels(medium).inc(tokens)
        return self._response(request_id, prompt, target, routed, result, retried=len(tried) > 1)

    def _retry_target(self, prompt: ParsedPrompt, tried: Sequence[str]) -> str | None:
        healthy = [n for n, r in self._replicas.items() if r.healthy and n not in tried]
        if not healthy:
            return None
        try:
            decision = self.route(prompt).decision
        except ApiError:
            return None
        return decision.replica if decision.replica in healthy else healthy[0]

    async def _dispatch(self, name: str, prompt: ParsedPrompt, request_id: str, routed: RouteResult) -> ReplicaResult:
        replica = self._replicas.get(name)
        if replica is None:
            raise ReplicaUnavailable(f"{name} was removed")
        matched = routed.matched.get(name, _NO_MATCH)
        cached_guess = min(matched.total * self.hasher.block_size, len(prompt.token_ids) - 1)
        prefill = max(0, len(prompt.token_ids) - cached_guess)
        replica.prefill.dispatched(prefill, time.monotonic())
        try:
            result = await replica.spec.backend.generate(
                prompt.token_ids,
                prompt.max_tokens,
                request_id=request_id,
                cache_salt=prompt.cache_salt,
                lora_name=prompt.lora_name,
            )
        finally:
            replica.prefill.finished(prefill)
        if result.ttft_s is not None and result.queue_s is not None:
            replica.prefill.observe(result.prompt_tokens - result.cached_tokens, result.ttft_s - result.queue_s)
        return result

    def _response(
        self,
        request_id: str,
        prompt: ParsedPrompt,
        replica: str,
        routed: RouteResult,
        result: ReplicaResult,
        *,
        retried: bool,
    ) -> dict[str, Any]:
        output_ids = result.output_token_ids or []
        text = result.text if result.text is not None else self.tokenizer.decode(output_ids)
        completion_tokens = len(output_ids) if result.output_token_ids is not None else None
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": result.finish_reason}
        if result.output_token_ids is not None:
            choice["token_ids"] = output_ids
        usage: dict[str, Any] = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": completion_tokens if completion_tokens is not None else 0,
            "total_tokens": result.prompt_tokens + (completion_tokens or 0),
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": prompt.model or self.config.router.model_name,
            "choices": [choice],
            "usage": usage,
            "kvstore": {
                "replica": replica,
                "retried": retried,
                "cached_tokens": result.cached_tokens_by_medium,
                "predicted_cached_blocks": medium_dict(routed.matched.get(replica, _NO_MATCH)),
                "prompt_blocks": routed.prompt_blocks,
                "queue_s": result.queue_s,
                "ttft_s": result.ttft_s,
                "total_s": result.total_s,
                "route_s": routed.route_s,
            },
        }

    # ------------------------------------------------------------------ health

    def _mark_unhealthy(self, name: str) -> None:
        replica = self._replicas.get(name)
        if replica is None or not replica.healthy:
            return
        replica.healthy = False
        logger.warning("replica %s marked unhealthy; dropping its blocks from the index", name)
        # The reset runs on the listener thread after the unsubscribe, so no batch still being delivered
        # can put blocks back (they would outlive the replica's health and corrupt its resync).
        self.listener.remove_producer(replica.spec.events.name, reset=True)

    def _mark_healthy(self, name: str) -> None:
        replica = self._replicas.get(name)
        if replica is None or replica.healthy:
            return
        replica.healthy = True
        logger.info("replica %s is healthy again; resubscribing", name)
        self._listen(replica.spec.events)

    async def poll_health(self) -> None:
        """Poll every replica's load and every watched tier once; update health."""
        await self.poll_tiers()
        replicas = list(self._replicas.items())
        sources = list(self._metrics_sources.items())
        pages = await asyncio.gather(*(fetch() for _, fetch in sources), return_exceptions=True)
        for (source, _), page in zip(sources, pages, strict=True):
            if isinstance(page, str):
                self._metrics_pages[source] = page
            else:
                self._metrics_pages.pop(source, None)
                logger.warning("metrics source %s did not answer: %s", source, page)
        results = await asyncio.gather(*(r.spec.backend.poll() for _, r in replicas), return_exceptions=True)
        for (name, replica), result in zip(replicas, results, strict=True):
            if isinstance(result, ReplicaPoll):
                replica.load = result.load
                replica.metrics_text = result.metrics_text
                replica.failed_polls = 0
                replica.last_ok = time.monotonic()
                self._mark_healthy(name)
            else:
                replica.failed_polls += 1
                if replica.failed_polls >= self.config.router.unhealthy_after:
                    self._mark_unhealthy(name)

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.poll_health()
            except Exception:
                logger.exception("health poll failed")
            await asyncio.sleep(self.config.router.health_interval_s)

    def workers(self) -> list[dict[str, Any]]:
        health = {h.producer: h for h in self.listener.health()}
        out = []
        for name, r in self._replicas.items():
            out.append(
                {
                    "name": name,
                    "node": r.spec.node,
                    "healthy": r.healthy,
                    "running": r.load.running,
                    "waiting": r.load.waiting,
                    "kv_usage": r.load.kv_usage,
                    "inflight": r.prefill.inflight_requests,
                    "inflight_prefill_tokens": r.prefill.inflight_tokens,
                    "outstanding_prefill_tokens": round(r.prefill.outstanding(time.monotonic()), 1),
                    "prefill_tokens_per_s": round(r.prefill.tokens_per_s, 1),
                    "events": health[r.spec.events.name]._asdict() if r.spec.events.name in health else None,
                }
            )
        return out

    def _replica_pages(self) -> list[str]:
        pages = [r.metrics_text for r in self._replicas.values() if r.healthy and r.metrics_text]
        return pages + list(self._metrics_pages.values())

    def healthy_count(self) -> int:
        return sum(r.healthy for r in self._replicas.values())
