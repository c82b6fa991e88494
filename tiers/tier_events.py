"""The KV events a tier emits, one block per event, in vLLM's wire format (kvstore.events)."""

from __future__ import annotations

from kvstore.events import BlockRemoved, BlockStored
from kvstore.tiers.blocks import BlockMeta


def block_stored(meta: BlockMeta, block_size: int, medium: str) -> BlockStored:
    """``meta`` is now held on ``medium`` (with its tokens and parent, so consumers can re-key it)."""
    return BlockStored(
        block_hashes=[meta.block_hash],
        parent_block_hash=meta.parent_hash,
        token_ids=list(meta.token_ids),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def block_removed(meta: BlockMeta, medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=[meta.block_hash], medium=medium)
