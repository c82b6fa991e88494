"""``kvstore bench pool``: block operations per second on a recorded trace.

The trace is recorded from the Mooncake conversation trace: each request's
512-token hash ids are expanded into the ``block_size``-token blocks its prompt fills (chained
hashes, deterministic tokens), and requests overlap in a window of
``--concurrency`` (a request's blocks are freed ``concurrency`` requests
later). Per request the driver does what a scheduler does: walk the prefix
cache (lookup), touch the hits, allocate the rest (evicting LRU blocks), cache
the new full blocks, and later free everything tail first.

The same driver replays the same trace against our :class:`BlockPool` and a
straightforward baseline -- dict + OrderedDict bookkeeping keyed by block id,
emitting the same events -- measured in the same run. A *block operation* is
one block looked up, touched, allocated, cached or freed. Each pool is timed
as a serving process holds it: built, then frozen out of the garbage
collector's walks (``kvstore.heap``), so the figure does not depend on what
else this process happens to hold.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from kvstore.benchmarks.mooncake import DEFAULT_TRACE, MOONCAKE_BLOCK_TOKENS, iter_trace
from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.block_pool import BlockPool
from kvstore.errors import ConfigError
from kvstore.events import BlockRemoved, BlockStored, KVEvent
from kvstore.hashing import BlockHash, to_external
from kvstore.heap import freeze_startup_heap


class TraceRequest(NamedTuple):
    hashes: list[bytes]  # chained block hashes
    tokens: list[int]  # len(hashes) * block_size tokens


class PoolUnderTest(Protocol):
    def lookup(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int]) -> Any: ...
    def touch(self, blocks: list[Any]) -> None: ...
    def get_new_blocks(self, n: int) -> list[Any]: ...
    def cache(self, blocks: list[Any], hashes: list[bytes], num_cached: int, tokens: list[int]) -> None: ...
    def free(self, blocks: list[Any]) -> None: ...
    def num_free(self) -> int: ...
    def take_events(self) -> list[KVEvent]: ...


class OursAdapter:
    """Our pool, called exactly as KVCacheManager calls it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=block_size)
        self.block_size = block_size

    def lookup(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int]) -> Any:
        return self.pool.get_cached_block(
            BlockHash(block_hash), token_ids=token_ids, parent_hash=None if parent is None else BlockHash(parent)
        )

    def touch(self, blocks: list[Any]) -> None:
        self.pool.touch(blocks)

    def get_new_blocks(self, n: int) -> list[Any]:
        return self.pool.get_new_blocks(n)

    def cache(self, blocks: list[Any], hashes: list[bytes], num_cached: int, tokens: list[int]) -> None:
        self.pool.cache_full_blocks(blocks, hashes, num_cached, len(blocks), tokens)  # type: ignore[arg-type]

    def free(self, blocks: list[Any]) -> None:
        self.pool.free_blocks(reversed(blocks))

    def num_free(self) -> int:
        return self.pool.num_free_blocks

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()


