"""The ``worker`` section of the configuration, and what the workers read of the whole tree."""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar, cast

import msgspec

from kvstore.config import CacheConfig, EventsConfig, NonNegativeInt, PoolConfig, PositiveInt
from kvstore.kv_layout import KVDtype, KVLayout
from kvstore.tiers.config import TierConfig
from kvstore.tiers.identity import CacheIdentity


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """KV workers and their model (owned by the workers package).

    The defaults are a toy model small enough for fast CPU tests; raise the
    shape (and ``max_context``) for benchmarks. The MLP width is 4 x
    ``hidden_size``. Pool size comes from ``pool.num_blocks``, block size from
    ``cache.block_size``.
    """

    num_workers: NonNegativeInt = 0
    """Workers to start; 0 sizes to the machine."""
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    """Query heads."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    head_dim: PositiveInt = 32
    """Must be even (rotary embeddings rotate pairs)."""
    hidden_size: PositiveInt = 128
    vocab_size: PositiveInt = 512
    """Token ids are 0..vocab_size-1 (the router's byte tokenizer needs >= 256)."""
    max_context: PositiveInt = 2048
    """Longest prompt + max_tokens a request may have."""
    dtype: KVDtype = "float32"
    """Weights, activations and the KV pool."""
    seed: NonNegativeInt = 0
    """Seed of the model's weights: equal seeds and shapes give equal outputs everywhere."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when the process sees a GPU, else CPU."""
    max_num_seqs: PositiveInt = 64
    """Requests running (holding blocks) at once."""
    max_num_batched_tokens: PositiveInt = 2048
    """Tokens computed per step; longer prefills are chunked."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def model_name(self) -> str:
        """The built-in model's name, from every field that changes its weights (equal names, equal KV)."""
        return (
            f"kvstore-tiny(seed={self.seed},hidden={self.hidden_size},heads={self.num_heads},vocab={self.vocab_size})"
        )

    def kv_layout(self, block_size: int) -> KVLayout:
        """The KV block this model writes at ``block_size`` tokens per block."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )


class WorkerSettings(Protocol):
    """The sections of the configuration tree a worker reads (the whole tree satisfies it)."""

    @property
    def cache(self) -> CacheConfig: ...

    @property
    def pool(self) -> PoolConfig: ...

    @property
    def events(self) -> EventsConfig: ...

    @property
    def worker(self) -> WorkerConfig: ...

    @property
    def tiers(self) -> TierConfig: ...


def cache_identity(config: WorkerSettings, *, model: str | None = None) -> CacheIdentity:
    """The identity of the blocks a worker of ``config`` writes; ``model`` defaults to the built-in model's name."""
    worker = config.worker
    return CacheIdentity.from_layout(
        worker.kv_layout(config.cache.block_size), config.cache, model=model or worker.model_name
    )


Settings = TypeVar("Settings", bound=WorkerSettings)


def replace_sections(config: Settings, **sections: Any) -> Settings:
    """A copy of the tree ``config`` with whole sections replaced (the tree is a frozen msgspec Struct)."""
    return cast(Settings, msgspec.structs.replace(cast(msgspec.Struct, config), **sections))
