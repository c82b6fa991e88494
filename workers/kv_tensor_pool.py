"""The worker's paged KV memory: one tensor, allocated once, block-major.

Layout (one row per block, each row a :class:`~kvstore.kv_layout.KVLayout` block)::

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        block_id ─┘      layer ─┘  └─ 0 = K, 1 = V

Block-major (the block index outermost) rather than vLLM's layer-major
layout, so that one block's K and V for every layer is one contiguous span
of ``bytes_per_block`` bytes: spilling or promoting a block is one copy,
and copies of many blocks are large DMA-friendly spans. The attention
kernels index ``kv[:, layer]`` (a strided view) through block tables.

Block ids are the :class:`kvstore.block_pool.BlockPool`'s ids: block ``i``
of the pool's bookkeeping owns ``kv[i]``.

Contracts
---------
- Not synchronised: the worker's step loop writes blocks during a forward
  pass. Readers and writers from elsewhere (the tiers) run while the block
  pool says the block is theirs to touch (e.g. inside the eviction hook,
  before the block is reused), on the step-loop thread or under the
  worker's lock.
- :meth:`block_view` and :meth:`layer` alias the pool: writes through them
  change the pool, and they stay valid until :meth:`close`.
- :meth:`read_blocks` returns (or fills) a copy that is independent of the
  pool once the call returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.kv_layout import KVLayout


class KVTensorPool:
    """``num_blocks`` blocks of KV on ``device``, zero-filled at construction.

    Raises ValueError for a non-positive block count (or a budget too small
    for one block). After :meth:`close` every accessor raises RuntimeError.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV tensor pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self._kv: torch.Tensor | None = torch.zeros(
            (num_blocks, *layout.block_shape), dtype=self.dtype, device=self.device
        )

    @classmethod
    def from_memory_budget(
        cls, layout: KVLayout, budget_bytes: int, device: torch.device | str = "cpu"
    ) -> KVTensorPool:
        """As many blocks as fit in ``budget_bytes`` (see :attr:`KVLayout.bytes_per_block`)."""
        num_blocks = layout.blocks_for_budget(budget_bytes)
        if num_blocks < 1:
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds no block of {layout.bytes_per_block} bytes; raise the budget"
            )
        return cls(layout, num_blocks, device)

    # ---------------------------------------------------------------- access

    @property
    def kv(self) -> torch.Tensor:
        """The whole pool ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``."""
        if self._kv is None:
            raise RuntimeError("the KV tensor pool is closed")
        return self._kv

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def layer(self, layer: int) -> torch.Tensor:
        """Zero-copy strided view ``[num_blocks, 2, block_size, kv_heads, head_dim]`` of one layer."""
        return self.kv[:, layer]

    def block_view(self, block_id: int) -> torch.Tensor:
        """Zero-copy contiguous view ``[layers, 2, block_size, kv_heads, head_dim]`` of one block."""
        self._check_id(block_id)
        return self.kv[block_id]

    def read_blocks(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy whole blocks out: ``[len(block_ids), layers, 2, block_size, kv_heads, head_dim]``.

        With ``out`` (any device, e.g. a pinned host buffer of that shape and
        dtype) the blocks are copied into it and ``out`` is returned.
        """
        index = self._index(block_ids)
        if out is None:
            return self.kv.index_select(0, index)
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(out.shape) != expected or out.dtype != self.dtype:
            raise ValueError(f"out must be {expected} {self.dtype}, got {tuple(out.shape)} {out.dtype}")
        if out.device == self.device:
            torch.index_select(self.kv, 0, index, out=out)
        else:
            out.copy_(self.kv.index_select(0, index))
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Copy whole blocks in; ``data`` is ``[len(block_ids), layers, 2, ...]`` on any device."""
        expected = (len(block_ids), *self.layout.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"data must have shape {expected}, got {tuple(data.shape)}")
        self.kv.index_copy_(0, self._index(block_ids), data.to(device=self.device, dtype=self.dtype))

    def close(self) -> None:
        """Release the memory. Idempotent."""
        self._kv = None

    # ------------------------------------------------------------- internals

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        for block_id in block_ids:
            self._check_id(block_id)
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        state = "closed" if self._kv is None else f"{self.nbytes / 2**20:.1f} MiB on {self.device}"
        return f"KVTensorPool(num_blocks={self.num_blocks}, {self.layout}, {state})"
