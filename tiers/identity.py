"""The cache identity: what decides the meaning of a block's bytes.

Two processes may exchange a block's KV (through the CPU arena or a disk
file) only if they agree on every field here: the model weights, the block's
layout (:class:`~kvstore.kv_layout.KVLayout`: KV shape, dtype, block size),
and the hash function and seed that name blocks. The disk tier keys its
directory by :meth:`CacheIdentity.digest`, so a deployment with another
identity never reads these files, and a restart with the same identity finds
them again.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import msgspec

from kvstore.config import CacheConfig, HashAlgo
from kvstore.kv_layout import KVLayout, torch_dtype_of

if TYPE_CHECKING:
    import torch

_DIGEST_DOMAIN = "kvstore-cache-identity-v1"


class CacheIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Model, block layout, hash algorithm and seed of one deployment.

    ``model`` names the weights (two models of one shape have different KV).
    Immutable; the digest is stable across processes, hosts and Python versions.
    """

    model: str
    layout: KVLayout
    hash_algo: HashAlgo
    hash_seed: str

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("CacheIdentity.model must name the model weights (KV of other weights differs)")

    @classmethod
    def from_layout(cls, layout: KVLayout, cache: CacheConfig, *, model: str) -> CacheIdentity:
        """The identity of ``model``'s blocks of ``layout``, named by ``cache``'s hash algorithm and seed."""
        if layout.block_size != cache.block_size:
            raise ValueError(f"layout block_size {layout.block_size} != cache.block_size {cache.block_size}")
        return cls(model=model, layout=layout, hash_algo=cache.hash_algo, hash_seed=cache.hash_seed)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def block_bytes(self) -> int:
        return self.layout.bytes_per_block

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype_of(self.layout.dtype)

    def digest(self) -> str:
        """32 hex chars (128 bits of sha256) over every field, the layout's flattened, in canonical JSON."""
        fields = {"model": self.model, "hash_algo": self.hash_algo, "hash_seed": self.hash_seed}
        fields.update(msgspec.to_builtins(self.layout))
        canonical = json.dumps([_DIGEST_DOMAIN, fields], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]
