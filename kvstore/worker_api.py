"""The contract between the router (or any front) and a KV worker: requests, streamed output, results, load.

All are frozen msgspec Structs: cheap to build, picklable for Ray, and
encodable to JSON/msgpack as they are. The router builds
:class:`GenerateRequest` and reads :class:`StreamChunk` /
:class:`GenerateResult` and :class:`WorkerLoad`; the worker validates what
it receives (:mod:`kvstore.workers.validation`), so a request that reaches
the step loop can always be served.

Output travels as a stream of :class:`StreamChunk` deltas, one per step that
produced something: each carries, per choice, the tokens sampled in that
step, the text they completed (held back while a multi-byte character or a
possible stop string is unfinished), their logprobs when asked, and the
finish reason once the choice is done. The last chunk carries
:class:`RequestStats`. :func:`fold_stream` turns a whole stream into the
:class:`GenerateResult` a non-streaming caller wants, so both paths share
one source of truth.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

import msgspec

from kvstore.errors import KVStoreError
from kvstore.events import Medium


class FinishReason(StrEnum):
    """Why a choice ended; the values are OpenAI's ``finish_reason`` strings."""

    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS, a stop token id or a stop string
    ABORT = "abort"  # cancelled (the client went away) or the worker shut down


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pick each next token, with vLLM's meaning for every field.

    ``None`` means "the model's default" (its ``generation_config``; the
    built-in model defaults to greedy), which the worker resolves: the
    router never needs to know a model's defaults. ``temperature`` 0 is
    greedy. ``seed`` makes sampling reproducible on any replica: a seeded
    choice draws only from its own generator (choice ``i`` of ``n`` uses
    ``seed + i``). ``logprobs`` is the number of top alternatives returned
    with each sampled token (0: only the sampled token's); None returns none.
    ``prompt_logprobs`` asks the same of every prompt token after the first
    (vLLM's ``prompt_logprobs``): the request then computes its whole prompt,
    taking no prefix-cache hit, as vLLM does, since a cached block has no
    logits.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: no top-k
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)
    # vLLM's bad_words, as token sequences (the front tokenises the words): a sequence's last token is never
    # sampled right after the output's last tokens equal the rest of it (a one-token sequence: never)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's guided_choice (structured_outputs.choice), as token sequences: the output is one of them, whole (its
    # last token ends the choice unless a longer one goes on from it, when EOS may end it there)
    choice_token_ids: tuple[tuple[int, ...], ...] | None = None
    # Structured output (a JSON schema, regex or grammar) as llguidance grammar text, which the front compiled and
    # checked: only the tokens it allows next are sampled, and the choice ends once the grammar is complete
    grammar: str | None = None
    # A reasoning model's end of thinking (the tokens of ``</think>``): the guided choice or grammar applies from the
    # token after these (the thinking before them is free), as vLLM's structured output waits for the reasoning end
    constraint_after: tuple[int, ...] | None = None


class GenerateRequest(msgspec.Struct, frozen=True):
    """Generate up to ``max_tokens`` tokens after ``token_ids`` for each of ``sampling.n`` choices.

    ``request_id`` is echoed in the result (one is made up when None); it
    need not be unique. ``cache_salt`` and ``lora_name`` feed the block
    hashes' extra keys (a salted request shares no cache with an unsalted
    one). The ``n`` choices share the prompt's blocks.
    """

    token_ids: list[int]
    max_tokens: int
    request_id: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's log-probability, and the ``top`` alternatives as (token id, logprob), best first.

    Log-probabilities are of the model's raw distribution (before penalties,
    temperature and truncation), as vLLM reports them by default. ``rank``
    (a prompt token's: 1 + how many tokens the model ranked above it,
    vLLM's count) is None for sampled tokens.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


PromptLogprobs = list[TokenLogprob | None]  # one entry per prompt token; the first is None (nothing precedes it)


class ChoiceDelta(msgspec.Struct, frozen=True):
    """What one choice produced in one step (see the module docstring).

    ``prompt_logprobs`` (asked for with ``SamplingParams.prompt_logprobs``)
    comes on the choice's first delta with a token, and only there.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended the choice
    prompt_logprobs: PromptLogprobs | None = None


class RequestStats(msgspec.Struct, frozen=True):
    """What a request cost.

    Times are seconds from the worker receiving the request: ``queue_s``
    until first scheduled, ``ttft_s`` until the first output token,
    ``total_s`` until done. ``cached_tokens_by_medium`` counts prompt tokens
    served from cache at first admission, by the medium they came from.
    ``preempted`` counts how often a choice lost its blocks and was recomputed.
    """

    replica: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens_by_medium: dict[Medium, int]
    queue_s: float
    ttft_s: float
    total_s: float
    preempted: int

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_tokens_by_medium.values())


class StreamChunk(msgspec.Struct, frozen=True):
    """One step's output of a request; ``stats`` is set on the last chunk only."""

    request_id: str
    deltas: list[ChoiceDelta]
    stats: RequestStats | None = None


class ChoiceOutput(msgspec.Struct, frozen=True):
    """One finished choice: every token, the text, and why it ended."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = None  # the prompt's, when asked for (the same for every choice)


class GenerateResult(msgspec.Struct, frozen=True):
    """A whole request's output (its choices in index order) and what it cost."""

    request_id: str
    choices: list[ChoiceOutput]
    stats: RequestStats

    @property
    def output_token_ids(self) -> list[int]:
        """The first choice's tokens (the only choice unless ``n`` > 1)."""
        return self.choices[0].token_ids

    @property
    def replica(self) -> str:
        return self.stats.replica

    @property
    def prompt_tokens(self) -> int:
        return self.stats.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens

    @property
    def cached_tokens_by_medium(self) -> dict[Medium, int]:
        return self.stats.cached_tokens_by_medium

    @property
    def queue_s(self) -> float:
        return self.stats.queue_s

    @property
    def ttft_s(self) -> float:
        return self.stats.ttft_s

    @property
    def total_s(self) -> float:
        return self.stats.total_s

    @property
    def preempted(self) -> int:
        return self.stats.preempted


def fold_stream(chunks: Iterable[StreamChunk], n: int) -> GenerateResult:
    """Join a request's whole stream into its result; ValueError if the stream is incomplete."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    finish: list[ChoiceDelta | None] = [None] * n
    prompt_logprobs: list[PromptLogprobs | None] = [None] * n
    request_id, stats = "", None
    for chunk in chunks:
        request_id = chunk.request_id
        for delta in chunk.deltas:
            tokens[delta.index].extend(delta.token_ids)
            texts[delta.index].append(delta.text)
            if delta.logprobs is not None:
                logprobs[delta.index] = (logprobs[delta.index] or []) + delta.logprobs
            if delta.prompt_logprobs is not None:
                prompt_logprobs[delta.index] = delta.prompt_logprobs
            if delta.finish_reason is not None:
                finish[delta.index] = delta
        stats = chunk.stats or stats
    if stats is None or any(f is None for f in finish):
        raise ValueError("the stream ended before every choice finished")
    choices = [
        ChoiceOutput(i, tokens[i], "".join(texts[i]), logprobs[i], f.finish_reason, f.stop_reason, prompt_logprobs[i])  # type: ignore[union-attr,arg-type]
        for i, f in enumerate(finish)
    ]
    return GenerateResult(request_id, choices, stats)


class WorkerLoad(msgspec.Struct, frozen=True):
    """Load signals for routing: requests holding blocks, requests queued, pool usage (0..1)."""

    running: int
    waiting: int
    kv_usage: float
    num_free_blocks: int


class ModelInfo(msgspec.Struct, frozen=True):
    """What a client needs to build requests and hashes that match this worker."""

    model_name: str
    vocab_size: int
    max_context: int
    block_size: int
    hash_algo: str
    hash_seed: str
    max_new_tokens: int | None = None  # the checkpoint's cap on max_tokens (generation_config.json), if any


class WorkerShutdownError(KVStoreError, RuntimeError):
    """The worker was shut down before (or while) serving the request; send it to another replica."""
