"""Mooncake-format request traces, expanded into our blocks.

A trace line (JSON): ``timestamp`` (ms), ``input_length``, ``output_length``
(tokens) and ``hash_ids``: one id per 512-token block of the prompt, equal
ids meaning equal blocks (and, by construction of the trace, equal
prefixes). The last id covers the prompt's remainder.

Expansion to our blocks of ``block_size`` tokens (``block_size`` divides 512):

- Tokens are deterministic: token ``j`` of Mooncake block ``k`` is
  ``k * 512 + j``. Distinct ids give distinct tokens; the prompt is the
  concatenation over its ids, cut at ``input_length``; only full blocks are
  cached, as in the block pool.
- Hashes, two modes (:data:`HashMode`):
  ``"tokens"`` -- the real chain: our :class:`~kvstore.hashing.BlockHasher`
  over those tokens (exactly what a worker would compute; ~100 µs per
  512-token block with sha256_cbor, memoised per distinct (parent, block));
  ``"derived"`` -- the same chain *structure* without CBOR: digest =
  blake2b-256(parent digest || id || sub-block index). Consistent across a
  run and collision-free in practice, so every prefix relation of the trace
  is preserved, but not the hash a worker would compute from the tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

from kvstore.errors import ConfigError
from kvstore.hashing import BlockHash, BlockHasher, to_external

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"
HashMode = Literal["tokens", "derived"]
HASH_MODES: tuple[HashMode, ...] = ("tokens", "derived")


class MooncakeRequest(NamedTuple):
    timestamp_ms: float
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # one per 512-token block of the prompt


def read_trace(path: str | Path, limit: int | None = None) -> list[MooncakeRequest]:
    """The first ``limit`` requests (all when None); raises ConfigError naming a bad line."""
    return list(iter_trace(path, limit))


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[MooncakeRequest]:
    path = Path(path)
    try:
        fh = path.open()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None
    with fh:
        count = 0
        for line_no, line in enumerate(fh, 1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                request = MooncakeRequest(
                    float(raw["timestamp"]),
                    int(raw["input_length"]),
                    int(raw["output_length"]),
                    tuple(int(h) for h in raw["hash_ids"]),
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"{path}:{line_no}: not a Mooncake trace line ({exc!r})") from None
            if request.input_length < 1 or request.output_length < 0:
                raise ConfigError(f"{path}:{line_no}: input_length must be >= 1 and output_length >= 0")
            count += 1
            yield request


class ExpandedRequest(NamedTuple):
    digests: list[BlockHash]  # chained digests of the prompt's full blocks
    external: list[int]  # their 64-bit wire hashes
    token_ids: list[int]  # the full blocks' tokens (len(digests) * block_size)


class TraceExpander:
    """Turns Mooncake requests into our blocks (module docstring), memoising the chain."""

    def __init__(self, hasher: BlockHasher, mode: HashMode = "tokens") -> None:
        if mode not in HASH_MODES:
            raise ConfigError(f"hash mode must be one of {HASH_MODES}, got {mode!r}")
        size = hasher.block_size
        if size > MOONCAKE_BLOCK_TOKENS or MOONCAKE_BLOCK_TOKENS % size:
            raise ConfigError(f"block size {size} must divide the trace's {MOONCAKE_BLOCK_TOKENS}-token blocks")
        self.block_size = size
        self.mode = mode
        self._hasher = hasher
        self._per_id = MOONCAKE_BLOCK_TOKENS // size
        self._memo: dict[tuple[BlockHash | None, int, int], BlockHash] = {}

    def num_full_blocks(self, request: MooncakeRequest) -> int:
        """Full blocks of the prompt: those that can be cached."""
        limit = len(request.hash_ids) * MOONCAKE_BLOCK_TOKENS
        return min(request.input_length, limit) // self.block_size

    def expand(self, request: MooncakeRequest, *, with_tokens: bool = True) -> ExpandedRequest:
        size = self.block_size
        per_id = self._per_id
        digests: list[BlockHash] = []
        tokens: list[int] = []
        parent: BlockHash | None = None
        memo = self._memo
        for index in range(self.num_full_blocks(request)):
            hash_id = request.hash_ids[index // per_id]
            sub = index % per_id
            key = (parent, hash_id, sub)
            digest = memo.get(key)
            first = hash_id * MOONCAKE_BLOCK_TOKENS + sub * size
            if digest is None:
                if self.mode == "tokens":
                    digest = self._hasher.hash_block(parent, range(first, first + size))
                else:
                    seed = (parent or b"") + hash_id.to_bytes(8, "big") + sub.to_bytes(4, "big")
                    digest = BlockHash(hashlib.blake2b(seed, digest_size=32).digest())
                memo[key] = digest
            digests.append(digest)
            if with_tokens:
                tokens.extend(range(first, first + size))
            parent = digest
        external: list[int] = [to_external(d) for d in digests]
        return ExpandedRequest(digests, external, tokens)
