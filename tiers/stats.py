"""The tier store's counters, and the snapshot of them it hands out (over Ray, to metrics).

Counters are plain ints and dicts bumped on the store's event loop; nothing
here locks. :class:`TierStats` is an immutable copy, safe to ship anywhere;
:func:`tier_stats` builds it from the store's own counters and those the
arena and the disk tier keep themselves, so that one call on the store's
loop gives a consistent picture of both media.
"""

from __future__ import annotations

import bisect
from collections import Counter

import msgspec

from kvstore.events import Medium
from kvstore.tiers.arena import Arena
from kvstore.tiers.disk import DiskTier

OFFLOAD_SECONDS_BOUNDS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

SPILL = "spill"  # a worker's pool -> CPU arena
PROMOTE = "promote"  # CPU arena -> a worker's pool
DISK_WRITE = "disk_write"  # CPU arena -> disk
DISK_READ = "disk_read"  # disk -> CPU arena
DIRECTIONS = (SPILL, PROMOTE, DISK_WRITE, DISK_READ)


class HistogramSnapshot(msgspec.Struct, frozen=True):
    bounds: tuple[float, ...]  # upper bounds of the buckets; a last +Inf bucket is implied
    counts: tuple[int, ...]  # observations per bucket (not cumulative), len(bounds) + 1
    total: float  # sum of the observations


class Histogram:
    """A fixed-bucket histogram of seconds."""

    def __init__(self, bounds: tuple[float, ...] = OFFLOAD_SECONDS_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


class StoreCounters:
    """What the store counts itself (the disk tier and arena keep their own)."""

    def __init__(self) -> None:
        self.hits: Counter[Medium] = Counter()  # medium -> blocks served to a worker
        self.lookups = 0  # lookup() calls
        self.lookup_blocks = 0  # block hashes asked about
        self.offload_bytes: Counter[str] = Counter()  # direction -> bytes moved
        self.offload_seconds = {direction: Histogram() for direction in DIRECTIONS}
        self.not_stored: Counter[str] = Counter()  # reason -> blocks the CPU tier did not take
        self.duplicates = 0  # spills of blocks the CPU tier already held


class TierStats(msgspec.Struct, frozen=True, kw_only=True):
    """A consistent copy of a tier store's state and counters."""

    usage_bytes: dict[Medium, int]  # medium -> bytes held
    capacity_bytes: dict[Medium, int]  # medium -> capacity in force
    blocks: dict[Medium, int]  # medium -> blocks held
    hits: dict[Medium, int]  # medium -> blocks served
    lookups: int
    lookup_blocks: int
    offload_bytes: dict[str, int]  # direction -> bytes
    offload_seconds: dict[str, HistogramSnapshot]  # direction -> latency of one batch
    not_stored: dict[Medium, dict[str, int]]  # medium -> reason -> blocks
    duplicates: int
    evictions: dict[Medium, int]  # medium -> blocks evicted
    collisions: dict[Medium, int]  # medium -> lookups whose hash matched other tokens
    disk_errors: dict[str, int]  # errno name, or "deadline_<op>" -> I/Os
    integrity_failures: dict[str, int]  # reason -> files refused and removed
    scan_removed: dict[str, int]  # reason -> files removed by the start-up scan
    disk_io_mode: str  # "O_DIRECT", "buffered (why)", or "off"


def tier_stats(cpu: Arena, disk: DiskTier | None, counters: StoreCounters) -> TierStats:
    """A snapshot of one store: its ``counters``, its arena and (when it has one) its disk tier."""
    usage = {Medium.CPU: cpu.used_bytes}
    capacity = {Medium.CPU: cpu.capacity_bytes}
    blocks = {Medium.CPU: cpu.num_blocks}
    not_stored = {Medium.CPU: dict(counters.not_stored)}
    evictions = {Medium.CPU: cpu.num_evictions}
    collisions = {Medium.CPU: cpu.num_collisions}
    disk_errors: dict[str, int] = {}
    integrity: dict[str, int] = {}
    scan_removed: dict[str, int] = {}
    io_mode = "off"
    if disk is not None:
        usage[Medium.STORAGE] = disk.used_bytes
        capacity[Medium.STORAGE] = disk.limit_bytes
        blocks[Medium.STORAGE] = disk.num_blocks
        not_stored[Medium.STORAGE] = dict(disk.counters.not_stored)
        evictions[Medium.STORAGE] = disk.counters.evictions
        collisions[Medium.STORAGE] = disk.counters.collisions
        disk_errors = dict(disk.counters.io_errors)
        disk_errors.update({f"deadline_{op}": n for op, n in disk.counters.deadline_expired.items()})
        integrity = dict(disk.counters.integrity_failures)
        scan_removed = dict(disk.counters.scan_removed)
        io_mode = disk.io_mode
    return TierStats(
        usage_bytes=usage,
        capacity_bytes=capacity,
        blocks=blocks,
        hits=dict(counters.hits),
        lookups=counters.lookups,
        lookup_blocks=counters.lookup_blocks,
        offload_bytes=dict(counters.offload_bytes),
        offload_seconds={d: h.snapshot() for d, h in counters.offload_seconds.items()},
        not_stored=not_stored,
        duplicates=counters.duplicates,
        evictions=evictions,
        collisions=collisions,
        disk_errors=disk_errors,
        integrity_failures=integrity,
        scan_removed=scan_removed,
        disk_io_mode=io_mode,
    )
