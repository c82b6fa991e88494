"""What the prefix index holds, for metrics, benchmarks and tests: counters, sizes and full dumps.

Not on a request's path: :func:`dump` and :func:`count_blocks` scan the
block maps. Not thread-safe: :class:`~kvstore.router.index.PrefixIndex`
holds its lock around every call.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from kvstore.events import Medium
from kvstore.router.index_events import BlockMaps
from kvstore.router.index_registry import ProducerKind, Registry


class ProducerStats(NamedTuple):
    kind: ProducerKind
    replicas: tuple[str, ...]  # replicas it serves now (on any medium)
    last_seq: int | None  # seq of the last batch applied
    batches: int
    stored_blocks: int  # blocks listed in its BlockStored events
    removed_blocks: int  # blocks listed in its BlockRemoved events
    held_blocks: int  # distinct (medium, hash) it holds now
    unknown_removals: int  # removals of blocks it did not hold (lost events, or stale)
    rejected_events: int  # a medium it cannot have, or a foreign run that cannot be re-keyed
    parked_blocks: int  # foreign blocks waiting for their parent (re-keying)


class IndexStats(NamedTuple):
    nodes: int  # distinct block hashes held anywhere
    entries: int  # distinct (source, hash) pairs
    replicas: int
    producers: int
    unknown_producer_batches: int  # batches of unregistered producers, dropped
    per_producer: dict[str, ProducerStats]


def count_blocks(blocks: BlockMaps) -> int:
    """Distinct block hashes held on any medium: O(1) while only GPU blocks are held, else a scan."""
    gpu, cpu, storage = blocks[Medium.GPU], blocks[Medium.CPU], blocks[Medium.STORAGE]
    if not cpu and not storage:
        return len(gpu)
    return len(gpu.keys() | cpu.keys() | storage.keys())


def index_stats(blocks: BlockMaps, registry: Registry, unknown_producer_batches: int) -> IndexStats:
    per_producer = {}
    entries = 0
    for name, entry in registry.producers.items():
        held = sum(source.held for source in entry.sources.values())
        entries += held
        rekeyer = entry.rekeyer
        per_producer[name] = ProducerStats(
            entry.kind,
            registry.names_of(registry.producer_coverage(entry)),
            entry.last_seq,
            entry.batches,
            entry.stored_blocks,
            entry.removed_blocks,
            held,
            entry.unknown_removals + (0 if rekeyer is None else rekeyer.unknown_removals),
            entry.rejected_events + (0 if rekeyer is None else rekeyer.rejected),
            0 if rekeyer is None else rekeyer.parked_blocks,
        )
    return IndexStats(
        count_blocks(blocks),
        entries,
        len(registry.replica_slot),
        len(registry.producers),
        unknown_producer_batches,
        per_producer,
    )


def dump(blocks: BlockMaps, registry: Registry) -> dict[str, dict[str, Counter[int]]]:
    """Per producer, per medium, the multiset of block hashes it holds (ours, re-keyed).

    Media are keyed by :class:`~kvstore.events.Medium` (equal to its wire string); producers and
    media holding nothing are omitted.
    """
    out: dict[str, dict[str, Counter[int]]] = {}
    for name, entry in registry.producers.items():
        media: dict[str, Counter[int]] = {}
        for medium, source in entry.sources.items():
            if not source.held:
                continue
            bit = 1 << source.bit
            held = Counter({h: 1 for h, mask in blocks[medium].items() if mask & bit})
            held.update(source.dups)
            media[medium] = held
        if media:
            out[name] = media
    return out
