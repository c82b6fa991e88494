"""``kvstore bench offload``: CPU and disk tier bandwidth against same-run physical baselines.

CPU tier -- the path a worker's offload takes. For each model shape, the
node's tier runs in process (a TierStore behind a LocalTierClient) and this
process maps its arena through a ``TierLink``, as a worker does. Blocks of a
KV tensor pool (``[num_blocks, *block_shape]``) are spilled from scattered
pool rows with ``TierLink.spill`` in batches of ``--batch-blocks`` blocks
(reserve -> the link's copy engine -> commit, as a worker's store job does),
then promoted into other scattered rows with ``TierLink.promote`` (acquire
-> copy engine -> release, as a worker's admission does). A Ray worker's
tier calls are Ray actor calls; here they are calls to the store's event
loop thread, so the Ray round trips per batch are not in these numbers.
Baseline: one large ``torch`` copy of the same total size between the same
memories (pool -> arena, arena -> pool), i.e. memcpy bandwidth.

Disk tier -- the same blocks are written from arena slots to slab slots by
one ``DiskTier.write_many`` (runs of consecutive slots, ``--io`` I/Os in
flight), as the store writes CPU evictions, then ``os.sync()``. By default
the tier is full of other blocks first (filled once, untimed), so every
write evicts a block and reuses its slot, as the store's write-back does in
steady state; ``--disk-fresh`` writes into an empty tier each run instead
(the slabs grow first); the page cache of the slabs is dropped
(``posix_fadvise(DONTNEED)``) and they are read back into arena slots by one
``DiskTier.read_many`` (header and checksum verified), as the store promotes
a prompt's disk hits. Baseline: one large sequential O_DIRECT write (then fsync) and
read of one file of the same size, from and into the same arena memory the
tier moves (all its slots as one buffer), as the CPU baseline copies between
the same memories: on a virtual machine the guest pages an O_DIRECT read
lands in can change its speed by a third or more. Where the file
system rejects O_DIRECT (tmpfs before Linux 6.6, some network file systems)
both sides run buffered and the output says so. Use a directory on the disk
you want measured (``--disk-dir``; the default is the repository's ignored
``out/`` folder), not /dev/shm.

Every GB/s is the median of ``--repeat`` runs; each ratio is the median of
per-run ratios, each baseline measured right beside the run it is compared
with, so that a busy moment slows both sides of a ratio alike. On disk,
which of the two goes first alternates by run: a large write leaves a
virtual disk busy for a while after fsync returns, which slows whatever
runs next, so an even ``--repeat`` weighs both orders alike; and before
each measured pair (writes, then reads) the bench syncs and idles
``--settle-s`` seconds, so the tail of the work before it is not inside it
(docs/tiers.md has what each of these changed).

TTFT (:mod:`kvstore.benchmarks.offload_ttft`): for each ``--ttft-lengths`` prompt,
the time to first token when a real worker recomputes it, and when it hits
in its GPU pool, in the CPU tier and on disk (promoted through the same
tier link a Ray worker uses); the baseline is recompute.

JSON (``--json``) holds the headline ratios for the 2 MiB Llama-3-8B block
(or the largest shape measured) under ``cpu`` and ``disk``, all rows, and
one ``ttft`` row per prompt length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from kvstore.benchmarks.figures import pyplot, save_figure
from kvstore.benchmarks.offload_ttft import TTFTRow, measure_ttft
from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.deploy.config import load_config
from kvstore.deploy.model_args import add_model_arguments, model_overrides
from kvstore.errors import ConfigError
from kvstore.events import Medium
from kvstore.kv_layout import KVLayout
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit, check_blocks, make_grants
from kvstore.tiers.client import LocalTierClient, Pending, TierClient
from kvstore.tiers.config import MAX_COPY_THREADS, TierConfig
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_files import direct_io_refusal
from kvstore.tiers.disk_format import header_len
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.link import TierLink
from kvstore.tiers.shared_memory import ArenaInfo, SharedSlots
from kvstore.tiers.stats import TierStats
from kvstore.workers.model_source import describe_model

HEADLINE_SHAPE = "llama-3-8b"
# The project's bandwidth targets, as a share of the same-run baseline (both directions): shape -> ratio.
CPU_TARGETS = {"tiny": 0.5, "qwen2.5-0.5b": 0.8, "llama-3-8b": 0.85}
DISK_TARGETS = {"qwen2.5-0.5b": 0.8, "llama-3-8b": 0.9}
_GB = 1e9
_CHUNK = 256 * 1024 * 1024


def _identity(model: str, layers: int, kv_heads: int, head_dim: int, dtype: str, block_size: int) -> CacheIdentity:
    layout = KVLayout(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,  # type: ignore[arg-type]
        block_size=block_size,
    )
    return CacheIdentity(model=model, layout=layout, hash_algo="sha256_cbor", hash_seed="kvstore")


SHAPES: dict[str, CacheIdentity] = {
    "tiny": _identity("kvstore-tiny", 2, 2, 32, "float32", 16),  # the built-in worker model: 16 KiB
    "qwen2.5-0.5b": _identity("Qwen2.5-0.5B", 24, 2, 64, "bfloat16", 16),  # 192 KiB
    "llama-3-8b": _identity("Llama-3-8B", 32, 8, 128, "float16", 16),  # 2 MiB
    "llama-3-8b-bs32": _identity("Llama-3-8B", 32, 8, 128, "float16", 32),  # 4 MiB
    "llama-3-70b": _identity("Llama-3-70B", 80, 8, 128, "float16", 16),  # 5 MiB
}


class CpuRow(NamedTuple):
    shape: str
    block_bytes: int
    blocks: int
    spill_gbps: float
    promote_gbps: float
    memcpy_spill_gbps: float
    memcpy_promote_gbps: float
    spill_ratio: float  # median over runs of (spill / the memcpy measured right after it)
    promote_ratio: float
    spill_ratio_runs: list[float]  # each run's ratio, to show the spread
    promote_ratio_runs: list[float]
    # --breakdown: microseconds per block in each part of the path, over the measured runs (else empty);
    # the baseline's own cost per block is "memcpy".
    breakdown_us: dict[str, float]


class DiskRow(NamedTuple):
    shape: str
    block_bytes: int
    blocks: int
    io_mode: str
    write_gbps: float
    read_gbps: float
    baseline_write_gbps: float
    baseline_read_gbps: float
    write_ratio: float  # median over runs of (tier / the baseline measured right after it)
    read_ratio: float
    write_ratio_runs: list[float]  # each run's ratio, to show the spread
    read_ratio_runs: list[float]


def _metas(identity: CacheIdentity, count: int, salt: int) -> list[BlockMeta]:
    """Distinct blocks per run (a repeated hash would be a duplicate, not a copy)."""
    size = identity.block_size
    base = salt * count * size
    return [
        BlockMeta((salt << 40) + index + 1, (salt << 40) + index if index else None, tuple(range(base, base + size)))  # type: ignore[arg-type]
        for index in range(count)
    ]


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / _GB


def _ratios(ours: list[float], baseline: list[float]) -> list[float]:
    """Per-run bandwidth ratios from seconds (each run's baseline ran right beside it: a busy machine
    slows both alike, where a ratio of medians would mix quiet and busy moments)."""
    return [round(base / mine, 3) for mine, base in zip(ours, baseline, strict=True)]


def _settle_disk(seconds: float) -> None:
    """Before each measured pair: flush, then give the device a moment. A virtual disk keeps
    working after fsync/sync return (host write-back, trims on a ``discard`` mount), and that
    tail would land in whichever measurement came next."""
    os.sync()
    time.sleep(seconds)


def _ignore(ok: bool) -> None:
    """on_settled for the bench's own buffers: the answers are checked instead."""


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def _side_by_side(
    ours: Callable[[], Awaitable[Any]], baseline: Callable[[], float], ours_first: bool
) -> tuple[float, float]:
    """Seconds of ``ours`` and of ``baseline`` (which times itself), run one right after the other."""

    async def timed_ours() -> float:
        start = time.perf_counter()
        await ours()
        return time.perf_counter() - start

    if ours_first:
        mine = await timed_ours()
        return mine, baseline()
    base = baseline()
    return await timed_ours(), base


