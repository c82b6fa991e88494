"""Step-level continuous batching over one KV cache manager (vLLM v1's scheduling, simplified).

A request's tokens are its prompt plus the tokens generated so far;
``num_computed_tokens`` of them have KV in the pool. Each step gives every
scheduled request ``num_tokens - num_computed_tokens`` more tokens to
compute (capped by the step's token budget, which chunks long prefills):
a decode is the one token sampled last step, a prefill is the rest of
the prompt after the prefix-cache hit.

:meth:`Scheduler.schedule`:

1. Running requests first, in admission order. Each reserves slots for its
   tokens; when the pool is out of blocks the *last* running request is
   preempted (its blocks freed, ``num_computed_tokens`` reset, sent back to
   the head of the queue to be recomputed, prompt and output so far) until
   the reservation fits -- or the request preempts itself. While the
   offloader holds blocks for stores (they return within milliseconds),
   the request waits for them instead: it and everything after it sit out
   this step, and nothing is admitted.
2. Then, unless someone was preempted this step, waiting requests in
   arrival order while the budget, ``max_num_seqs`` and the pool allow:
   prefix lookup, then the offloader (:mod:`kvstore.workers.offload`), then
   ``allocate_slots``; a None (no room) stops admission for this step, so
   the queue stays first come first served. A choice that must score its
   prompt (``RequestState.skip_prefix_cache``: prompt logprobs not yet
   made) takes no hit, GPU or lower tier, as vLLM's does: a cached block
   has no logits. A request whose lower-tier
   lookup or load is still running (the offloader answers None) is
   skipped and keeps its place; the requests behind it may be admitted.

Invariants (checked by :meth:`Scheduler.check_invariants`):

- a waiting request holds no blocks and has ``num_computed_tokens == 0``;
- between steps, a running request has exactly ``num_computed_tokens``
  slots reserved and ``0 < num_computed_tokens < num_tokens`` (the last
  token, just sampled or not yet prefilled, is never computed);
- ``len(running) <= max_num_seqs``, and the pool ref counts equal the
  block tables (the manager's invariant).

Pure logic, no threads or tensors; not thread-safe (the worker holds its
lock around :meth:`schedule` and :meth:`update`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple, Protocol

from kvstore.events import MEDIA, Medium
from kvstore.kv_cache_manager import NO_HIT, CacheRequest, KVCacheManager, PrefixHit
from kvstore.worker_api import FinishReason, GenerateRequest
from kvstore.workers.attention import SequenceSlice
from kvstore.workers.offload_backend import Promotion

_internal_ids = itertools.count()


class Admissions(Protocol):
    """What the scheduler asks the offloader (:class:`kvstore.workers.offload.Offloader`) at admission."""

    def admit(self, request: CacheRequest, gpu_hit: PrefixHit) -> Promotion | None: ...
    def admitted(self, request: CacheRequest) -> None: ...
    def abort(self, request: CacheRequest) -> None: ...
    def held_refs(self) -> Mapping[int, int]: ...
    def release_ready(self, keep: CacheRequest) -> int: ...
    @property
    def store_held_blocks(self) -> int: ...


class NoAdmissions:
    """No lower tier: every request is admitted with its GPU hit."""

    def admit(self, request: CacheRequest, gpu_hit: PrefixHit) -> Promotion | None:
        return Promotion(gpu_hit, {})

    def admitted(self, request: CacheRequest) -> None:
        return None

    def abort(self, request: CacheRequest) -> None:
        return None

    def held_refs(self) -> Mapping[int, int]:
        return {}

    def release_ready(self, keep: CacheRequest) -> int:
        return 0

    @property
    def store_held_blocks(self) -> int:
        return 0


class RequestState:
    """One choice of a request through its life: waiting -> running (-> preempted -> waiting ...) -> finished.

    The scheduler owns the fields that track KV (``cache_request``,
    ``num_computed_tokens``, preemptions); the worker owns what sampling and
    detokenising need (``output``, an opaque per-choice record the scheduler
    never reads) and decides when the choice is finished
    (:meth:`finish`), which :meth:`Scheduler.update` then acts on.
    """

    __slots__ = (
        "arrival",
        "cache_request",
        "cached_tokens_by_medium",
        "finish_reason",
        "first_scheduled",
        "first_token",
        "max_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "output",
        "output_token_ids",
        "prompt_logprobs",
        "prompt_tokens",
        "request_id",
        "skip_prefix_cache",
        "stop_reason",
    )

    def __init__(self, request: GenerateRequest, request_id: str, arrival: float, output: object = None) -> None:
        self.request_id = request_id  # the caller's id, echoed back; need not be unique
        # The manager keys block tables by a private id, unique per worker.
        self.cache_request = CacheRequest(
            f"{request_id}#{next(_internal_ids)}",
            request.token_ids,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
        )
        self.prompt_tokens = len(request.token_ids)
        self.max_tokens = request.max_tokens
        self.output = output
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.arrival = arrival
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.cached_tokens_by_medium: dict[Medium, int] | None = None  # set at first admission
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs = request.sampling.prompt_logprobs  # alternatives per prompt token, None: not asked
        # Admitted without a prefix hit while its prompt's logprobs are wanted (the worker clears it once made).
        self.skip_prefix_cache = self.prompt_logprobs is not None and self.prompt_tokens > 1

    @property
    def key(self) -> str:
        return self.cache_request.request_id

    @property
    def num_tokens(self) -> int:
        return self.cache_request.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Mark the choice done; the next :meth:`Scheduler.update` (or :meth:`Scheduler.abort`) frees its blocks."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (
            f"RequestState({self.key}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"out={len(self.output_token_ids)}/{self.max_tokens})"
        )


class ScheduledRequest(NamedTuple):
    state: RequestState
    num_new_tokens: int  # tokens computed this step, from state.num_computed_tokens on
    slice: SequenceSlice  # what the model runner computes

    @property
    def samples(self) -> bool:
        """This step computes up to the sequence's last token, so its logits give the next token."""
        return self.state.num_computed_tokens + self.num_new_tokens >= self.state.num_tokens

    def prompt_targets(self) -> list[int]:
        """With prompt logprobs wanted: the prompt tokens this step's rows predict, one per leading row (row ``r``
        at position ``p`` predicts the token at ``p + 1``); empty otherwise, or past the prompt."""
        state = self.state
        if not state.skip_prefix_cache:
            return []
        start = state.num_computed_tokens
        end = min(start + self.num_new_tokens, state.prompt_tokens - 1)  # the last prompt token predicts output
        return state.cache_request.token_ids[start + 1 : end + 1] if end > start else []


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[RequestState]  # preempted this step (now waiting)


