"""The KV events a tier medium emits, one block per event, in vLLM's wire format (kvstore.events).

Both media keep their events the same way, so that the store can publish
them together: each mutation records its event here, the owner takes the
batch after each operation (:meth:`MediumEvents.take`), and the publisher's
snapshot turns what the medium holds into BlockStored events
(:meth:`MediumEvents.snapshot`). Events carry tokens and parent hashes, so
consumers can re-key blocks under their own hashing.

Recording is cheap and building is deferred: a mutation appends the block's
meta (stored) or hash (removed) to ``_pending``; the
BlockStored / BlockRemoved objects -- one per block, in the order recorded --
are built by :meth:`MediumEvents.take`. An owner whose events go nowhere
(no publisher) calls :meth:`MediumEvents.discard` instead and never builds
them: on 16 KiB blocks building them was about a tenth of a spill's time.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat

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
        # (block, True) for a block stored, (its hash, False) for one removed; oldest first
        self._pending: list[tuple[BlockMeta | int, bool]] = []

    def stored(self, meta: BlockMeta) -> None:
        """``meta`` is now held on this medium."""
        self._pending.append((meta, True))

    def stored_many(self, metas: Iterable[BlockMeta]) -> None:
        """:meth:`stored` for each of ``metas``, in order."""
        self._pending.extend(zip(metas, repeat(True)))

    def removed(self, meta: BlockMeta) -> None:
        self._pending.append((meta.block_hash, False))

    def removed_many(self, metas: Iterable[BlockMeta]) -> None:
        """:meth:`removed` for each of ``metas``, in order."""
        self._pending.extend((meta.block_hash, False) for meta in metas)

    def removed_hashes(self, block_hashes: Iterable[int]) -> None:
        """The blocks ``block_hashes`` are gone from this medium, in order."""
        self._pending.extend(zip(block_hashes, repeat(False)))

    def take(self) -> list[KVEvent]:
        """The events recorded since the last take, oldest first: one per block."""
        pending, self._pending = self._pending, []
        medium = self.medium
        return [
            self._stored(item) if stored else BlockRemoved(block_hashes=[item], medium=medium)  # type: ignore[arg-type, list-item]
            for item, stored in pending
        ]

    def discard(self) -> int:
        """Forget the events recorded since the last take (nobody will read them); returns how many."""
        count = len(self._pending)
        self._pending = []
        return count

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