# --------------------------------------------------------------------------- CPU tier


def _spill_all(link: TierLink, metas: list[BlockMeta], pool: torch.Tensor, order: list[int], batch: int) -> None:
    """Spill ``metas[i]`` from pool row ``order[i]``, ``batch`` blocks a call, as a worker's evictions do."""
    for first in range(0, len(metas), batch):
        rows = order[first : first + batch]
        stored = link.spill(metas[first : first + batch], pool, rows)
        assert stored == len(rows), "the arena must hold the whole run"
    link.settle()  # the last commit, sent without waiting, is part of the work measured


def _allocator(rows: list[int]) -> Callable[[int], list[int]]:
    """``allocate`` for ``TierLink.promote``: the next ``n`` of ``rows`` at each call."""
    free = iter(rows)
    return lambda n: list(islice(free, n))


def _promote_all(link: TierLink, metas: list[BlockMeta], pool: torch.Tensor, order: list[int], batch: int) -> None:
    """Promote ``metas[i]`` into pool row ``order[i]``, ``batch`` blocks a call, as a worker's admissions do."""
    for first in range(0, len(metas), batch):
        promoted = link.promote(metas[first : first + batch], pool, _allocator(order[first : first + batch]))
        assert len(promoted.block_ids) == min(batch, len(metas) - first), "a block went missing"
    link.settle()  # and the last release


# --breakdown: the parts of a spill and of a promotion, timed where the link calls them.
_SPILL_PARTS = {"reserve": "client", "commit_later": "client", "spill": "engine"}
_PROMOTE_PARTS = {"acquire": "client", "release_later": "client", "promote": "engine"}
_PARTS = {**_SPILL_PARTS, **_PROMOTE_PARTS}  # call name -> whose method it is


