"""The worker's requests outside the scheduler: a request's choices, the table of those in flight, how each leaves.

A request of ``n`` choices is one :class:`~kvstore.workers.output.RequestGroup`
of ``n`` scheduler entries (:class:`~kvstore.workers.scheduler.RequestState`),
built by :func:`new_group`. The worker keeps every group queued or running
in a :class:`RequestTable`.

Data structures
    - ``RequestTable.groups``: ``id(group)`` -> group, every request queued
      or running;
    - ``RequestTable._cancelled``: groups whose consumer gave up, dropped
      by the next step (:meth:`RequestTable.drop_cancelled`), never in the
      middle of one.

Invariants
    - Every unfinished choice of a group in the table is queued in the
      scheduler, and every queued choice belongs to a group in the table
      (:meth:`KVWorker.check_invariants <kvstore.workers.worker.KVWorker.check_invariants>`
      compares :meth:`RequestTable.unfinished_choices` with the queues).
    - A group leaves the table exactly once, and is counted once: finished,
      aborted (cancelled) or failed (model failure, shutdown).
    - The table is guarded by the worker's ``_lock``; streams are fed
      outside it, by the caller, from the groups the table hands back.

Failure modes
    - A cancel that arrives after its request finished is ignored.
    - A model step that fails takes every request with a choice that ran:
      its other choices leave the scheduler too (:meth:`RequestTable.fail`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

from kvstore.errors import InvalidRequestError
from kvstore.openai.structured import StructuredOutputError, grammar_tokenizer
from kvstore.openai.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvstore.worker_api import GenerateRequest
from kvstore.workers.grammar import GrammarMatcher
from kvstore.workers.metrics import WorkerCounters
from kvstore.workers.model_spec import ServedModel
from kvstore.workers.output import ChoiceRecord, RequestGroup
from kvstore.workers.sampler import GREEDY, SamplingDefaults
from kvstore.workers.scheduler import RequestState, Scheduler
from kvstore.workers.stream import RequestStream


def new_group(
    request: GenerateRequest,
    defaults: SamplingDefaults,
    tokenizer: Tokenizer,
    eos_token_ids: Sequence[int],
    on_cancel: Callable[[RequestStream], None],
    other_eos_ids: Sequence[int] = (),
    vocab_size: int | None = None,
) -> RequestGroup:
    """A validated request as a group of ``n`` choices, one scheduler entry each, and its stream.

    A grammar (structured output) is compiled here, on the submitting thread, once for the request, and each
    choice gets its own copy of the matcher. Raises InvalidRequestError if it does not compile for this model's
    tokenizer (the HTTP front checks it first; a direct caller may not have).
    """
    matcher = None
    if request.sampling.grammar is not None:
        try:
            ends = [*eos_token_ids, *other_eos_ids]
            matcher = GrammarMatcher(grammar_tokenizer(tokenizer, vocab_size, ends), request.sampling.grammar)
        except StructuredOutputError as exc:
            raise InvalidRequestError(f"sampling.grammar: {exc}") from None
    request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
    arrival = time.monotonic()
    stream = RequestStream(request_id, request.sampling.n, on_cancel)
    score = request.sampling.prompt_logprobs is not None
    group = RequestGroup(request_id, stream, arrival, prompt_tokens=len(request.token_ids), score=score)
    for index in range(request.sampling.n):
        state = RequestState(request, request_id, arrival)
        state.output = ChoiceRecord(
            group, index, request.sampling, defaults, tokenizer, eos_token_ids, request.token_ids, other_eos_ids,
            grammar=matcher.copy() if matcher is not None else None,
        )  # fmt: skip
        group.choices.append(state)
    return group


def choice_record(state: RequestState) -> ChoiceRecord:
    record = state.output
    assert isinstance(record, ChoiceRecord), f"{state} has no choice record"
    return record


class RequestTable:
    """Every request queued or running, and the cancels the next step applies (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, counters: WorkerCounters) -> None:
        self._scheduler = scheduler
        self._counters = counters
        self.groups: dict[int, RequestGroup] = {}  # id(group) -> group, every request queued or running
        self._cancelled: list[RequestGroup] = []

    def add(self, group: RequestGroup) -> None:
        """Queue every choice of ``group`` in the scheduler."""
        self.groups[id(group)] = group
        for state in group.choices:
            self._scheduler.add(state)

    def cancel(self, stream: RequestStream) -> bool:
        """Mark the request of ``stream`` to be dropped by the next step; False if there is nothing to drop."""
        group = next((g for g in self.groups.values() if g.stream is stream), None)
        if group is None or group in self._cancelled:
            return False
        self._cancelled.append(group)
        return True

    def drop_cancelled(self) -> list[RequestGroup]:
        """Remove cancelled requests from the scheduler (blocks freed); the groups to close with ``abort``."""
        cancelled, self._cancelled = self._cancelled, []
        dropped = []
        for group in cancelled:
            if self.groups.pop(id(group), None) is None:
                continue  # it finished before the cancel took effect
            for state in group.choices:
                if not state.is_finished:
                    self._scheduler.abort(state)
                    self._counters.generation_tokens += len(state.output_token_ids)
            self._counters.aborted += 1
            dropped.append(group)
        return dropped

    def finish(self, group: RequestGroup) -> None:
        """Every choice of ``group`` is done."""
        self.groups.pop(id(group), None)
        self._counters.finished += 1
        self._counters.prompt_tokens += group.choices[0].prompt_tokens

    def fail(self, aborted: Sequence[RequestState]) -> list[RequestGroup]:
        """The requests of ``aborted`` choices fail whole: their other choices leave the scheduler too."""
        groups = {id(choice_record(s).group): choice_record(s).group for s in aborted}
        for group in groups.values():
            for state in group.choices:
                self._scheduler.abort(state)
            self.groups.pop(id(group), None)
        self._counters.failed += len(groups)
        return list(groups.values())

    def take_all(self) -> list[RequestGroup]:
        """Every request still in the table, removed and counted as failed (the worker stops)."""
        groups = list(self.groups.values())
        self.groups.clear()
        self._counters.failed += len(groups)
        return groups

    def unfinished_choices(self) -> set[int]:
        """``id()`` of every unfinished choice of the requests in the table."""
        return {id(s) for g in self.groups.values() for s in g.choices if not s.is_finished}


def default_tokenizer(served: ServedModel) -> Tokenizer:
    return load_tokenizer(served.checkpoint) if served.checkpoint is not None else ByteTokenizer()


def sampling_defaults(served: ServedModel) -> SamplingDefaults:
    """A checkpoint's generation_config over vLLM's defaults; seeded weights (the toy, shapes) are greedy."""
    if served.checkpoint is None:
        return GREEDY
    gen, base = served.generation, SamplingDefaults()
    return SamplingDefaults(
        temperature=base.temperature if gen.temperature is None else gen.temperature,
        top_p=base.top_p if gen.top_p is None else gen.top_p,
        top_k=base.top_k if gen.top_k is None else gen.top_k,
        min_p=base.min_p if gen.min_p is None else gen.min_p,
        repetition_penalty=base.repetition_penalty if gen.repetition_penalty is None else gen.repetition_penalty,
    )


def emit_aborts(groups: Sequence[RequestGroup], replica: str) -> None:
    """Close the streams of dropped ``groups``, each unfinished choice with ``abort``. Outside the worker's lock."""
    now = time.monotonic()
    for group in groups:
        group.stream.put(group.chunk(group.abort_deltas(), replica, now))
        group.stream.close()
