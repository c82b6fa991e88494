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
import math
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Literal, NamedTuple

from kvstore.errors import ConfigError
from kvstore.hashing import BlockHash, BlockHasher, to_external

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "mooncake_conversation_trace.jsonl"
MAX_LINE_BYTES = 1 << 20  # a line of the real trace is at most ~2 KB; 1 MiB holds ~100k hash ids
MAX_HASH_ID = 1 << 63  # hash ids are 0 .. 2**63 - 1: what every tool can hash and send
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
    """The trace's requests, read one line at a time; raises ConfigError naming the file, line and field.

    Each field must have its JSON type (no ``7.9`` for a hash id, no ``"78"``
    for a length), hash ids lie in ``0 .. 2**63 - 1`` (what every tool can
    hash and send), the prompt fills its last block (``(len(hash_ids) - 1) *
    512 < input_length <= len(hash_ids) * 512``), timestamps are finite and
    never decrease, and no line is longer than :data:`MAX_LINE_BYTES`.
    """
    path = Path(path)
    with open_trace(path) as fh:
        count = 0
        line_no = 0
        previous_ms = -math.inf
        while limit is None or count < limit:
            data = fh.readline(MAX_LINE_BYTES + 1)
            if not data:
                return
            line_no += 1
            if len(data) > MAX_LINE_BYTES:
                raise ConfigError(f"{path}:{line_no}: line longer than {MAX_LINE_BYTES} bytes; not a Mooncake trace")
            if not data.strip():
                continue
            try:
                raw = json.loads(data.decode("utf-8-sig" if line_no == 1 else "utf-8"))
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{line_no}: not UTF-8 text; not a Mooncake trace") from None
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{line_no}: not a Mooncake trace line (invalid JSON: {exc.msg})") from None
            except ValueError as exc:  # e.g. an integer of more digits than Python converts
                raise ConfigError(f"{path}:{line_no}: not a Mooncake trace line ({exc})") from None
            except RecursionError:
                raise ConfigError(f"{path}:{line_no}: not a Mooncake trace line (JSON nested too deeply)") from None
            request = _parse_request(raw, f"{path}:{line_no}")
            if request.timestamp_ms < previous_ms:
                raise ConfigError(
                    f"{path}:{line_no}: timestamp {request.timestamp_ms:g} is before the previous line's "
                    f"{previous_ms:g}; a trace must be in arrival order"
                )
            previous_ms = request.timestamp_ms
            count += 1
            yield request


def open_trace(path: Path) -> BinaryIO:
    """``path`` opened for binary reading; a ConfigError when it is missing, unreadable or not a regular
    file (a directory, a FIFO or a device would fail later, or never)."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, a device or a socket)"
        raise ConfigError(f"trace {path} is {kind}; give a Mooncake JSONL file")
    try:
        return path.open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None


def _parse_request(raw: object, where: str) -> MooncakeRequest:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: not a Mooncake trace line (a JSON object)")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in raw:
            raise ConfigError(f"{where}: not a Mooncake trace line (no {field!r})")
    timestamp = raw["timestamp"]
    if type(timestamp) not in (int, float) or not math.isfinite(_as_float(timestamp)):
        raise ConfigError(f"{where}: timestamp must be a finite number of milliseconds, got {_short(timestamp)}")
    input_length, output_length, hash_ids = raw["input_length"], raw["output_length"], raw["hash_ids"]
    if type(input_length) is not int or input_length < 1:
        raise ConfigError(f"{where}: input_length must be an integer >= 1, got {_short(input_length)}")
    if type(output_length) is not int or output_length < 0:
        raise ConfigError(f"{where}: output_length must be an integer >= 0, got {_short(output_length)}")
    if type(hash_ids) is not list:
        raise ConfigError(f"{where}: hash_ids must be a list of integers, got {_short(hash_ids)}")
    for index, hash_id in enumerate(hash_ids):
        if type(hash_id) is not int or not 0 <= hash_id < MAX_HASH_ID:
            raise ConfigError(f"{where}: hash_ids[{index}] must be an integer in 0..2**63-1, got {_short(hash_id)}")
    blocks = len(hash_ids)
    if not blocks:
        raise ConfigError(f"{where}: hash_ids is empty; a prompt covers at least one block")
    if not (blocks - 1) * MOONCAKE_BLOCK_TOKENS < input_length <= blocks * MOONCAKE_BLOCK_TOKENS:
        raise ConfigError(
            f"{where}: input_length {_short(input_length)} does not match its {blocks} hash_ids of "
            f"{MOONCAKE_BLOCK_TOKENS} tokens (it must be in {(blocks - 1) * MOONCAKE_BLOCK_TOKENS + 1}.."
            f"{blocks * MOONCAKE_BLOCK_TOKENS})"
        )
    return MooncakeRequest(_as_float(timestamp), input_length, output_length, tuple(hash_ids))


def _as_float(number: float) -> float:
    """``number`` as a float; an integer beyond the float range (JSON allows one) is infinite, not an error."""
    try:
        return float(number)
    except OverflowError:
        return math.inf


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
