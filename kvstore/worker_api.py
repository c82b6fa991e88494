"""The KV worker's public request/result types (what the router and HTTP front depend on).

All are frozen msgspec Structs: cheap to build, picklable for Ray, and
encodable to JSON/msgpack as they are. Field names are a contract: the
router builds :class:`GenerateRequest` by keyword and reads
:class:`GenerateResult` and :class:`WorkerLoad` by attribute.
"""

from __future__ import annotations

import msgspec

from kvstore.errors import KVStoreError
from kvstore.events import Medium


class GenerateRequest(msgspec.Struct, frozen=True):
    """Greedy generation of ``max_tokens`` tokens after ``token_ids``.

    ``request_id`` is echoed in the result (one is made up when None); it
    need not be unique. ``cache_salt`` and ``lora_name`` feed the block
    hashes' extra keys (a salted request shares no cache with an unsalted
    one). Validated by the worker before queuing: see
    :func:`kvstore.workers.validation.validate_request`.
    """

    token_ids: list[int]
    max_tokens: int
    request_id: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


class GenerateResult(msgspec.Struct, frozen=True):
    """What one request produced, and what it cost.

    Times are seconds from the worker receiving the request: ``queue_s``
    until first scheduled, ``ttft_s`` until the first output token,
    ``total_s`` until done. ``cached_tokens`` counts prompt tokens served
    from cache at first admission (the sum of ``cached_tokens_by_medium``,
    keys ``GPU``, ``CPU``, ``STORAGE``). ``preempted`` counts how often the
    request lost its blocks and was recomputed.
    """

    request_id: str
    replica: str
    prompt_tokens: int
    output_token_ids: list[int]
    cached_tokens: int
    cached_tokens_by_medium: dict[Medium, int]
    queue_s: float
    ttft_s: float
    total_s: float
    preempted: int


class WorkerLoad(msgspec.Struct, frozen=True):
    """Load signals for routing: requests holding blocks, requests queued, pool usage (0..1)."""

    running: int
    waiting: int
    kv_usage: float
    num_free_blocks: int


class ModelInfo(msgspec.Struct, frozen=True):
    """What a client needs to build requests and hashes that match this worker."""

    vocab_size: int
    max_context: int
    block_size: int
    hash_algo: str
    hash_seed: str


class WorkerShutdownError(KVStoreError, RuntimeError):
    """The worker was shut down before (or while) serving the request; send it to another replica."""
