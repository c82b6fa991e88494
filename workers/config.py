"""The ``worker`` section of the configuration, and what the workers read of the whole tree."""

from __future__ import annotations

from typing import Annotated, Any, Protocol, TypeVar, cast

import msgspec

from kvstore.config import CacheConfig, EventsConfig, NonNegativeInt, PoolConfig, PositiveInt
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.tiers.config import TierConfig
from kvstore.tiers.identity import CacheIdentity
from kvstore.workers.device import DeviceChoice, DtypeChoice, resolve_device


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """KV workers and their model (owned by the workers package).

    The model is one of three (:func:`kvstore.workers.model_source.describe_model`):

    - ``model``: a Hugging Face model directory (Llama, Qwen2, Mistral),
      served as its checkpoint computes;
    - ``shape``: a built-in real architecture (``qwen2.5-0.5b``, ...) with
      seeded random weights, for benchmarks;
    - neither (the default): a toy model small enough for fast CPU tests,
      shaped by ``num_layers`` .. ``vocab_size`` (MLP width 4 x
      ``hidden_size``) and seeded by ``seed``.

    The toy's shape fields are ignored for the other two. Pool size comes
    from ``pool.num_blocks``, block size from ``cache.block_size``.
    """

    num_workers: NonNegativeInt = 0
    """Workers to start; 0 sizes to the machine."""
    model: str = ""
    """Path of a Hugging Face model directory (config.json, safetensors weights); empty = no checkpoint."""
    served_model_name: str = ""
    """The name clients use for the model (``/v1/models``); empty = the directory's (or shape's) name."""
    shape: str = ""
    """A built-in architecture served with seeded random weights (see kvstore.workers.shapes); empty = none."""
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
    """Longest prompt + max_tokens a request may have (a checkpoint's max_position_embeddings caps it too)."""
    dtype: DtypeChoice = "auto"
    """Weights, activations and the KV pool; ``auto``: the checkpoint's own, float32 for seeded weights
    (an fp16 checkpoint runs in float32 on a CPU; see kvstore.workers.device)."""
    seed: NonNegativeInt = 0
    """Seed of the toy's (or a shape's) weights: equal seeds and shapes give equal outputs everywhere."""
    device: DeviceChoice = "auto"
    """``auto``: CUDA when the process sees a GPU, else CPU."""
    max_num_seqs: PositiveInt = 64
    """Requests running (holding blocks) at once."""
    max_num_batched_tokens: PositiveInt = 2048
    """Tokens computed per step; longer prefills are chunked."""
    offload_wait_s: Annotated[float, msgspec.Meta(gt=0.0)] = 2.0
    """How long a request waits for the node's tier (its lookup and the copy of its hit) before it gives up
    and recomputes; while a tier call has waited this long, no new lookups queue behind it."""

    def __post_init__(self) -> None:
        if self.model and self.shape:
            raise ValueError(f"worker.model ({self.model!r}) and worker.shape ({self.shape!r}) exclude each other")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.model and not self.shape and self.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"vocab_size must be at least {ByteTokenizer.vocab_size} for the built-in model, whose tokenizer reads"
                f" text as byte ids 0..255; got {self.vocab_size}"
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
    """The identity of the blocks a worker of ``config`` writes, from its model's geometry and weights.

    Reads the checkpoint's JSON files and a fingerprint of its weights (see
    :func:`~kvstore.workers.model_source.describe_model`), not the weights
    themselves, so the launcher can call it before any worker runs; the dtype
    is the one a worker on this process's device would use. ``model``
    overrides the name of the weights.
    """
    # Imported here: the model code needs torch, and a router reads this module's settings without it.
    from kvstore.workers.model_source import describe_model

    served = describe_model(config.worker, resolve_device(config.worker.device))
    layout = served.kv_layout(config.cache.block_size)
    return CacheIdentity.from_layout(layout, config.cache, model=model or served.weights_id)


Settings = TypeVar("Settings", bound=WorkerSettings)


def replace_sections(config: Settings, **sections: Any) -> Settings:
    """A copy of the tree ``config`` with whole sections replaced (the tree is a frozen msgspec Struct)."""
    return cast(Settings, msgspec.structs.replace(cast(msgspec.Struct, config), **sections))
