"""Paged attention over the block-major KV tensor pool, in plain torch.

One step computes a batch of *slices*, one per scheduled sequence: the
tokens at positions ``[start, start + n)`` of that sequence, whose earlier
KV (positions ``< start``: a cached prefix, earlier prefill chunks, earlier
decode steps) is already in the pool. A slice's block table maps its
logical block ``i`` (positions ``i*block_size .. (i+1)*block_size-1``) to a
pool block id and covers at least ``start + n`` positions.

Per layer, :func:`paged_attention`:

1. writes the K and V of *every* token of the step into the pool, then
2. computes attention for every slice, reading K and V back from the pool
   through its block table: decode slices (``n == 1``) in one padded
   batch, longer slices (prefills and prefill chunks) one at a time, with
   a causal mask offset by ``start``.

Writing all K/V before any read is what lets a request admitted in the
same step as another hit blocks that the other is computing in this very
step (the prefix cache registers blocks when they are scheduled, as in
vLLM v1).

Sliding-window layers (Mistral, some Qwen2 layers) attend through the same
metadata narrowed by :func:`with_window`: a query at position ``p`` sees
keys ``(p - window, p]``. Keys that slid out of the window stay in the pool
(their blocks are not freed early); the mask hides them.

Index ranges of the flattened step (``T`` tokens in all)::

    rows [0, T)               one per token, slices back to back in order
    slice s: rows [offset_s, offset_s + n_s)   positions [start_s, start_s + n_s)
    sample rows               offset_s + n_s - 1: each slice's last token
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F


class SequenceSlice(NamedTuple):
    """One sequence's tokens to compute in a step (see the module docstring)."""

    token_ids: Sequence[int]  # tokens at positions [start, start + len(token_ids))
    start: int  # positions already in the pool
    block_ids: Sequence[int]  # block table, covering at least start + len(token_ids) positions


class _Prefill(NamedTuple):
    rows: slice  # rows of the flattened step
    block_table: torch.Tensor  # [num_blocks] long
    context_len: int  # start + n: keys visible to the last query
    mask: torch.Tensor  # [n, context_len] bool: query i sees key j iff j <= start + i


class _DecodeBatch(NamedTuple):
    rows: torch.Tensor  # [D] rows of the flattened step
    block_tables: torch.Tensor  # [D, max_blocks] long, padded with block 0 (masked out)
    mask: torch.Tensor  # [D, 1, 1, max_blocks * block_size] bool: key j visible iff j < context_len
    context_lens: torch.Tensor  # [D] long: start + 1 of each decode slice


class AttentionMetadata(NamedTuple):
    """Tensors describing one step, built once by :func:`build_metadata` and shared by every layer."""

    positions: torch.Tensor  # [T] long: each token's position in its sequence
    slot_blocks: torch.Tensor  # [T] long: pool block that receives the token's K/V
    slot_offsets: torch.Tensor  # [T] long: offset of the token inside that block
    sample_rows: torch.Tensor  # [S] long: each slice's last row
    decode: _DecodeBatch | None
    prefills: tuple[_Prefill, ...]


