"""The cache identity: what decides the meaning of a block's bytes.

Two processes may exchange a block's KV (through the CPU arena or a disk
file) only if they agree on every field here: the model weights, the KV
shape and dtype, the block size, and the hash function and seed that name
blocks. The disk tier keys its directory by :meth:`CacheIdentity.digest`,
so a deployment with another identity never reads these files, and a
restart with the same identity finds them again.

Block layout (the worker's block-major pool row)::

    [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]  of dtype
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import msgspec
import torch

from kvstore.config import Config, HashAlgo

KVDtype = Literal["float32", "float16", "bfloat16"]

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DIGEST_DOMAIN = "kvstore-cache-identity-v1"


class CacheIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Model, KV shape, dtype, block size, hash algorithm and seed of one deployment.

    ``model`` names the weights (two models of one shape have different KV);
    every other field is a shape or naming parameter. Immutable; the digest
    is stable across processes, hosts and Python versions.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype
    block_size: int
    hash_algo: HashAlgo
    hash_seed: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheIdentity.{name} must be >= 1, got {getattr(self, name)}")
        if not self.model:
            raise ValueError("CacheIdentity.model must name the model weights (KV of other weights differs)")

    @classmethod
    def from_config(cls, config: Config, *, model: str | None = None) -> CacheIdentity:
        """The identity of the deployment ``config`` describes.

        ``model`` defaults to a name of the built-in model derived from every
        worker field that changes its weights (so equal names mean equal KV).
        """
        worker = config.worker
        if model is None:
            model = (
                f"kvstore-tiny(seed={worker.seed},hidden={worker.hidden_size},heads={worker.num_heads},"
                f"vocab={worker.vocab_size})"
            )
        return cls(
            model=model,
            num_layers=worker.num_layers,
            num_kv_heads=worker.num_kv_heads,
            head_dim=worker.head_dim,
            dtype=worker.dtype,
            block_size=config.cache.block_size,
            hash_algo=config.cache.hash_algo,
            hash_seed=config.cache.hash_seed,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``: one row of the worker's pool."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """2 x block_size x kv_heads x head_dim x dtype bytes x layers."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize * self.num_layers

    def digest(self) -> str:
        """32 hex chars (128 bits of sha256) over the fields in canonical JSON."""
        fields = msgspec.to_builtins(self)
        canonical = json.dumps([_DIGEST_DOMAIN, fields], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]