class Scheduler:
    """Waiting queue + running list over one :class:`KVCacheManager` (see the module docstring)."""

    def __init__(
        self,
        manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        offloader: Admissions | None = None,
    ) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.offloader: Admissions = offloader or NoAdmissions()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def schedule(self, now: float) -> SchedulerOutput:
        """Choose this step's work and reserve its slots (mutates the pool: allocations, evictions, caching)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[RequestState] = []
        index = 0
        stalled = False  # a running request waits for blocks held by stores: no preemption, no admission
        while index < len(self.running) and budget > 0:
            state = self.running[index]
            num_new = min(state.num_tokens - state.num_computed_tokens, budget)
            while self.manager.allocate_slots(state.cache_request, num_new) is None:
                if self.offloader.store_held_blocks:  # they come back when their copies end (milliseconds):
                    stalled = True  # wait for them rather than preempt and recompute
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is state:
                    break
            else:
                scheduled.append(self._scheduled(state, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself (or waits for held blocks): nothing after it is scheduled
        skipped: list[RequestState] = []  # waiting on the offloader: they keep their places
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted and not stalled:
            state = self.waiting[0]
            if state.skip_prefix_cache:  # its prompt is scored: every token computed, none looked up
                promotion: Promotion | None = Promotion(NO_HIT, {})
            else:
                gpu_hit = self.manager.get_computed_blocks(state.cache_request)
                promotion = self.offloader.admit(state.cache_request, gpu_hit)
            if promotion is None:
                skipped.append(self.waiting.popleft())
                continue
            hit = promotion.hit
            num_new = min(state.num_tokens - hit.num_tokens, budget)
            looked_up = not state.skip_prefix_cache
            if self.manager.allocate_slots(state.cache_request, num_new, hit, looked_up=looked_up) is None:
                # Nothing runs, so nothing will free a block: loaded requests behind this one must not keep
                # their blocks from it (it would wait forever, and everything behind it).
                if not self.running and self.offloader.release_ready(state.cache_request):
                    continue
                break
            if not state.skip_prefix_cache:
                self.offloader.admitted(state.cache_request)
            self.waiting.popleft()
            self.running.append(state)
            state.num_computed_tokens = hit.num_tokens
            if state.cached_tokens_by_medium is None:
                by_medium = dict.fromkeys(MEDIA, 0)
                # The loaded blocks are in the pool by now (a later lookup finds them there): count them once.
                by_medium[Medium.GPU] = hit.num_tokens - sum(promotion.promoted_tokens.values())
                for medium, tokens in promotion.promoted_tokens.items():
                    by_medium[medium] += tokens
                state.cached_tokens_by_medium = by_medium
                state.first_scheduled = now
            scheduled.append(self._scheduled(state, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return SchedulerOutput(scheduled, preempted)

    def update(self, output: SchedulerOutput, sampled: Mapping[int, int], now: float) -> list[RequestState]:
        """Record a step: ``sampled`` maps a scheduled row to the token it produced; returns the choices that finished.

        Rows that computed up to their sequence's last token must be in
        ``sampled`` (their token becomes part of the sequence); prefill chunks
        that did not are absent. A choice the worker marked finished
        (:meth:`RequestState.finish`) releases its blocks here.
        """
        finished: list[RequestState] = []
        for row, work in enumerate(output.scheduled):
            state = work.state
            samples = work.samples
            state.num_computed_tokens += work.num_new_tokens
            if not samples:
                continue
            assert row in sampled, f"{state} computed its last token but was given none"
            state.cache_request.append_tokens([sampled[row]])
            if state.first_token is None:
                state.first_token = now
            if state.is_finished:
                self.manager.free(state.cache_request)
                finished.append(state)
        if finished:
            done = {id(s) for s in finished}
            self.running = [s for s in self.running if id(s) not in done]
        return finished

    def abort(self, state: RequestState) -> bool:
        """Drop one choice wherever it is (its blocks freed); False if the scheduler does not hold it."""
        if state in self.waiting:
            self.waiting.remove(state)
            self.offloader.abort(state.cache_request)
            return True
        if state in self.running:
            self.running.remove(state)
            self.manager.free(state.cache_request)
            return True
        return False

    def abort_running(self) -> list[RequestState]:
        """Drop every running request (their blocks freed); returns them."""
        aborted, self.running = self.running, []
        for state in aborted:
            self.manager.free(state.cache_request)
        return aborted

    def abort_all(self) -> list[RequestState]:
        """Drop every request, running and waiting; returns them."""
        aborted = self.abort_running() + list(self.waiting)
        for state in self.waiting:
            self.offloader.abort(state.cache_request)
        self.waiting.clear()
        return aborted

    # -------------------------------------------------------------- internals

    def _scheduled(self, state: RequestState, num_new: int) -> ScheduledRequest:
        start = state.num_computed_tokens
        tokens = state.cache_request.token_ids[start : start + num_new]
        part = SequenceSlice(tokens, start, self.manager.block_ids(state.key))
        return ScheduledRequest(state, num_new, part)

    def _preempt(self, state: RequestState) -> None:
        self.manager.free(state.cache_request)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(state)

    def check_invariants(self) -> None:
        """Assert the scheduler and its manager agree (see the module docstring)."""
        self.manager.check_invariants(self.offloader.held_refs())
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > {self.max_num_seqs}"
        assert self.manager.num_running == len(self.running), (
            f"manager holds {self.manager.num_running} block tables for {len(self.running)} running requests"
        )
        for state in self.waiting:
            assert state.num_computed_tokens == 0, f"waiting {state} has computed tokens"
            assert not self.manager.block_ids(state.key), f"waiting {state} holds blocks"
        for state in self.running:
            reserved = self.manager.num_tokens_reserved(state.key)
            assert reserved == state.num_computed_tokens, f"{state}: {reserved} slots reserved"
            assert 0 < state.num_computed_tokens < state.num_tokens, f"{state}: bad computed count"
            assert not state.is_finished, f"finished {state} still running"
