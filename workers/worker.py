"""The KV worker: a paged KV pool, a model that fills it, and a continuous-batching request loop.

:class:`KVWorker` is a plain, thread-safe class (the Ray actor in
:mod:`kvstore.workers.actor` is a thin wrapper). Callers on any thread
:meth:`~KVWorker.submit` requests and get futures; one step-loop thread
runs the scheduler (:mod:`kvstore.workers.scheduler`), the model runner
(:mod:`kvstore.workers.model_runner`) and the event publisher.

A request of ``n`` choices is ``n`` scheduler entries that share the
prompt's blocks through the prefix cache (the second is admitted onto the
blocks the first registered). Its output is a :class:`RequestStream`.
The requests in flight are a :class:`~kvstore.workers.request_table.RequestTable`;
the step log and the metrics come from :mod:`kvstore.workers.worker_telemetry`.

Each step::

    with lock:  collect finished offload jobs; drop cancelled requests; schedule (allocate/evict/cache in the
                block pool); queue stores of cached free blocks; publish events
    (no lock)   model forward: compute the step's tokens, write their KV, get next-token logits (and the prompt
                logprobs of the rows that score a prompt)
    (no lock)   sample the choices that reached their sequence's end; detokenise; decide who finished
    with lock:  record the tokens, free finished choices' blocks, queue their stores, publish events
    (no lock)   put each request's chunk on its stream

A lower tier's copies and calls run on the offloader's own thread
(:mod:`kvstore.workers.offload`, held in its :mod:`~kvstore.workers.offload_slot`),
never under ``_lock``: ``load``, ``health`` and ``metrics_text`` take only ``_lock``,
held for bookkeeping alone, so a slow or dead tier never delays them.

Locks
-----
``_lock`` guards the block pool, the manager and the scheduler. Every
locked section that mutates the pool ends by draining the pool's events
and publishing them, so whenever the lock is free the pool holds no
unpublished event: a snapshot taken under the lock (the publisher's
``snapshot_source``) is exactly the state after batch ``last_seq``.
``_step_lock`` is held for a whole step (outer to ``_lock``) so that
:meth:`KVWorker.check_invariants` sees the state between steps.

Failure
-------
Invalid requests raise :class:`~kvstore.errors.InvalidRequestError` from
``submit``/``generate`` before anything is queued. A cancelled stream is
dropped at the start of the next step, its blocks freed (counted as
``aborted``). If a model step raises, the running requests fail with the
error, and the whole prefix cache is dropped (blocks registered for that
step were never filled, so nothing may hit them); the worker keeps
serving. After :meth:`KVWorker.shutdown` (or if the loop itself dies)
every unfinished request fails with
:class:`~kvstore.worker_api.WorkerShutdownError`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, NamedTuple

import torch

from kvstore.block_pool import BlockPool
from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.events import Medium
from kvstore.hashing import BlockHasher
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.metrics import render
from kvstore.openai.tokenizer import Tokenizer
from kvstore.publisher import EventEndpoints, NullEventPublisher, Snapshot, ZmqEventPublisher
from kvstore.worker_api import (
    ChoiceDelta,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    TokenLogprob,
    WorkerLoad,
    WorkerShutdownError,
)
from kvstore.workers.config import WorkerSettings
from kvstore.workers.device import resolve_device
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import LoopGauges, OffloadState, WorkerCounters
from kvstore.workers.model_runner import ModelRunner, PromptRows
from kvstore.workers.offload_backend import NoOffload, OffloadBackend
from kvstore.workers.offload_slot import OffloadSlot
from kvstore.workers.output import ChoiceRecord, RequestGroup
from kvstore.workers.request_table import (
    RequestTable,
    choice_record,
    default_tokenizer,
    emit_aborts,
    new_group,
    sampling_defaults,
)
from kvstore.workers.sampler import Sampler, eos_split
from kvstore.workers.scheduler import RequestState, Scheduler, SchedulerOutput
from kvstore.workers.stream import RequestStream
from kvstore.workers.validation import RequestLimits, validate_request
from kvstore.workers.worker_telemetry import STEP_LOG, StepRecord, worker_registry

__all__ = ["KVWorker", "StepRecord"]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01


class Sampled(NamedTuple):
    """A step's sampled rows: the scheduled rows that computed their sequence's last token, their choices,
    and each one's token and logprobs."""

    rows: list[int]
    states: list[RequestState]
    records: list[ChoiceRecord]
    tokens: list[tuple[int, TokenLogprob | None]]