def _time_parts(link: TierLink, spent: dict[str, float]) -> None:
    """Wrap the link's client calls and copies so each adds its seconds to ``spent[name]`` (a copy's
    until its Future is done). Costs two clock reads a call: a batch of blocks is one call."""
    for name, owner in _PARTS.items():
        copy = owner == "engine"  # the engine's calls return a Future: timed until it is done
        target = link.engine if copy else link.client
        inner = getattr(target, name)

        def timed(*args: Any, _inner: Any = inner, _name: str = name, _copy: bool = copy, **kwargs: Any) -> Any:
            start = time.perf_counter()
            answer = _inner(*args, **kwargs)
            if _copy:
                answer.result()
            spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - start
            return answer

        setattr(target, name, timed)


class _Answered:
    """A commit or release the floor client answered at once (the Pending a link collects)."""

    def done(self) -> bool:
        return True

    def result(self) -> None:
        return None


class _FloorClient:
    """``--floor``: a stand-in for the tier that keeps no books, for the bench alone.

    It checks each spill's metas (as the real tier must) and hands out the arena's slots in order, wrapping
    round, as grants with fresh lease ids; commits and releases are answered at once. No index, leases,
    eviction, admission or events. The link, its copy engine and the arena are the real ones, so a row
    measured through it is the most this path allows whatever the tier's bookkeeping costs. It is right only
    for the bench's pattern: every block spilled once in order, then promoted in the same order (the
    promotions find the blocks in the slots the spills filled, which the bench checks byte for byte).
    """

    ordered = True  # every call answered before it returns

    def __init__(self, inner: LocalTierClient, identity: CacheIdentity) -> None:
        self._inner = inner
        self._block_size = identity.block_size
        self._slots = inner.arena_info().num_slots
        self._next_slot = 0
        self._next_lease = 1

    def _grants(self, blocks: Sequence[BlockMeta]) -> list[SlotGrant]:
        first, count = self._next_slot, min(len(blocks), self._slots)
        slots = [(first + index) % self._slots for index in range(count)]
        ids = range(self._next_lease, self._next_lease + count)
        self._next_slot, self._next_lease = (first + count) % self._slots, ids.stop
        hashes = [meta.block_hash for meta in blocks[:count]]
        return make_grants(ids, slots, hashes, Medium.CPU)

    def arena_info(self) -> ArenaInfo:
        return self._inner.arena_info()

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        return self._inner.lookup(block_hashes, start)

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        check_blocks(blocks, self._block_size)
        return list(self._grants(blocks))

    def commit(self, lease_ids: Sequence[int]) -> int:
        return len(lease_ids)

    def commit_later(self, lease_ids: Sequence[int]) -> Pending:
        return _Answered()

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        return self._grants(blocks)

    def release(self, lease_ids: Sequence[int]) -> None:
        return None

    def release_later(self, lease_ids: Sequence[int]) -> Pending:
        return _Answered()

    def stats(self) -> TierStats:
        return self._inner.stats()


# The tiers a CPU row can be measured through: the store in process (what the headline ratios use), the
# bookless stand-in (--floor) and the store as a deployment runs it, a Ray actor (--ray). Row name suffixes.
VIAS = {"local": "", "floor": " floor", "ray": " ray"}


def _ray_tier(stack: ExitStack, config: TierConfig, identity: CacheIdentity) -> TierClient:
    """``--ray``: the tier as a deployment runs it -- a TierActor (its own process, on the Ray cluster this
    process is connected to) reached by RayTierClient, so each reserve / acquire is an actor round trip."""
    import ray

    from kvstore.tiers.actor import TierActor
    from kvstore.tiers.client import RayTierClient

    arena_name = f"kvstore-bench-{uuid.uuid4().hex[:12]}"
    handle = TierActor.options(num_cpus=0).remote(config, identity, None, arena_name)  # type: ignore[attr-defined]

    def stop() -> None:
        try:
            ray.get(handle.shutdown.remote(), timeout=60)  # unlinks the arena
        finally:
            ray.kill(handle)

    stack.callback(stop)
    client = RayTierClient(handle, timeout_s=60.0)
    stack.callback(client.close)  # the control socket, before the actor goes
    return client