def build_metadata(slices: Sequence[SequenceSlice], block_size: int, device: torch.device) -> AttentionMetadata:
    """Describe a step; raises ValueError if a slice is empty or its block table is too short."""
    positions: list[int] = []
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    sample_rows: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[Sequence[int]] = []
    decode_lens: list[int] = []
    prefills: list[_Prefill] = []
    row = 0
    for index, part in enumerate(slices):
        n = len(part.token_ids)
        end = part.start + n
        if n == 0:
            raise ValueError(f"slice {index} has no tokens")
        needed = -(-end // block_size)
        if len(part.block_ids) < needed:
            have = len(part.block_ids)
            raise ValueError(f"slice {index}: {end} positions need {needed} blocks, its block table has {have}")
        for pos in range(part.start, end):
            positions.append(pos)
            slot_blocks.append(part.block_ids[pos // block_size])
            slot_offsets.append(pos % block_size)
        sample_rows.append(row + n - 1)
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(part.block_ids[:needed])
            decode_lens.append(end)
        else:
            query_pos = torch.arange(part.start, end, device=device).unsqueeze(1)
            key_pos = torch.arange(end, device=device).unsqueeze(0)
            table = torch.tensor(list(part.block_ids[:needed]), dtype=torch.long, device=device)
            prefills.append(_Prefill(slice(row, row + n), table, end, key_pos <= query_pos))
        row += n

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    decode = None
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        # Short tables are padded with block 0; the mask hides every padded position.
        padded = [b for t in decode_tables for b in (*t, *[0] * (width - len(t)))]
        key_pos = torch.arange(width * block_size, device=device)
        lens = as_tensor(decode_lens)
        mask = key_pos.unsqueeze(0) < lens.unsqueeze(1)
        tables = as_tensor(padded).view(len(decode_tables), width)
        decode = _DecodeBatch(as_tensor(decode_rows), tables, mask[:, None, None, :], lens)
    return AttentionMetadata(
        as_tensor(positions), as_tensor(slot_blocks), as_tensor(slot_offsets), as_tensor(sample_rows), decode,
        tuple(prefills),
    )  # fmt: skip


def with_window(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """``meta`` with every mask narrowed to a sliding window: position ``p`` sees keys ``(p - window, p]``.

    Built once per step and window (every layer of that window shares it).
    """
    decode = meta.decode
    if decode is not None:
        key_pos = torch.arange(decode.mask.shape[-1], device=decode.mask.device)
        recent = key_pos.unsqueeze(0) >= (decode.context_lens - window).unsqueeze(1)
        decode = decode._replace(mask=decode.mask & recent[:, None, None, :])
    prefills = []
    for p in meta.prefills:
        n = p.mask.shape[0]
        query_pos = torch.arange(p.context_len - n, p.context_len, device=p.mask.device).unsqueeze(1)
        key_pos = torch.arange(p.context_len, device=p.mask.device).unsqueeze(0)
        prefills.append(p._replace(mask=p.mask & (key_pos > query_pos - window)))
    return meta._replace(decode=decode, prefills=tuple(prefills))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Store this step's K/V in ``kv_layer``, then attend through the block tables.

    ``q`` is ``[T, heads, head_dim]``; ``k`` and ``v`` are ``[T, kv_heads,
    head_dim]`` (``heads`` a multiple of ``kv_heads``: grouped-query
    attention); ``kv_layer`` is the pool's view of this layer, ``[num_blocks,
    2, block_size, kv_heads, head_dim]``, and is written in place. Returns
    ``[T, heads, head_dim]``.
    """
    kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = v
    out = torch.empty_like(q)
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    if meta.decode is not None:
        d = meta.decode
        batch, width = d.block_tables.shape
        gathered = kv_layer[d.block_tables]  # [D, width, 2, block_size, kv_heads, head_dim]
        keys = gathered[:, :, 0].reshape(batch, width * block_size, kv_heads, head_dim).transpose(1, 2)
        values = gathered[:, :, 1].reshape(batch, width * block_size, kv_heads, head_dim).transpose(1, 2)
        query = q[d.rows].unsqueeze(2)  # [D, heads, 1, head_dim]
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=d.mask, enable_gqa=True)
        out[d.rows] = attended.squeeze(2)
    for p in meta.prefills:
        gathered = kv_layer[p.block_table]  # [blocks, 2, block_size, kv_heads, head_dim]
        keys = gathered[:, 0].reshape(-1, kv_heads, head_dim)[: p.context_len].transpose(0, 1).unsqueeze(0)
        values = gathered[:, 1].reshape(-1, kv_heads, head_dim)[: p.context_len].transpose(0, 1).unsqueeze(0)
        query = q[p.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=p.mask, enable_gqa=True)
        out[p.rows] = attended.squeeze(0).transpose(0, 1)
    return out
