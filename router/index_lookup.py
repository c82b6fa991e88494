"""Prefix lookups on the index's block maps: the per-request hot path.

One pass over the prompt's blocks carries the mask of replicas still
matching; a replica's prefix ends at the first block none of its media
hold. Building the result costs O(replicas) per change of that mask, never
O(replicas x blocks). Without tier blocks (no CPU or STORAGE block held
anywhere) a cheaper pass reads the GPU map alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvstore.events import Medium
from kvstore.router.index_events import BlockMaps
from kvstore.router.index_registry import Registry


class MediumCounts(NamedTuple):
    """How many leading blocks of a prompt a replica can serve, by each block's best medium."""

    gpu: int
    cpu: int
    storage: int

    @property
    def total(self) -> int:
        """The prefix length, in blocks."""
        return self.gpu + self.cpu + self.storage


NO_MATCH = MediumCounts(0, 0, 0)


class PrefixLookup:
    """Answers lookups from a registry and its block maps (read, never written).

    Not thread-safe: :class:`~kvstore.router.index.PrefixIndex` holds its lock around every call.
    """

    def __init__(self, registry: Registry, blocks: BlockMaps) -> None:
        self._registry = registry
        self._gpu = blocks[Medium.GPU]
        self._cpu = blocks[Medium.CPU]
        self._storage = blocks[Medium.STORAGE]
        self._gpu_counts: list[MediumCounts] = []  # MediumCounts(n, 0, 0) at n: shared, immutable

    def __call__(self, block_hashes: Iterable[int]) -> dict[str, MediumCounts]:
        """Per replica, how much of the prefix ``block_hashes`` (our external hashes) it can serve.

        A block counts once, from the best medium the replica has it on
        (GPU > CPU > STORAGE). Replicas with an empty prefix are omitted
        (read them as :data:`NO_MATCH`). ``block_hashes`` is read in order and
        no further than the first block no replica holds, so it may be a lazy
        iterator that computes each hash only when asked.
        """
        alive = self._registry.all_replicas
        if not alive:
            return {}
        if not self._cpu and not self._storage:
            return self._gpu_only(block_hashes, alive)
        return self._tiered(block_hashes, alive)

    def _gpu_only(self, block_hashes: Iterable[int], alive: int) -> dict[str, MediumCounts]:
        gpu_get = self._gpu.get
        segments: list[tuple[int, int]] = []  # (prefix length, replicas whose prefix has that length)
        length = 0
        for block_hash in block_hashes:
            held = gpu_get(block_hash, 0) & alive
            if held != alive:
                if length:
                    segments.append((length, alive & ~held))
                alive = held
                if not alive:
                    break
            length += 1
        if alive and length:
            segments.append((length, alive))
        names_of = self._registry.names_of
        if len(segments) == 1:
            length, mask = segments[0]
            return dict.fromkeys(names_of(mask), self._gpu_counts_of(length))
        result: dict[str, MediumCounts] = {}
        for length, mask in segments:
            result.update(dict.fromkeys(names_of(mask), self._gpu_counts_of(length)))
        return result

    def _gpu_counts_of(self, length: int) -> MediumCounts:
        cache = self._gpu_counts
        while len(cache) <= length:
            cache.append(MediumCounts(len(cache), 0, 0))
        return cache[length]

    def _tiered(self, block_hashes: Iterable[int], alive: int) -> dict[str, MediumCounts]:
        gpu_get, cpu_get, storage_get = self._gpu.get, self._cpu.get, self._storage.get
        registry = self._registry
        cpu_memo = registry.cover_memo[Medium.CPU]
        storage_memo = registry.cover_memo[Medium.STORAGE]
        runs: list[list[int]] = []  # [length, gpu, cpu, storage replica masks], consecutive equal blocks merged
        run: list[int] | None = None
        for block_hash in block_hashes:
            gpu = gpu_get(block_hash, 0) & alive
            if gpu == alive:  # GPU is every matching replica's best medium: the tiers cannot change the answer
                cpu = storage = 0
            else:
                cpu = cpu_get(block_hash, 0)
                if cpu:
                    covered = cpu_memo.get(cpu)
                    cpu = registry.cover(Medium.CPU, cpu) if covered is None else covered
                storage = storage_get(block_hash, 0)
                if storage:
                    covered = storage_memo.get(storage)
                    storage = registry.cover(Medium.STORAGE, storage) if covered is None else covered
                held = (gpu | cpu | storage) & alive
                if not held:
                    break
                cpu &= held & ~gpu
                storage = held & ~gpu & ~cpu
                alive = held
            if run is not None and run[1] == gpu and run[2] == cpu and run[3] == storage:
                run[0] += 1
            else:
                run = [1, gpu, cpu, storage]
                runs.append(run)
        totals: dict[str, list[int]] = {}
        for length, *masks in runs:
            for position, mask in enumerate(masks):
                if mask:
                    for name in registry.names_of(mask):
                        acc = totals.get(name)
                        if acc is None:
                            acc = totals[name] = [0, 0, 0]
                        acc[position] += length
        return {name: MediumCounts(*acc) for name, acc in totals.items()}