def measure_cpu(
    name: str, identity: CacheIdentity, args: argparse.Namespace, progress: tqdm, *, via: str = "local"
) -> CpuRow:
    block_bytes = identity.block_bytes
    count = max(1, args.total_mib * 1024 * 1024 // block_bytes)
    pool = torch.empty((count, *identity.layout.block_shape), dtype=identity.torch_dtype)
    pool.view(torch.uint8).random_()  # touched: no page faults inside the timings
    target = torch.zeros_like(pool)
    generator = torch.Generator().manual_seed(0)
    spill_order = torch.randperm(count, generator=generator).tolist()
    promote_order = torch.randperm(count, generator=generator).tolist()
    flat_pool, flat_target = pool.view(count, -1).view(torch.uint8), target.view(count, -1).view(torch.uint8)
    spills, promotes, base_spill, base_promote = [], [], [], []
    with ExitStack() as stack:
        config = TierConfig(cpu_capacity_bytes=count * block_bytes)
        tier: TierClient
        if via == "ray":
            tier = _ray_tier(stack, config, identity)
        else:
            client = LocalTierClient(config, identity, arena_name=f"kvstore-bench-{uuid.uuid4().hex[:12]}")
            stack.callback(client.close)
            tier = _FloorClient(client, identity) if via == "floor" else client
        link = TierLink(tier, identity, copy_threads=args.copy_threads)
        stack.callback(link.close)
        arena = link.slots.tensor  # this process's mapping of the tier's arena, as a worker has it
        # The baselines copy between the same kinds of memory -- pool -> shared arena, shared arena -> pool --
        # into spare buffers of the same size, so they never disturb the blocks under test.
        scratch = SharedSlots.create(f"kvstore-bench-{uuid.uuid4().hex[:12]}", count, block_bytes)
        stack.callback(scratch.close)
        scratch_arena = scratch.tensor
        scratch_target = torch.zeros_like(flat_target)
        spent: dict[str, float] = {}
        if args.breakdown:
            _time_parts(link, spent)
        for rep in range(args.repeat + 1):  # the first round warms up
            if rep == 1:
                spent.clear()
            metas = _metas(identity, count, rep)
            spill_s = _timed(partial(_spill_all, link, metas, pool, spill_order, args.batch_blocks))
            memcpy_spill = _timed(lambda: scratch_arena.copy_(flat_pool))
            progress.update()
            promote_s = _timed(partial(_promote_all, link, metas, target, promote_order, args.batch_blocks))
            memcpy_promote = _timed(lambda: scratch_target.copy_(arena))
            progress.update()
            for index in (0, count - 1):  # raw bytes: random bits include NaNs, which never compare equal
                promoted, spilled = flat_target[promote_order[index]], flat_pool[spill_order[index]]
                assert torch.equal(promoted, spilled), "promoted bytes differ from spilled ones"
            progress.update()
            if rep:
                spills.append(spill_s)
                promotes.append(promote_s)
                base_spill.append(memcpy_spill)
                base_promote.append(memcpy_promote)
    total = count * block_bytes
    breakdown: dict[str, float] = {}
    if args.breakdown:
        moved = count * args.repeat  # blocks per direction over the measured runs
        breakdown = {part: round(spent.get(part, 0.0) / moved * 1e6, 2) for part in _PARTS}
        breakdown["spill_total"] = round(sum(spills) / moved * 1e6, 2)
        breakdown["promote_total"] = round(sum(promotes) / moved * 1e6, 2)
        breakdown["memcpy"] = round((sum(base_spill) + sum(base_promote)) / 2 / moved * 1e6, 2)
    return CpuRow(
        name + VIAS[via],
        block_bytes,
        count,
        _gbps(total, spills),
        _gbps(total, promotes),
        _gbps(total, base_spill),
        _gbps(total, base_promote),
        statistics.median(_ratios(spills, base_spill)),
        statistics.median(_ratios(promotes, base_promote)),
        _ratios(spills, base_spill),
        _ratios(promotes, base_promote),
        breakdown,
    )


# --------------------------------------------------------------------------- disk tier


def _drop_cache(paths: Iterator[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def baseline_write(path: Path, data: memoryview, direct: bool) -> float:
    """One sequential write of ``data`` to a new file, then fsync; seconds."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        done = 0
        while done < data.nbytes:
            done += os.write(fd, data[done : done + _CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def baseline_read(path: Path, data: memoryview, direct: bool) -> float:
    """One sequential read of the file into ``data``; seconds (page cache dropped first)."""
    if not direct:
        _drop_cache(iter([path]))
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        done = 0
        while done < data.nbytes:
            got = os.readv(fd, [data[done : done + _CHUNK]])
            if not got:
                raise OSError(f"{path} ended after {done} bytes")
            done += got
    finally:
        os.close(fd)
    return time.perf_counter() - start


def measure_disk(name: str, identity: CacheIdentity, args: argparse.Namespace, root: Path, progress: tqdm) -> DiskRow:
    block_bytes = identity.block_bytes
    count = max(1, args.disk_total_mib * 1024 * 1024 // block_bytes)
    total = count * block_bytes
    run_dir = root / f"{name}-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    direct = direct_io_refusal(run_dir) is None
    os.sync()  # nothing of earlier work (another shape's deleted files) still in flight

    async def run() -> tuple[str, list[float], list[float], list[float], list[float]]:
        arena = SharedSlots.create(f"kvstore-bench-{uuid.uuid4().hex[:12]}", count, block_bytes)
        arena.tensor.random_()
        # The baseline moves the same memory the tier does: the arena's slots, all of them as one buffer
        # (page-aligned). Where a page of memory sits can change what a virtual disk's DMA costs.
        slots = memoryview(arena.tensor.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
        writes, reads, base_writes, base_reads = [], [], [], []
        io_mode = ""
        try:
            big = run_dir / "baseline.bin"
            full: DiskTier | None = None
            if not args.disk_fresh:
                # Steady state: a tier exactly full of other blocks, so every write evicts one (and reuses
                # its slot), as the store's write-back does once its disk tier has filled up.
                full = DiskTier(
                    run_dir / "tier",
                    identity,
                    capacity_bytes=count * (header_len(identity.block_size) + block_bytes),
                    deadline_s=args.deadline_s,
                    max_concurrent_io=args.io,
                )
                filler = _metas(identity, count, args.repeat + 1)
                ok = await full.write_many([(m, arena.view(i), _ignore) for i, m in enumerate(filler)])
                assert all(ok), f"{ok.count(False)} blocks not stored: {dict(full.counters.not_stored)}"
            for rep in range(args.repeat):
                disk = full or DiskTier(
                    run_dir / f"tier-{rep}",
                    identity,
                    capacity_bytes=count * (block_bytes + 8192),
                    deadline_s=args.deadline_s,
                    max_concurrent_io=args.io,
                )
                io_mode = disk.io_mode
                metas = _metas(identity, count, rep)

                async def write_all(tier: DiskTier = disk, blocks: list[BlockMeta] = metas) -> None:
                    ok = await tier.write_many([(m, arena.view(i), _ignore) for i, m in enumerate(blocks)])
                    assert all(ok), f"{ok.count(False)} blocks not stored: {dict(tier.counters.not_stored)}"
                    os.sync()

                async def read_all(tier: DiskTier = disk, blocks: list[BlockMeta] = metas) -> None:
                    order = list(reversed(range(count)))  # into other slots than they came from
                    ok = await tier.read_many([(m, arena.view(order[i]), _ignore) for i, m in enumerate(blocks)])
                    assert all(ok), f"reads failed: {dict(tier.counters.integrity_failures)}"

                # Who goes first alternates by run: after a large write the virtual disk stays busy for a
                # while after fsync returns, slowing whatever runs next.
                ours_first = rep % 2 == 0
                _settle_disk(args.settle_s)  # the last run's deletions too: trimmed at the next journal commit here
                mine, base = await _side_by_side(write_all, lambda: baseline_write(big, slots, direct), ours_first)
                writes.append(mine)
                base_writes.append(base)
                progress.update()
                _drop_cache(iter(disk.slab_paths()))
                _settle_disk(args.settle_s)
                mine, base = await _side_by_side(read_all, lambda: baseline_read(big, slots, direct), ours_first)
                reads.append(mine)
                base_reads.append(base)
                progress.update()
                if full is None:
                    await disk.aclose()
                    shutil.rmtree(disk.directory.parent)
                big.unlink()
                progress.update()
            if full is not None:
                await full.aclose()
        finally:
            slots.release()
            arena.close()
        return io_mode, writes, reads, base_writes, base_reads

    try:
        io_mode, writes, reads, base_writes, base_reads = asyncio.run(run())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if not direct:
        io_mode += "; baseline buffered + fsync (the file system rejects O_DIRECT)"
    return DiskRow(
        name,
        block_bytes,
        count,
        io_mode,
        _gbps(total, writes),
        _gbps(total, reads),
        _gbps(total, base_writes),
        _gbps(total, base_reads),
        statistics.median(_ratios(writes, base_writes)),
        statistics.median(_ratios(reads, base_reads)),
        _ratios(writes, base_writes),
        _ratios(reads, base_reads),
    )


# --------------------------------------------------------------------------- report


def _mib(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f} KiB" if nbytes < 1024 * 1024 else f"{nbytes / 1024 / 1024:.0f} MiB"


def ttft_model(args: argparse.Namespace) -> str:
    """What the TTFT rows run: the flags' model, else the ``kvstore bench ttft`` model."""
    overrides = model_overrides(args)
    return ", ".join(overrides) if overrides else "the `kvstore bench ttft` model"


def print_ttft(rows: list[TTFTRow], model: str) -> None:
    if not rows:
        return
    print(f"\nTTFT (one worker, {model}, on the CPU): recompute vs a hit in each tier")
    print(
        f"{'prompt':>8}{'recompute ms':>14}{'GPU hit ms':>12}{'CPU hit ms':>12}{'disk hit ms':>13}"
        f"{'recompute/CPU':>15}{'recompute/disk':>16}"
    )
    for row in rows:
        print(
            f"{row.prompt_tokens:>8}{row.recompute_ms:>14.1f}{row.gpu_hit_ms:>12.1f}{row.cpu_hit_ms:>12.1f}"
            f"{row.disk_hit_ms:>13.1f}{row.recompute_ms / row.cpu_hit_ms:>14.1f}x"
            f"{row.recompute_ms / row.disk_hit_ms:>15.1f}x"
        )


def print_tables(cpu: list[CpuRow], disk: list[DiskRow], args: argparse.Namespace, disk_dir: Path) -> None:
    if cpu:
        print(
            f"\nCPU tier: TierLink.spill / promote at scattered pool rows ({args.copy_threads} copy threads, "
            f"batches of {args.batch_blocks} blocks) vs one large torch copy of the same size"
        )
        print(
            f"{'shape':<22}{'block':>9}{'blocks':>8}{'spill GB/s':>12}{'promote GB/s':>14}"
            f"{'memcpy GB/s':>13}{'spill/memcpy':>14}{'promote/memcpy':>16}{'target':>8}"
        )
        for row in cpu:
            memcpy = (row.memcpy_spill_gbps + row.memcpy_promote_gbps) / 2
            print(
                f"{row.shape:<22}{_mib(row.block_bytes):>9}{row.blocks:>8}{row.spill_gbps:>12.2f}"
                f"{row.promote_gbps:>14.2f}{memcpy:>13.2f}{row.spill_ratio:>14.2f}{row.promote_ratio:>16.2f}"
                f"{_target(CPU_TARGETS, row.shape, row.spill_ratio, row.promote_ratio):>8}"
            )
        if any(row.breakdown_us for row in cpu):
            print(
                "\nWhere a block's time goes (--breakdown: us per block, measured runs; a promotion's copy "
                "includes allocating its pool rows)"
            )
            parts = [*_SPILL_PARTS, "spill_total", *_PROMOTE_PARTS, "promote_total", "memcpy"]
            print(f"{'shape':<22}" + "".join(f"{part:>14}" for part in parts))
            for row in cpu:
                print(f"{row.shape:<22}" + "".join(f"{row.breakdown_us.get(part, 0.0):>14.2f}" for part in parts))
    if disk:
        fill = "an empty tier each run" if args.disk_fresh else "a full tier (every write evicts a block)"
        print(
            f"\nDisk tier: {args.io} I/Os in flight, writes into {fill}, files under {disk_dir}, "
            "vs one large sequential O_DIRECT file"
        )
        for mode in sorted({row.io_mode for row in disk}):
            print(f"  I/O mode: {mode}")
        print(
            f"{'shape':<17}{'block':>9}{'blocks':>8}{'write GB/s':>12}{'read GB/s':>11}"
            f"{'base write':>12}{'base read':>11}{'write ratio':>13}{'read ratio':>12}{'target':>8}"
        )
        for drow in disk:
            print(
                f"{drow.shape:<17}{_mib(drow.block_bytes):>9}{drow.blocks:>8}{drow.write_gbps:>12.2f}"
                f"{drow.read_gbps:>11.2f}{drow.baseline_write_gbps:>12.2f}{drow.baseline_read_gbps:>11.2f}"
                f"{drow.write_ratio:>13.2f}{drow.read_ratio:>12.2f}"
                f"{_target(DISK_TARGETS, drow.shape, drow.write_ratio, drow.read_ratio):>8}"
            )


def _target(targets: dict[str, float], shape: str, *ratios: float) -> str:
    """``0.80 ok`` / ``0.80 no`` (both directions against the shape's target), ``-`` without one."""
    if shape not in targets:
        return "-"
    return f"{targets[shape]:.2f} {'ok' if min(ratios) >= targets[shape] else 'no'}"


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _headline(rows: list[Any]) -> Any:
    for row in rows:
        if row.shape == HEADLINE_SHAPE:
            return row
    return max(rows, key=lambda row: row.block_bytes)


def report(cpu: list[CpuRow], disk: list[DiskRow], ttft: list[TTFTRow], args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"cpu": {}, "disk": {}, "ttft": [row._asdict() for row in ttft]}
    result["ttft_model"] = ttft_model(args)
    if cpu:
        head = _headline(cpu)
        result["cpu"] = {
            "spill_ratio": head.spill_ratio,
            "promote_ratio": head.promote_ratio,
            "shape": head.shape,
            "block_bytes": head.block_bytes,
            "rows": [row._asdict() for row in cpu],
        }
    if disk:
        dhead = _headline(disk)
        result["disk"] = {
            "write_ratio": dhead.write_ratio,
            "read_ratio": dhead.read_ratio,
            "shape": dhead.shape,
            "block_bytes": dhead.block_bytes,
            "io_mode": dhead.io_mode,
            "rows": [row._asdict() for row in disk],
        }
    result["targets"] = {"cpu": CPU_TARGETS, "disk": DISK_TARGETS}
    result["setup"] = {
        "total_mib": args.total_mib,
        "disk_total_mib": args.disk_total_mib,
        "batch_blocks": args.batch_blocks,
        "copy_threads": args.copy_threads,
        "io": args.io,
        "repeat": args.repeat,
        "settle_s": args.settle_s,
        "disk_fill": "fresh" if args.disk_fresh else "full (every write evicts a block)",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
    }
    return result


def plot(cpu: list[CpuRow], disk: list[DiskRow], ttft: list[TTFTRow], path: Path) -> None:
    """One panel per part measured (CPU tier, disk tier, TTFT), each series named in its legend."""
    plt = pyplot()
    bars: list[tuple[list[str], dict[str, list[float]], str]] = []
    if cpu:
        bars.append(
            (
                [f"{row.shape}\n{_mib(row.block_bytes)}" for row in cpu],
                {
                    "spill: TierLink.spill, pool -> arena": [row.spill_gbps for row in cpu],
                    "promote: TierLink.promote, arena -> pool": [row.promote_gbps for row in cpu],
                    "baseline: one memcpy, pool -> arena": [row.memcpy_spill_gbps for row in cpu],
                    "baseline: one memcpy, arena -> pool": [row.memcpy_promote_gbps for row in cpu],
                },
                "CPU tier vs memcpy of the same bytes",
            )
        )
    if disk:
        bars.append(
            (
                [f"{row.shape}\n{_mib(row.block_bytes)}" for row in disk],
                {
                    "write: DiskTier.write_many, arena -> slabs": [row.write_gbps for row in disk],
                    "read: DiskTier.read_many, slabs -> arena": [row.read_gbps for row in disk],
                    "baseline: one sequential file, write + fsync": [row.baseline_write_gbps for row in disk],
                    "baseline: one sequential file, read": [row.baseline_read_gbps for row in disk],
                },
                f"Disk tier vs one sequential file ({disk[0].io_mode.split(';')[0]})",
            )
        )
    panels = len(bars) + (1 if ttft else 0)
    if not panels:
        raise ConfigError("--plot: nothing was measured (all parts skipped)")
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.2), squeeze=False)
    for axis, (labels, series, title) in zip(axes[0], bars, strict=False):
        width = 0.8 / len(series)
        for index, (label, values) in enumerate(series.items()):
            axis.bar([x + index * width for x in range(len(labels))], values, width, label=label)
        axis.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels)
        axis.set_ylabel("GB/s (median of runs)")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=7, loc="upper left")
        axis.set_ylim(top=axis.get_ylim()[1] * 1.45)  # room for the legend above the bars
    if ttft:
        axis = axes[0][-1]
        lengths = [row.prompt_tokens for row in ttft]
        for label, values in (
            ("recompute (no cache)", [row.recompute_ms for row in ttft]),
            ("hit in the worker's pool", [row.gpu_hit_ms for row in ttft]),
            ("hit in the CPU tier (promoted)", [row.cpu_hit_ms for row in ttft]),
            ("hit on the disk tier (promoted)", [row.disk_hit_ms for row in ttft]),
        ):
            axis.plot(lengths, values, marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("prompt tokens")
        axis.set_ylabel("TTFT ms (log)")
        axis.set_title("TTFT: recompute vs a hit in each tier", fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def run(args: argparse.Namespace) -> int:
    for name in ("batch_blocks", "copy_threads", "io", "repeat"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.copy_threads > MAX_COPY_THREADS:
        raise ConfigError(f"--copy-threads must be <= {MAX_COPY_THREADS} (the caller and the copy kernel's helpers)")
    for name in ("total_mib", "disk_total_mib"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 (0 skips that part)")
    if not (math.isfinite(args.deadline_s) and args.deadline_s > 0):
        raise ConfigError(f"--deadline-s must be a number of seconds > 0, got {args.deadline_s}")
    if not (math.isfinite(args.settle_s) and args.settle_s >= 0):
        raise ConfigError(f"--settle-s must be a number of seconds >= 0, got {args.settle_s}")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    disk_shapes = [s.strip() for s in args.disk_shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes + disk_shapes) - set(SHAPES))
    if unknown:
        raise ConfigError(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if model_overrides(args):  # a model that cannot load fails now, not after the bandwidth runs
        describe_model(load_config(overrides=model_overrides(args)).worker, torch.device("cpu"))
    disk_root = Path(args.disk_dir).expanduser()
    try:
        disk_root.mkdir(parents=True, exist_ok=True)
        disk_dir = Path(tempfile.mkdtemp(prefix="offload-bench-", dir=disk_root))
    except OSError as exc:
        raise ConfigError(f"--disk-dir {disk_root}: {exc.strerror}") from None
    try:
        ttft_lengths = [int(x) for x in args.ttft_lengths.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--ttft-lengths must be comma-separated integers, got {args.ttft_lengths!r}") from None
    if any(length < 256 or length > 65536 for length in ttft_lengths):  # shorter ones stay in the pool
        raise ConfigError("--ttft-lengths: each prompt length must be in 256..65536 tokens")
    cpu_shapes = shapes if args.total_mib else []
    vias = ["local", *(["floor"] if args.floor else []), *(["ray"] if args.ray else [])]
    disk_shapes = disk_shapes if args.disk_total_mib else []
    steps = len(cpu_shapes) * len(vias) * 3 * (args.repeat + 1) + len(disk_shapes) * 3 * args.repeat + len(ttft_lengths)
    cpu_rows: list[CpuRow] = []
    disk_rows: list[DiskRow] = []
    ttft_rows: list[TTFTRow] = []
    owns_ray = False
    try:
        if "ray" in vias and cpu_shapes:
            from kvstore.deploy.launcher import start_ray

            owns_ray = start_ray(None)  # an embedded one on loopback, unless this process is connected already
        with tqdm(total=steps, desc="offload bench", unit="step", disable=args.no_progress) as progress:
            for name in cpu_shapes:
                for via in vias:
                    progress.set_postfix_str(f"cpu {name}{VIAS[via]}")
                    cpu_rows.append(measure_cpu(name, SHAPES[name], args, progress, via=via))
            for name in disk_shapes:
                progress.set_postfix_str(f"disk {name}")
                disk_rows.append(measure_disk(name, SHAPES[name], args, disk_dir, progress))
            for length in ttft_lengths:
                progress.set_postfix_str(f"ttft {length}")
                ttft_rows.extend(measure_ttft([length], seed=length, model=model_overrides(args)))
                progress.update(1)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        if owns_ray:
            import ray

            ray.shutdown()
    print_tables(cpu_rows, disk_rows, args, disk_root)
    print_ttft(ttft_rows, ttft_model(args))
    result = report(cpu_rows, disk_rows, ttft_rows, args)
    if cpu_rows:
        head = _headline(cpu_rows)
        print(
            f"\nheadline ({head.shape}): spill {head.spill_ratio:.2f}x memcpy (runs {_spread(head.spill_ratio_runs)}), "
            f"promote {head.promote_ratio:.2f}x (runs {_spread(head.promote_ratio_runs)}); "
            f"target >= {CPU_TARGETS.get(head.shape, float('nan')):.2f}"
        )
    if disk_rows:
        dhead = _headline(disk_rows)
        print(
            f"headline ({dhead.shape}): disk write {dhead.write_ratio:.2f}x O_DIRECT "
            f"(runs {_spread(dhead.write_ratio_runs)}), read {dhead.read_ratio:.2f}x "
            f"(runs {_spread(dhead.read_ratio_runs)}); target >= {DISK_TARGETS.get(dhead.shape, float('nan')):.2f}"
        )
    if args.json:
        write_output("--json", args.json, json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(cpu_rows, disk_rows, ttft_rows, Path(args.plot))
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("offload", help="CPU and disk tier GB/s vs memcpy and O_DIRECT baselines")
    known = ", ".join(f"{name} ({identity.block_bytes // 1024} KiB)" for name, identity in SHAPES.items())
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"CPU tier shapes, comma-separated: {known}")
    p.add_argument("--disk-shapes", default="qwen2.5-0.5b,llama-3-8b", help="disk tier shapes, comma-separated")
    p.add_argument("--total-mib", type=int, default=1024, help="bytes moved per CPU measurement (0 skips CPU)")
    p.add_argument("--disk-total-mib", type=int, default=1024, help="bytes per disk measurement (0 skips disk)")
    p.add_argument("--disk-dir", default="out/offload-bench", help="directory on the disk to measure (not tmpfs)")
    # A worker hands its tier one call per job: a store job carries every held block (up to 1,024), a
    # load a request's whole hit. 128 blocks is a 2,048-token prompt at block size 16; 77% of the
    # Mooncake conversation trace's requests are longer (median 6,909 tokens: 432 blocks).
    p.add_argument(
        "--batch-blocks",
        type=int,
        default=128,
        help="blocks per spill / promote call (a worker's job: 128 = 2k tokens)",
    )
    p.add_argument("--copy-threads", type=int, default=2, help="copy engine threads")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also time each part of a spill and a promotion (tier calls, copies): us per block",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also measure each CPU shape with the tier's bookkeeping taken away (a stand-in that only checks "
        "the metas and hands out slots in order): the most the link and its copies allow",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="also measure each CPU shape through the tier as a deployment runs it: a TierActor on an embedded "
        "local Ray, each reserve / acquire an actor round trip",
    )
    p.add_argument("--io", type=int, default=16, help="disk I/Os in flight")
    p.add_argument("--deadline-s", type=float, default=30.0, help="per-I/O deadline of the disk tier")
    p.add_argument(
        "--settle-s", type=float, default=1.5, help="sync, then idle this long before each measured disk pair"
    )
    p.add_argument(
        "--repeat", type=int, default=6, help="runs per measurement (even: disk runs alternate who goes first)"
    )
    p.add_argument(
        "--disk-fresh",
        action="store_true",
        help="write into an empty disk tier each run (default: into a full one, every write evicting a block)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    p.add_argument(
        "--ttft-lengths",
        default="1024,2048,4096,8192",
        help="prompt lengths for TTFT recompute vs GPU/CPU/disk hit, comma-separated ('' skips)",
    )
    # The TTFT rows' model: --model PATH (a checkpoint) or --shape NAME (a real architecture, random weights).
    add_model_arguments(p, shapes=True)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=benchmark_command(run))
