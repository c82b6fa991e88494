"""Applying KV events to the prefix index's block maps: the ingest hot path.

Representation
--------------
One dict per medium, ``blocks[medium]``: block hash -> bitmask of the
sources holding it there (on GPU a replica mask, on CPU and STORAGE a mask
of that medium's source space, :mod:`kvstore.router.index_registry`). A hash
is a key exactly while its mask is non-zero. Lookups need nothing else: a
chained block hash proves its whole prefix, so no parent links are kept.

Why it is fast and small in pure Python: at a million blocks every dict
access is a cache miss, and CPython's cyclic GC re-scans every live object
it tracks. A store or removal is one ``get`` and one ``set`` (or ``del``) of
an int in one dict -- no per-block object is built -- and ints are never
tracked by the collector, so a million blocks cost it nothing. A block held
on one medium takes one dict entry.

A source stores a block at most once in its bit; further stores of the same
hash by the same source (duplicates, as when two requests computed the same
block) are counted in ``source.dups`` and undone first by removals. Every
bit belongs to exactly one source, so a removal clears exactly its own bit.

Not thread-safe: :class:`~kvstore.router.index.PrefixIndex` holds its lock
around every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium
from kvstore.router.index_registry import Producer, Registry, Source
from kvstore.router.rekey import RekeyedStore

BlockMaps = dict[Medium, dict[int, int]]
"""Per medium: block hash -> mask of the sources holding it there (see the module docstring)."""


def new_block_maps() -> BlockMaps:
    return {medium: {} for medium in MEDIA}


def apply_events(blocks: BlockMaps, registry: Registry, entry: Producer, events: Sequence[KVEvent]) -> None:
    """Apply one producer's events in order; events on a medium it cannot have are counted and skipped."""
    wire_get = entry.wire_sources.get
    # Pools emit one BlockRemoved per evicted block: consecutive removals of one source are
    # gathered and applied as one run (same result, a fraction of the per-event cost).
    removing: Source | None = None
    removals: list[int] = []
    for event in events:
        kind = type(event)
        if kind is BlockRemoved:
            medium = event.medium  # type: ignore[union-attr]
            source = wire_get(medium) or registry.source(entry, medium)
            if source is None:
                entry.rejected_events += 1
                continue
            if source is not removing:
                if removing is not None:
                    _apply_removed(blocks, entry, removing, removals)
                removing, removals = source, []
            removals += event.block_hashes  # type: ignore[union-attr]
            continue
        if removing is not None:
            _apply_removed(blocks, entry, removing, removals)
            removing, removals = None, []
        if kind is BlockStored:
            medium = event.medium  # type: ignore[union-attr]
            source = wire_get(medium) or registry.source(entry, medium)
            if source is None:
                entry.rejected_events += 1
            else:
                _apply_stored(blocks, entry, source, event)  # type: ignore[arg-type]
        elif kind is AllBlocksCleared:
            clear(blocks, entry)
    if removing is not None:
        _apply_removed(blocks, entry, removing, removals)


def _apply_stored(blocks: BlockMaps, entry: Producer, source: Source, event: BlockStored) -> None:
    entry.stored_blocks += len(event.block_hashes)
    if entry.rekeyer is None:
        store(blocks[source.medium], source, event.block_hashes)
        return
    for action in entry.rekeyer.stored(event, source.medium):
        target = entry.sources[action.medium]
        if isinstance(action, RekeyedStore):
            store(blocks[target.medium], target, action.block_hashes)
        else:
            remove(blocks[target.medium], entry, target, action.block_hashes)


def _apply_removed(blocks: BlockMaps, entry: Producer, source: Source, block_hashes: list[int]) -> None:
    entry.removed_blocks += len(block_hashes)
    if entry.rekeyer is not None:
        block_hashes = entry.rekeyer.removed(block_hashes)
    remove(blocks[source.medium], entry, source, block_hashes)


def store(masks: dict[int, int], source: Source, block_hashes: Iterable[int]) -> None:
    """The hot path: ``source`` stored these blocks on its medium (``masks`` is that medium's map)."""
    get = masks.get
    bit = 1 << source.bit
    dups = source.dups
    added = 0
    for block_hash in block_hashes:
        mask = get(block_hash, 0)
        if mask & bit:
            dups[block_hash] = dups.get(block_hash, 0) + 1
        else:
            masks[block_hash] = mask | bit if mask else bit  # new blocks share one int (each ``|`` makes one)
            added += 1
    source.held += added


def remove(masks: dict[int, int], entry: Producer, source: Source, block_hashes: Iterable[int]) -> None:
    """``source`` dropped these blocks; one it does not hold is counted in ``entry.unknown_removals``."""
    get = masks.get
    bit = 1 << source.bit
    keep = ~bit
    dups = source.dups
    removed = 0
    unknown = 0
    for block_hash in block_hashes:
        mask = get(block_hash, 0)
        if not mask & bit:
            unknown += 1
            continue
        if dups:
            extra = dups.get(block_hash)
            if extra is not None:
                if extra > 1:
                    dups[block_hash] = extra - 1
                else:
                    del dups[block_hash]
                continue
        removed += 1
        mask &= keep
        if mask:
            masks[block_hash] = mask
        else:
            del masks[block_hash]
    source.held -= removed
    entry.unknown_removals += unknown


def clear(blocks: BlockMaps, entry: Producer) -> None:
    """Drop every block of a producer (AllBlocksCleared, reset, removal): one scan of each medium it holds."""
    if entry.rekeyer is not None:
        entry.rekeyer.clear()
    for source in entry.sources.values():
        source.dups.clear()
        if not source.held:
            continue
        masks = blocks[source.medium]
        bit = 1 << source.bit
        keep = ~bit
        for block_hash in [h for h, mask in masks.items() if mask & bit]:
            mask = masks[block_hash] & keep
            if mask:
                masks[block_hash] = mask
            else:
                del masks[block_hash]
        source.held = 0


def check_blocks(blocks: BlockMaps, registry: Registry) -> None:
    """Assert the block maps agree with the registry's sources (module docstring); O(blocks), for tests."""
    live: dict[Medium, int] = dict.fromkeys(MEDIA, 0)
    by_bit: dict[tuple[Medium, int], Source] = {}
    for source in registry.sources():
        live[source.medium] |= 1 << source.bit
        by_bit[source.medium, source.bit] = source
    held: dict[int, int] = {id(source): 0 for source in by_bit.values()}
    for medium, masks in blocks.items():
        for block_hash, mask in masks.items():
            assert mask, f"{medium} block {block_hash:#x} is held by nobody but still mapped"
            assert not mask & ~live[medium], f"{medium} block {block_hash:#x}: a bit of no source"
            rest = mask
            while rest:
                low = rest & -rest
                held[id(by_bit[medium, low.bit_length() - 1])] += 1
                rest ^= low
    for source in by_bit.values():
        name = source.producer.name
        assert source.held == held[id(source)], f"{name}: held {source.held} != {held[id(source)]}"
        masks = blocks[source.medium]
        for block_hash, extra in source.dups.items():
            assert extra >= 1 and masks.get(block_hash, 0) >> source.bit & 1, f"{name}: stale dup {block_hash:#x}"