class KVWorker:
    """One replica: owns its KV tensor pool, block pool, cache manager, scheduler, model and publisher.

    ``offload`` plugs a lower tier in at construction (see
    :meth:`attach_offload`). The step loop starts in the constructor; call
    :meth:`shutdown` to stop it and release the sockets and KV memory.
    """

    def __init__(
        self,
        name: str,
        config: WorkerSettings,
        *,
        offload: OffloadBackend | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """``tokenizer`` defaults to the checkpoint's (the byte tokenizer for seeded weights)."""
        self.name = name
        self.config = config
        model = config.worker
        block_size = config.cache.block_size
        num_blocks = config.pool.num_blocks
        self.device = resolve_device(model.device)
        self._runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device=self.device)
        self.served = self._runner.served  # name, vocabulary, context limit, eos ids of the model being served
        self.kv_pool: KVTensorPool = self._runner.kv_pool
        self.block_pool = BlockPool(
            num_blocks, block_size=block_size, enable_caching=config.cache.enable_prefix_caching, medium=Medium.GPU
        )
        hasher = BlockHasher.from_config(config.cache)
        self._manager = KVCacheManager(self.block_pool, hasher, watermark=config.pool.watermark)
        self._scheduler = Scheduler(
            self._manager, max_num_seqs=model.max_num_seqs, max_num_batched_tokens=model.max_num_batched_tokens
        )
        self._limits = RequestLimits(
            self.served.vocab_size, self.served.max_context, block_size, num_blocks - self._manager.watermark_blocks
        )
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self.tokenizer: Tokenizer = tokenizer or default_tokenizer(self.served)
        self._defaults = sampling_defaults(self.served)
        self._eos, self._other_eos = eos_split(self.tokenizer.eos_token_ids, self.served.generation.eos_token_ids)
        self._sampler = Sampler()
        self._counters = WorkerCounters()
        self._requests = RequestTable(self._scheduler, self._counters)
        self._closed = False
        self._last_error: str | None = None
        self._kick = threading.Event()  # set by the offload thread when a job finishes
        self._step_log: deque[StepRecord] = deque(maxlen=STEP_LOG)
        self._last_batch: tuple[int, int] | None = None
        self._offload = OffloadSlot(self.block_pool, self.kv_pool, self._scheduler, self._kick.set)
        self.attach_offload(offload or NoOffload())

        self._publisher: ZmqEventPublisher | NullEventPublisher
        if config.events.enabled:
            self._publisher = ZmqEventPublisher(config.events, snapshot_source=self._snapshot)
        else:
            self._publisher = NullEventPublisher()
        self._registry = worker_registry(
            name, self._manager, self._counters, self._gauges, self._offload.link_state, self._offload.state,
            model_name=self.served.name,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._loop, name=f"kv-worker-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the tier seam

    def attach_offload(self, backend: OffloadBackend, *, wait_s: float | None = None) -> None:
        """Plug a lower tier in: the ONE place that wires the pool's eviction hook and the admission step.

        An :class:`~kvstore.workers.offload.Offloader` over ``backend`` (one
        offload thread) becomes the block pool's eviction hook and the
        scheduler's admission step (:mod:`kvstore.workers.offload_slot`; contracts in
        :mod:`kvstore.workers.offload`);
        :class:`NoOffload` detaches any tier. An admission waits at most ``wait_s``
        (default ``worker.offload_wait_s``) for the tier's answer and its copy, then recomputes.
        Replaces the tier attached before, waiting for the jobs it has running; takes effect from the
        next step.
        """
        wait_s = self.config.worker.offload_wait_s if wait_s is None else wait_s
        with self._step_lock, self._lock:
            if self._offload.attach(backend, wait_s):
                self._publish_pending()  # loads the old tier finished registered blocks

    def drain_offload(self, timeout: float | None = 30.0) -> bool:
        """Wait until the offloader's queued jobs have run and are collected (tests, benchmarks); False on timeout.

        Stores of blocks already free are queued first, so afterwards every
        cached free block is in the tier (or refused by it).
        """
        with self._step_lock, self._lock:
            if not self._offload.flush(timeout):
                return False
            self._publish_pending()
            return True

    # ------------------------------------------------------------- requests

    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a request; its output arrives on the returned stream (which ends with the error that stopped it).

        Raises InvalidRequestError (nothing queued) for a request this worker
        can never serve, WorkerShutdownError after :meth:`shutdown`.
        """
        try:
            validate_request(request, self._limits)
            group = new_group(
                request, self._defaults, self.tokenizer, self._eos, self._cancel, self._other_eos,
                self._limits.vocab_size,
            )  # fmt: skip
        except InvalidRequestError:
            with self._lock:
                self._counters.rejected += 1
            raise
        with self._lock:
            if self._closed:
                raise WorkerShutdownError(f"worker {self.name} is shut down; send the request to another replica")
            self._requests.add(group)
            self._work.notify()
        return group.stream

    async def asubmit(self, request: GenerateRequest) -> RequestStream:
        """:meth:`submit` from an event loop. A request with a grammar is submitted from a worker thread (compiling
        its matcher can take milliseconds, or a second the first time for a large vocabulary), so the loop keeps
        answering health checks and other requests; cancelled meanwhile, the request is cancelled once queued."""
        if getattr(getattr(request, "sampling", None), "grammar", None) is None:
            return self.submit(request)
        lock = threading.Lock()
        gone = False  # the caller stopped waiting
        submitted: RequestStream | None = None

        def run() -> RequestStream:
            nonlocal submitted
            stream = self.submit(request)
            with lock:
                submitted = stream
                if gone:
                    stream.cancel()
            return stream

        try:
            return await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, run))
        except asyncio.CancelledError:  # the caller went away (or its loop is closing): whichever side is last
            with lock:  # to see the stream cancels it, so no request runs for nobody
                gone = True
                if submitted is not None:
                    submitted.cancel()
            raise

    def generate(self, request: GenerateRequest) -> GenerateResult:
        """Submit and wait. Raises what :meth:`submit` raises, or the error that stopped the request."""
        return self.submit(request).result()

    def _cancel(self, stream: RequestStream) -> None:
        """A stream's consumer gave up: drop its request at the start of the next step (see the module docstring)."""
        with self._lock:
            if self._requests.cancel(stream):
                self._work.notify()

    # -------------------------------------------------------------- queries

    @property
    def alive(self) -> bool:
        """The step loop runs (False once shut down, or once it died)."""
        return self._thread.is_alive() and not self._closed

    def load(self) -> WorkerLoad:
        with self._lock:
            return WorkerLoad(
                running=len(self._scheduler.running),
                waiting=len(self._scheduler.waiting),
                kv_usage=self.block_pool.usage,
                num_free_blocks=self.block_pool.num_free_blocks,
            )

    def info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self.served.name,
            vocab_size=self._limits.vocab_size,
            max_context=self._limits.max_context,
            block_size=self.config.cache.block_size,
            hash_algo=self.config.cache.hash_algo,
            hash_seed=self.config.cache.hash_seed,
            max_new_tokens=self.served.generation.max_new_tokens,
        )

    def event_endpoints(self) -> EventEndpoints:
        """The resolved PUB and ROUTER endpoints; ConfigError when events are disabled."""
        endpoints = self._publisher.endpoints
        if endpoints is None:
            raise ConfigError(f"worker {self.name} publishes no KV events (events.enabled is false)")
        return endpoints

    def health(self) -> dict[str, Any]:
        with self._lock:
            return {
                "name": self.name,
                "alive": self._thread.is_alive() and not self._closed,
                "device": str(self.device),
                "running": len(self._scheduler.running),
                "waiting": len(self._scheduler.waiting),
                "kv_usage": self.block_pool.usage,
                "num_free_blocks": self.block_pool.num_free_blocks,
                "num_cached_blocks": self.block_pool.num_cached_blocks,
                "steps": self._counters.steps,
                "preemptions": self._scheduler.num_preemptions,
                "last_seq": self._publisher.last_seq,
                "last_error": self._last_error,
            }

    def cached_hashes(self) -> list[int]:
        """External (64-bit) hashes of every cached block in the pool, one per block (duplicates kept)."""
        with self._lock:
            return [int(b.external_hash) for b in self.block_pool.cached_blocks() if b.external_hash is not None]

    def check_invariants(self) -> None:
        """Assert pool, manager and scheduler bookkeeping between steps; raises AssertionError naming the fault."""
        with self._step_lock, self._lock:
            self._offload.drain(30.0)  # let running jobs end: their holds are then counted exactly
            self._publish_pending()
            self._scheduler.check_invariants()
            assert self.kv_pool.num_blocks == self.block_pool.num_blocks, "KV tensors and block pool disagree"
            queued = {id(s) for s in (*self._scheduler.waiting, *self._scheduler.running)}
            held = self._requests.unfinished_choices()
            assert queued == held, "a queued choice has no request, or an unfinished choice is not queued"

    def offload_state(self) -> OffloadState | None:
        """The offloader's counters and jobs in flight, read as ``/metrics`` reads them; None without a tier."""
        return self._offload.state()

    def recent_steps(self) -> list[StepRecord]:
        """The last steps that ran work (up to 8192), oldest first: for benchmarks and diagnosis."""
        with self._lock:
            return list(self._step_log)

    def metrics_text(self) -> bytes:
        """This worker's metrics in the Prometheus text format."""
        with self._lock:
            return render(self._registry)

    @property
    def publisher(self) -> ZmqEventPublisher | NullEventPublisher:
        return self._publisher

    # ------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the loop after its current step, fail unfinished requests, close the publisher, free the KV.

        Idempotent; must not be called from the step loop.
        """
        with self._lock:
            self._closed = True
            self._work.notify_all()
        self._thread.join()
        with self._step_lock, self._lock:
            self._scheduler.abort_all()
            self._offload.release(timeout=30.0)
            self._offload.close()
            self._publish_pending()
            groups = self._requests.take_all()
        for group in groups:
            group.stream.fail(
                WorkerShutdownError(f"worker {self.name} shut down before request {group.request_id!r} finished")
            )
        self._publisher.close()
        self._runner.close()

    # ------------------------------------------------------------ step loop

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._scheduler.has_work and not self._offload.has_done:
                        # Idle, with offload jobs out: look again soon to collect them and store more.
                        self._work.wait(_IDLE_WAIT_S if self._offload.busy else None)
                    if self._closed:
                        return
                self._kick.clear()
                with self._step_lock:
                    started = time.perf_counter()
                    offload_before = self._offload.step_loop_seconds
                    progressed = self._step()
                    seconds = time.perf_counter() - started
                    self._counters.step_seconds += seconds
                    if self._last_batch is not None:
                        requests, tokens = self._last_batch
                        record = StepRecord(seconds, requests, tokens, self._offload.step_loop_seconds - offload_before)
                        with self._lock:
                            self._step_log.append(record)
                if not progressed:  # waiting on room, or on the offloader: a finished job wakes us early
                    self._kick.wait(_IDLE_WAIT_S)
        except BaseException as exc:
            logger.exception("worker %s: step loop died", self.name)
            self._die(exc)

    def _step(self) -> bool:
        """One scheduler step; False when nothing could be scheduled."""
        with self._lock:
            self._offload.poll()
            cancelled = self._requests.drop_cancelled()
            output = self._scheduler.schedule(time.monotonic())
            self._offload.launch_stores()
            self._counters.steps += 1
            self._publish_pending()
        emit_aborts(cancelled, self.name)
        self._last_batch = None
        if not output.scheduled:
            return bool(cancelled)
        self._last_batch = (len(output.scheduled), sum(work.num_new_tokens for work in output.scheduled))
        scoring = [(row, work, t) for row, work in enumerate(output.scheduled) if (t := work.prompt_targets())]
        asks = [PromptRows(row, targets, work.state.prompt_logprobs or 0) for row, work, targets in scoring]
        try:
            step = self._runner.execute([work.slice for work in output.scheduled], asks)
        except Exception as exc:
            logger.exception("worker %s: model step failed; dropping running requests and the prefix cache", self.name)
            self._recover_from_model_failure(exc)
            return True
        for (_, work, _), scores in zip(scoring, step.prompt_logprobs, strict=True):
            choice_record(work.state).group.score_prompt(work.state.num_computed_tokens, scores)
        try:
            sampled = self._sample(output, step.logits)
        except (
            Exception
        ) as exc:  # a bug, not a request's fault (the sampler copes with any valid one): as a model failure
            logger.exception("worker %s: sampling failed; dropping running requests and the prefix cache", self.name)
            self._recover_from_model_failure(exc)
            return True
        self._finish_step(output, sampled)
        return True

    def _sample(self, output: SchedulerOutput, logits: torch.Tensor) -> Sampled:
        rows = [row for row, work in enumerate(output.scheduled) if work.samples]
        states = [output.scheduled[row].state for row in rows]
        records = [choice_record(state) for state in states]
        return Sampled(rows, states, records, self._sampler.sample(logits[rows], [r.sampling for r in records]))

    def _finish_step(self, output: SchedulerOutput, sampled: Sampled) -> None:
        deltas: dict[int, tuple[RequestGroup, list[ChoiceDelta]]] = {}
        tokens: dict[int, int] = {}
        prompts = 0  # prompt tokens of requests whose first token this step sampled (vLLM's per-step count)
        for row, state, record, (token, logprob) in zip(*sampled, strict=True):
            tokens[row] = token
            delta = record.accept(state, token, logprob)
            deltas.setdefault(id(record.group), (record.group, []))[1].append(delta)
            if record.index == 0 and len(state.output_token_ids) == 1:
                prompts += state.prompt_tokens
        # A choice whose grammar failed mid-answer (a parser limit) cannot go on, and its output so far may not
        # be a prefix of the grammar: its request fails whole, as a request the worker cannot serve.
        broken = {
            key: (group, failure)
            for key, (group, _) in deltas.items()
            if (failure := next((f for s in group.choices if (f := choice_record(s).failure)), None)) is not None
        }
        now = time.monotonic()
        with self._lock:
            self._counters.tokens_sampled += len(tokens)
            self._counters.prompts_started += prompts
            finished = self._scheduler.update(output, tokens, now)
            for group, _ in broken.values():
                self._requests.fail(group.choices)
            if finished:
                self._offload.launch_stores()  # the finished choices' cached blocks
            self._publish_pending()
            for state in finished:
                self._counters.generation_tokens += len(state.output_token_ids)
            done = [group for key, (group, _) in deltas.items() if group.done and key not in broken]
            for group in done:
                self._requests.finish(group)
        for key, (group, group_deltas) in deltas.items():
            if key in broken:
                reason = broken[key][1]
                group.stream.fail(InvalidRequestError(f"structured output failed mid-answer: {reason}"))
                continue
            group.stream.put(group.chunk(group_deltas, self.name, now))
            if group.done:
                group.stream.close()

    def _recover_from_model_failure(self, exc: Exception) -> None:
        with self._lock:
            aborted = self._scheduler.abort_running()
            # Blocks registered in the prefix cache for the failed step were never filled. The offloader's
            # holds go first (a failure path: it waits for the copies running, bounded by the tier's deadline).
            self._offload.release(timeout=None)
            cleared = self.block_pool.reset_prefix_cache()
            assert cleared, "no request runs, yet blocks are referenced"
            self._publish_pending()
            groups = self._requests.fail(aborted)  # a request with a choice that ran fails whole
            self._last_error = f"model step failed: {exc!r}"
        for group in groups:
            error = RuntimeError(f"worker {self.name}: model step failed for request {group.request_id!r}: {exc!r}")
            error.__cause__ = exc
            group.stream.fail(error)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._closed = True
            self._last_error = f"step loop died: {exc!r}"
            groups = self._requests.take_all()
        for group in groups:  # each one, whatever another raises: no reader may be left waiting
            try:
                group.stream.fail(WorkerShutdownError(f"worker {self.name}: step loop died ({exc!r})"))
            except Exception:
                logger.exception("worker %s: could not end request %r", self.name, group.request_id)

    # ------------------------------------------------------------- internals

    def _publish_pending(self) -> None:
        """Drain the pool's events and publish them as one batch. Caller holds ``_lock``."""
        events = self.block_pool.take_events()
        if events:
            self._publisher.publish(events)

    def _snapshot(self) -> Snapshot:
        """The publisher's snapshot source: runs on its thread, consistent because we take ``_lock``."""
        with self._lock:
            return Snapshot(self._publisher.last_seq, self.block_pool.snapshot_events())

    def _gauges(self) -> LoopGauges:
        return LoopGauges(len(self._scheduler.running), len(self._scheduler.waiting), self._scheduler.num_preemptions)

    def __repr__(self) -> str:
        return f"KVWorker({self.name!r}, device={self.device}, blocks={self.block_pool.num_blocks})"
