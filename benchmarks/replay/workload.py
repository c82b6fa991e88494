"""The requests ``kvstore replay`` sends: a Mooncake trace expanded into token ids, or a synthetic workload.

Mooncake (:mod:`kvstore.benchmarks.mooncake` parses the file): each 512-token hash id of
a prompt becomes ``block_tokens`` tokens, so a trace prompt of ``L`` tokens
becomes about ``L * block_tokens / 512`` tokens and keeps its whole prefix
structure -- equal hash ids give equal tokens, so two requests share exactly
the leading blocks the trace says they share. With ``block_tokens`` equal to
the cache's ``block_size`` (16 by default) one hash id is one KV block.

The tokens of hash id ``k`` are deterministic: ``shake_128(k)`` read as
``block_tokens`` 32-bit words, each modulo the model's vocabulary. This is
:class:`~kvstore.benchmarks.mooncake.TraceExpander`'s scheme (token ``j`` of id ``k``
is ``k * 512 + j``) folded into a small vocabulary: plain ``k * T + j``
modulo 512 would repeat every ``512 / T`` ids and turn distinct blocks into
false prefix hits; a hash does not (two ids collide with probability
``vocab ** -T``).

Outputs scale the same way (``ceil(output_length * T / 512)``), at least 1
and at most ``max_tokens``. A prompt that with its output exceeds the
model's context is cut to fit, keeping its leading (shareable) tokens;
:attr:`Workload.clipped` counts them so the command can say so.

Synthetic: ``groups`` system prompts of ``prefix_tokens`` random tokens;
each request picks a group at random and appends ``suffix_tokens`` random
tokens of its own -- the shape a prefix cache exists for.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import NamedTuple

from kvstore.benchmarks.mooncake import MOONCAKE_BLOCK_TOKENS, MooncakeRequest, iter_trace
from kvstore.errors import ConfigError


class ReplayRequest(NamedTuple):
    """One request to send: its prompt, its output length, and when the trace sent it."""

    arrival_s: float | None  # seconds after the trace's first request; None when the workload has no timestamps
    token_ids: list[int]
    max_tokens: int


class Workload(NamedTuple):
    """The requests of one replay, in trace order."""

    source: str  # what they came from, for reports
    requests: list[ReplayRequest]
    clipped: int  # prompts cut to fit the context
    longest_prompt: int  # tokens of the longest prompt sent (after clipping)


class ModelShape(NamedTuple):
    """What the prompts must fit: token ids in ``[0, vocab_size)``, prompt + output <= ``max_context``."""

    vocab_size: int
    max_context: int


def hash_id_tokens(hash_id: int, block_tokens: int, vocab_size: int) -> list[int]:
    """The ``block_tokens`` tokens standing for Mooncake hash id ``hash_id`` (module docstring)."""
    digest = hashlib.shake_128(hash_id.to_bytes(8, "big", signed=True)).digest(4 * block_tokens)
    return [int.from_bytes(digest[4 * j : 4 * j + 4], "big") % vocab_size for j in range(block_tokens)]


def scaled_length(tokens: int, block_tokens: int) -> int:
    """``tokens`` of the trace in replay tokens: ``ceil(tokens * block_tokens / 512)``."""
    return -(-tokens * block_tokens // MOONCAKE_BLOCK_TOKENS)


def expand_mooncake(request: MooncakeRequest, block_tokens: int, vocab_size: int) -> list[int]:
    """The prompt of one trace request: its hash ids' tokens, cut at its scaled input length.

    A prompt covers at most ``len(hash_ids) * 512`` trace tokens, as in
    :class:`~kvstore.benchmarks.mooncake.TraceExpander`; every prompt has at least one token.
    """
    covered = min(request.input_length, len(request.hash_ids) * MOONCAKE_BLOCK_TOKENS)
    length = max(1, scaled_length(covered, block_tokens))
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        if len(tokens) >= length:
            break
        tokens.extend(hash_id_tokens(hash_id, block_tokens, vocab_size))
    return tokens[:length]


def mooncake_workload(
    path: str | Path,
    *,
    limit: int | None,
    block_tokens: int,
    max_tokens: int,
    shape: ModelShape,
) -> Workload:
    """The first ``limit`` requests of a Mooncake trace (all when None), fitted to ``shape``.

    Raises ConfigError when the file cannot be read, a line is malformed
    (naming the file and line), the trace is empty, or the settings cannot fit
    the context.
    """
    if not 1 <= block_tokens <= MOONCAKE_BLOCK_TOKENS:
        raise ConfigError(f"--block-tokens must be in 1..{MOONCAKE_BLOCK_TOKENS}, got {block_tokens}")
    _check_fits(max_tokens, shape)
    first_ms: float | None = None
    requests: list[ReplayRequest] = []
    clipped = 0
    for trace_request in iter_trace(path, limit):
        if first_ms is None:
            first_ms = trace_request.timestamp_ms
        output = min(max_tokens, max(1, scaled_length(trace_request.output_length, block_tokens)))
        tokens = expand_mooncake(trace_request, block_tokens, shape.vocab_size)
        room = shape.max_context - output
        if len(tokens) > room:
            tokens = tokens[:room]
            clipped += 1
        arrival = (trace_request.timestamp_ms - first_ms) / 1000.0
        requests.append(ReplayRequest(arrival, tokens, output))
    if not requests:
        raise ConfigError(f"trace {path} holds no requests")
    return Workload(f"mooncake:{path}", requests, clipped, max(len(r.token_ids) for r in requests))


def synthetic_workload(
    *,
    requests: int,
    groups: int,
    prefix_tokens: int,
    suffix_tokens: int,
    max_tokens: int,
    shape: ModelShape,
    seed: int,
) -> Workload:
    """``requests`` prompts over ``groups`` shared prefixes (module docstring); deterministic per ``seed``.

    Raises ConfigError when a count is out of range or a prompt cannot fit the context.
    """
    if requests < 1:
        raise ConfigError(f"--limit must be >= 1, got {requests}")
    if groups < 1:
        raise ConfigError(f"--groups must be >= 1, got {groups}")
    if prefix_tokens < 0 or suffix_tokens < 1:
        raise ConfigError("--prefix-tokens must be >= 0 and --suffix-tokens >= 1")
    _check_fits(max_tokens, shape)
    if prefix_tokens + suffix_tokens + max_tokens > shape.max_context:
        raise ConfigError(
            f"--prefix-tokens {prefix_tokens} + --suffix-tokens {suffix_tokens} + --max-tokens {max_tokens} "
            f"exceeds the model's context of {shape.max_context} tokens"
        )
    rng = random.Random(seed)
    vocab = shape.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(groups)]
    out = []
    for _ in range(requests):
        prefix = prefixes[rng.randrange(groups)]
        out.append(ReplayRequest(None, [*prefix, *(rng.randrange(vocab) for _ in range(suffix_tokens))], max_tokens))
    source = f"synthetic:{groups}x{prefix_tokens}+{suffix_tokens}"
    return Workload(source, out, 0, prefix_tokens + suffix_tokens)


def _check_fits(max_tokens: int, shape: ModelShape) -> None:
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    if shape.vocab_size < 1 or shape.max_context < 2:
        raise ConfigError(f"model shape {shape} cannot hold a prompt")
    if max_tokens >= shape.max_context:
        raise ConfigError(f"--max-tokens {max_tokens} leaves no room for a prompt in a context of {shape.max_context}")


def trace_span_s(workload: Workload) -> float | None:
    """Seconds from the first to the last arrival, or None without timestamps."""
    arrivals = [r.arrival_s for r in workload.requests if r.arrival_s is not None]
    return max(arrivals) - min(arrivals) if arrivals else None
