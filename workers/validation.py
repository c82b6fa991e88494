"""Checks a :class:`GenerateRequest` against a worker's model and pool before it is queued.

Every rejection is an :class:`~kvstore.errors.InvalidRequestError` whose
message names the field and says what would be accepted; nothing invalid
reaches the step loop, so a bad request can never stall or crash it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvstore.errors import InvalidRequestError
from kvstore.worker_api import GenerateRequest, SamplingParams


class RequestLimits(NamedTuple):
    vocab_size: int
    max_context: int  # prompt + max_tokens
    block_size: int
    max_blocks: int  # blocks one request may hold: the pool minus its admission watermark


def validate_request(request: Any, limits: RequestLimits) -> GenerateRequest:
    """Return ``request`` if it can be served, else raise InvalidRequestError saying why."""
    if not isinstance(request, GenerateRequest):
        raise InvalidRequestError(f"expected a GenerateRequest, got {type(request).__name__}")
    tokens = request.token_ids
    if not isinstance(tokens, list):
        raise InvalidRequestError(f"token_ids must be a list of ints, got {type(tokens).__name__}")
    if not tokens:
        raise InvalidRequestError("token_ids (the prompt) must not be empty")
    for position, token in enumerate(tokens):
        if type(token) is not int:
            raise InvalidRequestError(f"token_ids[{position}] must be an int, got {type(token).__name__} ({token!r})")
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequestError(
                f"token_ids[{position}] = {token} is out of the vocabulary range [0, {limits.vocab_size})"
            )
    max_tokens = request.max_tokens
    if type(max_tokens) is not int:
        raise InvalidRequestError(f"max_tokens must be an int, got {type(max_tokens).__name__}")
    if max_tokens <= 0:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
    total = len(tokens) + max_tokens
    if total > limits.max_context:
        raise InvalidRequestError(
            f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) = {total} exceeds the model's context of "
            f"{limits.max_context} tokens; shorten the prompt or lower max_tokens"
        )
    # The last generated token's KV is never computed: a request holds at most total - 1 tokens of KV.
    blocks = -(-(total - 1) // limits.block_size)
    if blocks > limits.max_blocks:
        raise InvalidRequestError(
            f"the request needs {blocks} KV blocks but this worker can give one request at most "
            f"{limits.max_blocks}; shorten it or raise pool.num_blocks"
        )
    for field in ("request_id", "cache_salt", "lora_name"):
        value = getattr(request, field)
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{field} must be a string or None, got {type(value).__name__}")
    _validate_sampling(request.sampling, max_tokens, limits)
    return request


_MAX_N = 16
_MAX_LOGPROBS = 20
_MAX_BAD_SEQUENCES = 128  # the HTTP front's 64 words, each with and without a leading space
_MAX_BAD_TOKENS = 4096
_MAX_CHOICES = 256
_MAX_CHOICE_TOKENS = 1024
_MAX_GRAMMAR_CHARS = 4 << 20  # compiled from the front's limit of 1 Mi characters of schema


def _validate_sampling(sampling: Any, max_tokens: int, limits: RequestLimits) -> None:
    """The same ranges the HTTP front checks (vLLM's), for callers that bypass it (Ray, tests)."""
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    s = sampling

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise InvalidRequestError(f"sampling.{message}")

    check(1 <= s.n <= _MAX_N, f"n must be between 1 and {_MAX_N}, got {s.n}")
    check(s.temperature is None or s.temperature >= 0, f"temperature must be >= 0, got {s.temperature}")
    check(s.top_p is None or 0 < s.top_p <= 1, f"top_p must be in (0, 1], got {s.top_p}")
    check(s.top_k is None or s.top_k >= -1, f"top_k must be >= -1, got {s.top_k}")
    check(s.min_p is None or 0 <= s.min_p <= 1, f"min_p must be in [0, 1], got {s.min_p}")
    check(s.repetition_penalty is None or s.repetition_penalty > 0, "repetition_penalty must be > 0")
    check(-2 <= s.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {s.presence_penalty}")
    check(-2 <= s.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {s.frequency_penalty}")
    check(0 <= s.min_tokens <= max_tokens, f"min_tokens must be in [0, max_tokens], got {s.min_tokens}")
    check(s.logprobs is None or 0 <= s.logprobs <= _MAX_LOGPROBS, f"logprobs must be in [0, {_MAX_LOGPROBS}]")
    check(
        s.prompt_logprobs is None or (type(s.prompt_logprobs) is int and 0 <= s.prompt_logprobs <= _MAX_LOGPROBS),
        f"prompt_logprobs must be an integer in [0, {_MAX_LOGPROBS}], got {s.prompt_logprobs!r}",
    )
    check(all(isinstance(x, str) and x for x in s.stop), "stop must hold non-empty strings")
    check(s.allowed_token_ids is None or len(s.allowed_token_ids) > 0, "allowed_token_ids must not be empty")
    words = s.bad_words_token_ids
    check(len(words) <= _MAX_BAD_SEQUENCES, f"bad_words_token_ids: at most {_MAX_BAD_SEQUENCES} sequences")
    check(all(0 < len(w) <= _MAX_BAD_TOKENS for w in words), f"bad_words_token_ids: 1..{_MAX_BAD_TOKENS} ids each")
    choices = s.choice_token_ids
    check(choices is None or 0 < len(choices) <= _MAX_CHOICES, f"choice_token_ids: 1..{_MAX_CHOICES} sequences")
    check(
        all(0 < len(c) <= _MAX_CHOICE_TOKENS for c in choices or ()),
        f"choice_token_ids: 1..{_MAX_CHOICE_TOKENS} ids each",
    )
    check(
        s.grammar is None or (isinstance(s.grammar, str) and 0 < len(s.grammar) <= _MAX_GRAMMAR_CHARS),
        f"grammar: a string of 1..{_MAX_GRAMMAR_CHARS:,} characters (llguidance's grammar text)",
    )
    check(s.grammar is None or choices is None, "choice_token_ids and grammar: one kind of structured output")
    after = s.constraint_after
    check(
        after is None or (isinstance(after, tuple) and 0 < len(after) <= 16 and (s.grammar or choices) is not None),
        "constraint_after: 1..16 token ids, with a grammar or choice_token_ids",
    )
    ids = [*s.stop_token_ids, *(s.logit_bias or {}), *(s.allowed_token_ids or ()), *(t for w in words for t in w)]
    ids += [t for c in choices or () for t in c] + list(after or ())
    check(all(type(t) is int and 0 <= t < limits.vocab_size for t in ids), "token ids must be in the vocabulary")
    check(all(-100 <= v <= 100 for v in (s.logit_bias or {}).values()), "logit_bias values must be in [-100, 100]")