class BaselinePool:
    """The straightforward pool: per-block state in dicts keyed by block id, OrderedDict free list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref: dict[int, int] = dict.fromkeys(range(num_blocks), 0)
        self.hash_of: dict[int, bytes] = {}
        self.tokens_of: dict[int, tuple[int, ...]] = {}
        self.parent_of: dict[int, bytes | None] = {}
        self.cached: dict[bytes, set[int]] = {}
        self.free_list: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.events: list[KVEvent] = []

    def lookup(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int]) -> Any:
        ids = self.cached.get(block_hash)
        if not ids:
            return None
        block_id = next(iter(ids))
        if self.tokens_of[block_id] != tuple(token_ids) or self.parent_of[block_id] != parent:
            return None
        return block_id

    def touch(self, blocks: list[Any]) -> None:
        for block_id in blocks:
            if self.ref[block_id] == 0:
                del self.free_list[block_id]
            self.ref[block_id] += 1

    def get_new_blocks(self, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            block_id, _ = self.free_list.popitem(last=False)
            block_hash = self.hash_of.pop(block_id, None)
            if block_hash is not None:
                ids = self.cached[block_hash]
                ids.discard(block_id)
                if not ids:
                    del self.cached[block_hash]
                del self.tokens_of[block_id]
                del self.parent_of[block_id]
                self.events.append(BlockRemoved(block_hashes=[to_external(block_hash)], medium="GPU"))
            self.ref[block_id] = 1
            out.append(block_id)
        return out

    def cache(self, blocks: list[Any], hashes: list[bytes], num_cached: int, tokens: list[int]) -> None:
        size = self.block_size
        for index in range(num_cached, len(blocks)):
            block_id = blocks[index]
            self.hash_of[block_id] = hashes[index]
            self.tokens_of[block_id] = tuple(tokens[index * size : (index + 1) * size])
            self.parent_of[block_id] = hashes[index - 1] if index else None
            self.cached.setdefault(hashes[index], set()).add(block_id)
        if len(blocks) > num_cached:
            self.events.append(
                BlockStored(
                    block_hashes=[to_external(h) for h in hashes[num_cached : len(blocks)]],
                    parent_block_hash=to_external(hashes[num_cached - 1]) if num_cached else None,
                    token_ids=tokens[num_cached * size : len(blocks) * size],
                    block_size=size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            )

    def free(self, blocks: list[Any]) -> None:
        for block_id in reversed(blocks):
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                self.free_list[block_id] = None

    def num_free(self) -> int:
        return len(self.free_list)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events


def record_trace(path: Path, limit: int, block_size: int) -> list[TraceRequest]:
    """Expand Mooncake requests into chained ``block_size``-token blocks: the prompt's full blocks only, as
    the pool caches them. Raises ConfigError for a bad trace (naming the file and line) or an empty one."""
    per_id = MOONCAKE_BLOCK_TOKENS // block_size
    requests: list[TraceRequest] = []
    for request in iter_trace(path, limit):
        hashes: list[bytes] = []
        tokens: list[int] = []
        parent = b"kvstore-bench"
        for index in range(request.input_length // block_size):
            hash_id, sub = request.hash_ids[index // per_id], index % per_id
            parent = hashlib.sha256(parent + hash_id.to_bytes(8, "big") + sub.to_bytes(4, "big")).digest()
            hashes.append(parent)
            base = (hash_id * per_id + sub) * block_size
            tokens.extend(range(base, base + block_size))
        requests.append(TraceRequest(hashes, tokens))
    if not requests:
        raise ConfigError(f"trace {path} holds no requests")
    return requests


class ReplayCounts(NamedTuple):
    ops: int  # block operations
    hit_blocks: int  # blocks served from the prefix cache
    skipped: int  # requests that could not get enough blocks


def replay(pool: PoolUnderTest, trace: list[TraceRequest], concurrency: int, block_size: int) -> ReplayCounts:
    """Run the trace through one pool and count what it did."""
    active: list[list[Any]] = []
    ops = 0
    hit_blocks = 0
    skipped = 0
    for request in trace:
        hashes, tokens = request.hashes, request.tokens
        hits: list[Any] = []
        parent = None
        for index, block_hash in enumerate(hashes):
            block = pool.lookup(block_hash, parent, tokens[index * block_size : (index + 1) * block_size])
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        ops += len(hits) + 1
        hit_blocks += len(hits)
        need = len(hashes) - len(hits)
        while active and (pool.num_free() < need or len(active) >= concurrency):
            done = active.pop(0)
            pool.free(done)
            ops += len(done)
        if pool.num_free() < need:
            skipped += 1
            continue
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(need)
        pool.cache(blocks, hashes, len(hits), tokens)
        pool.take_events()
        ops += len(hits) + 2 * need
        active.append(blocks)
    for done in active:
        pool.free(done)
        ops += len(done)
    return ReplayCounts(ops, hit_blocks, skipped)


class Result(NamedTuple):
    counts: ReplayCounts
    seconds: float

    @property
    def ops(self) -> int:
        return self.counts.ops

    @property
    def skipped(self) -> int:
        return self.counts.skipped

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


def measure(factory: Any, trace: list[TraceRequest], args: argparse.Namespace) -> Result:
    times = []
    counts = ReplayCounts(0, 0, 0)
    for _ in range(args.repeat):
        pool = factory(args.num_blocks, args.block_size)
        # As a serving process runs its pool: everything built at start-up -- the pool included -- frozen out of
        # the collector's walks (kvstore.heap), so collections walk only what the replay allocates. Without it the
        # figure depends on what else the process imported: torch's heap alone made full collections rarer and
        # moved the ratio from 1.5x to 2.2x.
        freeze_startup_heap()
        try:
            start = time.perf_counter()
            counts = replay(pool, trace, args.concurrency, args.block_size)
            times.append(time.perf_counter() - start)
        finally:
            del pool
            gc.unfreeze()  # the pool's linked blocks are cycles: collectable again once it is gone
            gc.collect()
    return Result(counts, statistics.median(times))


def run(args: argparse.Namespace) -> int:
    for name in ("limit", "num_blocks", "block_size", "concurrency", "repeat"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if MOONCAKE_BLOCK_TOKENS % args.block_size:
        raise ConfigError(f"--block-size must divide {MOONCAKE_BLOCK_TOKENS}")
    trace = record_trace(Path(args.trace), args.limit, args.block_size)
    ours = measure(OursAdapter, trace, args)
    base = measure(BaselinePool, trace, args)
    if ours.counts != base.counts:
        raise RuntimeError(f"the pools disagree on the trace: ours {ours.counts}, baseline {base.counts}")
    ratio = ours.ops_per_s / base.ops_per_s
    print(
        f"pool benchmark: {len(trace)} requests, {ours.ops:,} block ops "
        f"({ours.counts.hit_blocks:,} prefix hits), {args.num_blocks} blocks x {args.block_size}"
    )
    print(f"{'pool':<28}{'block ops/s':>16}{'seconds':>10}{'skipped':>9}")
    print(f"{'kvstore BlockPool':<28}{ours.ops_per_s:>16,.0f}{ours.seconds:>10.3f}{ours.skipped:>9}")
    print(f"{'baseline dict+OrderedDict':<28}{base.ops_per_s:>16,.0f}{base.seconds:>10.3f}{base.skipped:>9}")
    print(f"ratio (ours / baseline): {ratio:.2f}x")
    if args.json:
        report = {
            "ops_per_s": ours.ops_per_s,
            "baseline_ops_per_s": base.ops_per_s,
            "ratio": ratio,
            "block_ops": ours.ops,
            "hit_blocks": ours.counts.hit_blocks,
            "requests": len(trace),
            "skipped": ours.skipped,
            "num_blocks": args.num_blocks,
            "block_size": args.block_size,
            "concurrency": args.concurrency,
        }
        write_output("--json", args.json, json.dumps(report, indent=2) + "\n")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("pool", help="block pool operations/s vs a dict+OrderedDict baseline")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, default=1500, help="requests taken from the trace")
    p.add_argument("--num-blocks", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="requests holding blocks at once")
    p.add_argument("--repeat", type=int, default=3, help="runs per pool; the median is reported")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
