"""The KV events a tier medium emits, one block per event, in vLLM's wire format (kvstore.events).

Both media keep their events the same way, so that the store can publish
them together: each mutation records its event here, the owner takes the
batch after each operation (:meth:`MediumEvents.take`), and the publisher's
snapshot turns what the medium holds into BlockStored events
(:meth:`MediumEvents.snapshot`). Events carry tokens and parent hashes, so
consumers can re-key blocks under their own hashing.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvstore.events import BlockRemoved, BlockStored, KVEvent, Medium
from kvstore.tiers.blocks import BlockMeta


class MediumEvents:
    """The events of one medium (CPU or STORAGE) waiting to be published.

    Not thread-safe: record and take on the tier's event loop. :meth:`snapshot`
    keeps no state, so it may run anywhere.
    """

    def __init__(self, medium: Medium, block_size: int) -> None:
        self.medium = medium
        self.block_size = block_size
        self._pending: list[KVEvent] = []

    def stored(self, meta: BlockMeta) -> None:
        """``meta`` is now held on this medium."""
        self._pending.append(self._stored(meta))

    def removed(self, meta: BlockMeta) -> None:
        self._pending.append(BlockRemoved(block_hashes=[meta.block_hash], medium=self.medium))

    def take(self) -> list[KVEvent]:
        """The events recorded since the last take, oldest first."""
        events, self._pending = self._pending, []
        return events

    def snapshot(self, metas: Iterable[BlockMeta]) -> list[BlockStored]:
        """A BlockStored for each of ``metas`` (what the medium holds now)."""
        return [self._stored(meta) for meta in metas]

    def _stored(self, meta: BlockMeta) -> BlockStored:
        return BlockStored(
            block_hashes=[meta.block_hash],
            parent_block_hash=meta.parent_hash,
            token_ids=list(meta.token_ids),
            block_size=self.block_size,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
        )
