"""The layout of one KV block: the one shape the worker's pool, the CPU arena's slots and the disk files share.

A block is one contiguous span holding every layer's K and V for
``block_size`` tokens::

    [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]  of dtype

It is one row of the worker's block-major pool, one slot of the CPU arena,
and the payload of one disk file, so a spill or a promotion is one copy of
``bytes_per_block`` bytes. Two processes may exchange a block only if their
layouts are equal (the tiers' cache identity includes it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast

import msgspec

if TYPE_CHECKING:
    import torch

KVDtype = Literal["float32", "float16", "bfloat16"]
"""Names of the KV dtypes; each is also the name of the ``torch`` dtype (``getattr(torch, name)``)."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def torch_dtype_of(dtype: KVDtype) -> torch.dtype:
    """The ``torch`` dtype named ``dtype`` (torch is imported here, not at the top: a router reads layouts
    from its config without it)."""
    import torch

    return cast("torch.dtype", getattr(torch, dtype))


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The shape and dtype of one KV block. Immutable; raises ValueError for a non-positive dimension."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: KVDtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """2 (K and V) x block_size x kv_heads x head_dim x dtype bytes x layers."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] * self.num_layers

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many whole blocks fit in ``budget_bytes``."""
        return budget_bytes // self.bytes_per_block
