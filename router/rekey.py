"""Re-keying a foreign producer's blocks into our block hashes.

A producer that hashes with another algorithm or seed (a vLLM fleet started
without our seed) publishes hashes the router cannot match against its own.
Its ``BlockStored`` events carry the token ids of every block, so we hash
them again with our :class:`~kvstore.hashing.BlockHasher`. Our hash chains
through the parent's *full digest*, so we keep, per producer, a map
foreign hash -> (our digest, number of stores not yet removed): it gives the
parent digest of the producer's later runs and translates its removals.

A run whose foreign parent is not in the map yet (a snapshot can list a
child before a parent that was evicted and cached again) is *parked* under
that parent and re-keyed when the parent arrives; removals of parked blocks
are deferred with it. Parked blocks are bounded; beyond the bound a run is
rejected (counted).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from kvstore.events import BlockStored, Medium
from kvstore.hashing import BlockHash, BlockHasher, tagged_extra_keys, to_external

MAX_PARKED_BLOCKS = 1_000_000


class RekeyedStore(NamedTuple):
    """Our hashes for a foreign run, to be stored on ``medium``."""

    medium: Medium
    block_hashes: list[int]


class RekeyedRemove(NamedTuple):
    """Our hashes of foreign blocks removed while they were parked, to remove after storing."""

    medium: Medium
    block_hashes: list[int]


RekeyAction = RekeyedStore | RekeyedRemove


class _Known:
    __slots__ = ("digest", "stores")

    def __init__(self, digest: BlockHash) -> None:
        self.digest = digest
        self.stores = 0


class Rekeyer:
    """Hash translation for one foreign producer. Not thread-safe (the index's lock guards it)."""

    def __init__(self, hasher: BlockHasher) -> None:
        self._hasher = hasher
        self._known: dict[int, _Known] = {}
        self._parked: dict[int, list[tuple[BlockStored, Medium]]] = {}  # foreign parent -> (run, medium)
        self._parked_hashes: Counter[int] = Counter()  # foreign hashes inside parked runs
        self._parked_removals: Counter[int] = Counter()
        self.parked_blocks = 0
        self.rejected = 0  # runs with the wrong block size or token count, or over the parking bound
        self.unknown_removals = 0

    def stored(self, event: BlockStored, medium: Medium) -> list[RekeyAction]:
        """What to apply, in order, for one foreign BlockStored (possibly unparking others)."""
        actions: list[RekeyAction] = []
        pending = [(event, medium)]
        while pending:
            run, run_medium = pending.pop()
            ours = self._rekey(run, run_medium)
            if ours is None:
                continue
            actions.append(ours)
            removed: list[int] = []
            for foreign_hash, our_hash in zip(run.block_hashes, ours.block_hashes, strict=True):
                children = self._parked.pop(foreign_hash, None)
                if children:
                    for child, _ in children:
                        self._unpark(child)
                    pending.extend(children)
                times = self._parked_removals.pop(foreign_hash, 0)
                for _ in range(times):
                    if self._forget(foreign_hash):
                        removed.append(our_hash)
            if removed:
                actions.append(RekeyedRemove(run_medium, removed))
        return actions

    def removed(self, foreign_hashes: list[int]) -> list[int]:
        """Our hashes for removed foreign blocks; removals of parked blocks are deferred."""
        ours: list[int] = []
        for foreign_hash in foreign_hashes:
            known = self._known.get(foreign_hash)
            if known is None:
                if foreign_hash in self._parked_hashes:
                    self._parked_removals[foreign_hash] += 1
                else:
                    self.unknown_removals += 1
                continue
            ours.append(to_external(known.digest))
            self._forget(foreign_hash)
        return ours

    def clear(self) -> None:
        self._known.clear()
        self._parked.clear()
        self._parked_hashes.clear()
        self._parked_removals.clear()
        self.parked_blocks = 0

    def __len__(self) -> int:
        """Foreign hashes currently translated."""
        return len(self._known)

    def _forget(self, foreign_hash: int) -> bool:
        known = self._known.get(foreign_hash)
        if known is None:
            return False
        known.stores -= 1
        if known.stores == 0:
            del self._known[foreign_hash]
        return True

    def _rekey(self, event: BlockStored, medium: Medium) -> RekeyedStore | None:
        hashes = event.block_hashes
        size = self._hasher.block_size
        tokens = event.token_ids
        if event.block_size != size or len(tokens) != size * len(hashes):
            self.rejected += 1
            return None
        parent_digest: BlockHash | None = None
        if event.parent_block_hash is not None:
            parent = self._known.get(event.parent_block_hash)
            if parent is None:
                self._park(event, medium)
                return None
            parent_digest = parent.digest
        extra = event.extra_keys
        per_block = extra is not None and len(extra) == len(hashes)
        digests: list[BlockHash] = []
        try:
            for index in range(len(hashes)):
                # vLLM publishes each block's extra keys untagged; our hasher tags them as vLLM hashes them.
                entry = extra[index] if per_block and extra is not None else None
                first = index == 0 and event.parent_block_hash is None
                keys = tagged_extra_keys(entry, lora_name=event.lora_name, first_block=first)
                parent_digest = self._hasher.hash_block(parent_digest, tokens[index * size : (index + 1) * size], keys)
                digests.append(parent_digest)
        except Exception:  # extra keys the decoder passed but no hash can take (a msgpack Ext, say): not ours
            self.rejected += 1
            return None
        for foreign_hash, digest in zip(hashes, digests, strict=True):  # the whole event hashed: now remember it
            known = self._known.get(foreign_hash)
            if known is None:
                known = self._known[foreign_hash] = _Known(digest)
            known.digest = digest
            known.stores += 1
        return RekeyedStore(medium, [to_external(digest) for digest in digests])

    def _park(self, event: BlockStored, medium: Medium) -> None:
        assert event.parent_block_hash is not None
        if self.parked_blocks + len(event.block_hashes) > MAX_PARKED_BLOCKS:
            self.rejected += 1
            return
        self._parked.setdefault(event.parent_block_hash, []).append((event, medium))
        self._parked_hashes.update(event.block_hashes)
        self.parked_blocks += len(event.block_hashes)

    def _unpark(self, event: BlockStored) -> None:
        self.parked_blocks -= len(event.block_hashes)
        self._parked_hashes.subtract(event.block_hashes)
        for foreign_hash in event.block_hashes:
            if self._parked_hashes[foreign_hash] <= 0:
                del self._parked_hashes[foreign_hash]
