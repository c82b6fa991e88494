"""``kvstore bench router``: the router's prefix index -- ingest, end to end, lookups -- vs Dynamo.

The event streams are recorded from real block pools: the Mooncake
conversation trace is expanded into ``--block-size``-token blocks (derived
chain hashes, :mod:`kvstore.benchmarks.mooncake`), each conversation is pinned to one of
R replicas (by its first conversation-specific block, as a cache-aware
router would), and each replica is a real :class:`~kvstore.block_pool.BlockPool`
sized so that the replicas together hold ``--blocks`` blocks. Each request is
one batch of its pool's events (stores, and the evictions that made room),
so by the end the index holds about a million blocks and has churned through
more.

Measured, in one run:

- **ingest**: blocks/s applying the already-decoded batches into a fresh
  :class:`~kvstore.router.index.PrefixIndex` (stored + removed blocks / time);
- **end to end**: blocks/s from R real ZmqEventPublishers on 127.0.0.1 (in a
  child process, as producers are) through one
  :class:`~kvstore.subscriber.EventListener` into the index; baseline: the
  same stream into a listener whose sink only counts (ZMQ + msgspec decode);
- **lookup**: p50/p99 latency of 32-block queries -- runs of recorded
  prompts starting at a trace-block boundary, from the shared system prompt
  (every replica holds it) to conversation blocks (held by one replica, or
  evicted) -- on the index holding the whole stream, for R = 8 and 64; each
  query set is timed in 5 passes and the median pass reported; plus a worst
  case where every replica holds all 32 blocks;
- **Dynamo** (when ``ai-dynamo-runtime`` is installed): the same batches into
  ``dynamo._core.RadixTree`` (one ``apply_event`` per event, its JSON
  pre-encoded outside the timing) and the same queries through
  ``find_matches``; its per-replica scores are checked against ours.
- **scale** (``--scale-replicas``, 1,024 by default): the same two streams
  recorded over that many replicas, with each conversation served by a group
  of ``--scale-spread`` replicas (its turns rotating over the group, so a
  conversation's earlier turns end up cached on several replicas): the index's
  memory per (block, replica) entry and per distinct block (tracemalloc,
  :func:`measure_index_memory`), and lookup latency measured as above.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import statistics
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from kvstore.benchmarks.mooncake import (
    DEFAULT_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    TraceExpander,
    iter_trace,
    read_trace,
)
from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.block_pool import BlockPool
from kvstore.config import CacheConfig, EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventDecoder, EventEncoder
from kvstore.hashing import BlockHasher
from kvstore.publisher import ZmqEventPublisher
from kvstore.router.index import PrefixIndex
from kvstore.subscriber import EventListener

QUERY_BLOCKS = 32
E2E_MAX_REPLICAS = 256  # R publishers and R listener sockets (+ monitors) must fit ZeroMQ's 1,023 sockets per context


class Recording(NamedTuple):
    replicas: int
    batches: list[tuple[int, EventBatch]]  # (replica, batch) in publish order
    blocks: int  # stored + removed blocks over all batches
    queries: list[list[int]]  # 32-block prompt prefixes, external hashes
    pool_contents: list[set[int]]  # each pool's cached hashes at the end


def record(
    trace_path: str, limit: int | None, replicas: int, total_blocks: int, block_size: int, spread: int = 1
) -> Recording:
    """Drive one pool per replica with the trace and keep its events, one batch per request.

    A conversation (its first conversation-specific trace block) is pinned to
    replica ``anchor % replicas``; with ``spread`` > 1 it is served by that
    replica and the next ``spread - 1``, its turns taking them in turn, so the
    blocks of its earlier turns are cached on up to ``spread`` replicas.
    """
    expander = TraceExpander(BlockHasher("sha256_cbor", "kvstore", block_size), "derived")
    pools = [BlockPool(max(1, total_blocks // replicas), block_size=block_size) for _ in range(replicas)]
    batches: list[tuple[int, EventBatch]] = []
    queries: list[list[int]] = []
    blocks = 0
    turns: dict[int, int] = {}
    for request in read_trace(trace_path, limit):
        expanded = expander.expand(request)
        anchor = request.hash_ids[1] if len(request.hash_ids) > 1 else request.hash_ids[0]
        turn = turns.get(anchor, 0)
        turns[anchor] = turn + 1
        replica = (anchor + turn % spread) % replicas
        pool = pools[replica]
        hits = []
        for digest in expanded.digests:
            block = pool.get_cached_block(digest)
            if block is None:
                break
            hits.append(block)
        wanted = min(len(expanded.digests), pool.num_blocks)
        pool.touch(hits)
        new = pool.get_new_blocks(max(0, wanted - len(hits)))
        allocated = hits + new
        pool.cache_full_blocks(allocated, expanded.digests, len(hits), wanted, expanded.token_ids)
        pool.free_blocks(reversed(allocated))
        events = pool.take_events()
        blocks += sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))
        batches.append((replica, EventBatch(request.timestamp_ms / 1000.0, events)))
        if len(expanded.external) >= QUERY_BLOCKS:
            queries.append(expanded.external[:QUERY_BLOCKS])  # the prompt's first 32 blocks
    contents: list[set[int]] = [
        {b.external_hash for b in pool.cached_blocks() if b.external_hash is not None} for pool in pools
    ]
    return Recording(replicas, batches, blocks, queries, contents)


def producer_names(replicas: int) -> list[str]:
    return [f"replica-{i}" for i in range(replicas)]


def fresh_index(replicas: int) -> PrefixIndex:
    index = PrefixIndex(CacheConfig())
    for name in producer_names(replicas):
        index.add_producer(name, "gpu", [name], node=name)
    return index


def check_index(index: PrefixIndex, recording: Recording) -> None:
    """The index holds exactly what the pools hold (distinct hashes per replica)."""
    stats = index.stats()
    for name, contents in zip(producer_names(recording.replicas), recording.pool_contents, strict=True):
        held = stats.per_producer[name].held_blocks
        if held != len(contents):
            raise RuntimeError(f"{name}: index holds {held} blocks, its pool {len(contents)}")


# ------------------------------------------------------------------ ingest


class Rate(NamedTuple):
    wall: float  # blocks per second of wall-clock time
    cpu: float  # blocks per second of this process's CPU time (robust to other load on the machine)


def measure_ingest(recording: Recording, repeat: int) -> tuple[Rate, PrefixIndex]:
    """Median over ``repeat`` fresh indexes of applying the whole recording."""
    names = producer_names(recording.replicas)
    walls, cpus = [], []
    index = fresh_index(recording.replicas)
    for _ in range(repeat):
        index = fresh_index(recording.replicas)
        apply = index.apply_batch
        wall, cpu = time.perf_counter(), time.process_time()
        for seq, (replica, batch) in enumerate(recording.batches):
            apply(names[replica], seq, batch)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    check_index(index, recording)
    return Rate(recording.blocks / statistics.median(walls), recording.blocks / statistics.median(cpus)), index


# ------------------------------------------------------------------ memory


def measure_index_memory(recording: Recording) -> tuple[int, PrefixIndex]:
    """Bytes a fresh index keeps allocated once it has applied the whole recording (tracemalloc).

    The batches are msgpack-encoded beforehand and decoded one at a time
    inside the measurement, as the listener delivers them, so the hash ints
    the index keeps are its own allocations rather than the recording's, and
    each decoded batch is garbage once applied. What is still allocated at the
    end (after a collection), minus what was before the index was created, is
    the index: its registry of producers, the per-medium block dicts, hash
    ints and replica masks. tracemalloc counts the bytes requested from
    Python's allocators: pymalloc's rounding to 8-byte size classes and its
    arena slack are not included (RSS is somewhat higher).
    """
    encoder, decoder = EventEncoder(), EventDecoder()
    payloads = [(replica, encoder.encode(batch)) for replica, batch in recording.batches]
    names = producer_names(recording.replicas)
    started_here = not tracemalloc.is_tracing()
    gc.collect()
    if started_here:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = fresh_index(recording.replicas)
        apply, decode = index.apply_batch, decoder.decode
        for seq, (replica, payload) in enumerate(payloads):
            apply(names[replica], seq, decode(payload).batch)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        if started_here:
            tracemalloc.stop()
    check_index(index, recording)
    return retained, index


def holders_per_block(recording: Recording) -> Counter[int]:
    """How many blocks are held by 1, 2, ... replicas at the end of the recording."""
    holders: Counter[int] = Counter()
    for contents in recording.pool_contents:
        holders.update(contents)
    return Counter(holders.values())


# ------------------------------------------------------------------ lookups


class Latency(NamedTuple):
    p50_us: float
    p99_us: float
    mean_us: float


class Timing(NamedTuple):
    wall: Latency  # what a caller waits
    cpu: Latency  # the calling thread's CPU time: what is left once other load on the machine is taken out


def measure_lookups(
    lookups: dict[str, Callable[[list[int]], object]], queries: list[list[int]], passes: int = 5
) -> dict[str, Timing]:
    """Latency of each query under each lookup, interleaved so that both see the same machine.

    Per pass, per query, each lookup is timed in turn (alternating which goes
    first); the median pass is reported, so one disturbed pass does not set
    p99. The CPU clock counts the calling thread only (a lookup that hands
    work to another thread, like Dynamo's, looks cheaper on it than it is).
    """
    for lookup in lookups.values():
        for query in queries[:200]:
            lookup(query)  # warm caches and memos
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    order = list(lookups.items())
    passes_wall: dict[str, list[Latency]] = {name: [] for name in lookups}
    passes_cpu: dict[str, list[Latency]] = {name: [] for name in lookups}
    for _ in range(passes):
        wall: dict[str, list[int]] = {name: [] for name in lookups}
        cpu: dict[str, list[int]] = {name: [] for name in lookups}
        for i, query in enumerate(queries):
            for name, lookup in order if i % 2 else reversed(order):
                start_cpu = cpu_clock()
                start = wall_clock()
                lookup(query)
                wall[name].append(wall_clock() - start)
                cpu[name].append(cpu_clock() - start_cpu)
        for name in lookups:
            passes_wall[name].append(_latency(wall[name]))
            passes_cpu[name].append(_latency(cpu[name]))
    return {name: Timing(_median(passes_wall[name]), _median(passes_cpu[name])) for name in lookups}


def _latency(samples_ns: list[int]) -> Latency:
    samples = sorted(samples_ns)
    return Latency(
        samples[len(samples) // 2] / 1e3,
        samples[min(len(samples) - 1, int(0.99 * len(samples)))] / 1e3,
        statistics.fmean(samples) / 1e3,
    )


def _median(latencies: list[Latency]) -> Latency:
    return Latency(*(statistics.median(values) for values in zip(*latencies, strict=True)))


def worst_case_queries(index: PrefixIndex, replicas: int, count: int, rng: random.Random) -> list[list[int]]:
    """Prefixes every replica holds entirely: the largest possible lookup result."""
    queries = []
    for q in range(count):
        hashes = [rng.getrandbits(64) for _ in range(QUERY_BLOCKS)]
        event = BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
            lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        for name in producer_names(replicas):
            index.apply_batch(name, -1 - q, EventBatch(0.0, [event]))
        queries.append(hashes)
    return queries


# -------------------------------------------------------------- end to end


class CountingSink:
    """A BatchSink that only counts blocks: the transport's own cost."""

    def __init__(self) -> None:
        self.batches = 0

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        self.batches += 1

    def reset_producer(self, producer: str) -> None:
        return None


def _publish_process(conn: Connection, recording: Recording) -> None:
    """Child process: one real publisher per replica; publishes the whole recording on "go"."""
    config = EventsConfig(buffer_batches=1_000_000, queue_batches=1_000_000, hwm=1_000_000)
    publishers = [ZmqEventPublisher(config) for _ in range(recording.replicas)]
    conn.send([(p.endpoint, p.replay_endpoint) for p in publishers])
    assert conn.recv() == "go"
    for replica, batch in recording.batches:
        publishers[replica].publish(batch.events, ts=batch.ts)
    for publisher in publishers:
        publisher.flush(timeout=300.0)
    conn.send("sent")
    assert conn.recv() == "stop"
    for publisher in publishers:
        publisher.close()


def measure_end_to_end(recording: Recording) -> tuple[Rate, Rate]:
    """Into the index, and into a counting sink, each through fresh real publishers.

    The CPU rate divides by the router process's CPU time (the listener's
    receiving, decoding and applying), not the publishers'.
    """
    index = fresh_index(recording.replicas)
    rate = _one_round(recording, index, lambda: sum(s.batches for s in index.stats().per_producer.values()))
    check_index(index, recording)
    sink = CountingSink()
    baseline = _one_round(recording, sink, lambda: sink.batches)
    return rate, baseline


def _one_round(recording: Recording, sink: PrefixIndex | CountingSink, applied: Callable[[], int]) -> Rate:
    ctx = multiprocessing.get_context("fork")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_publish_process, args=(child, recording), daemon=True)
    process.start()
    listener = EventListener(sink, sync_timeout_s=30.0)
    try:
        for name, (endpoint, replay) in zip(producer_names(recording.replicas), conn.recv(), strict=True):
            listener.add_producer(name, endpoint, replay)
        listener.start()
        time.sleep(1.0)  # the subscriptions must reach the publishers before the first batch
        start, start_cpu = time.perf_counter(), time.process_time()
        conn.send("go")
        deadline = start + 300.0
        total = len(recording.batches)
        while applied() < total:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"end to end: only {applied()} of {total} batches arrived in 300 s")
            time.sleep(0.002)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        assert conn.recv() == "sent"
        conn.send("stop")
        troubled = [h for h in listener.health() if h.gaps or h.lossy or h.decode_errors]
        if troubled:
            raise RuntimeError(f"end to end: the stream was not clean: {troubled}")
    finally:
        listener.close()
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    return Rate(recording.blocks / elapsed, recording.blocks / cpu)


# ------------------------------------------------------------------- Dynamo


def load_dynamo() -> Any | None:
    """``dynamo._core.RadixTree`` if ai-dynamo-runtime is installed, else None."""
    os.environ.setdefault("DYN_LOG", "error")  # it logs every missed removal otherwise
    try:
        from dynamo._core import RadixTree
    except ImportError:
        return None
    return RadixTree


def dynamo_events(recording: Recording) -> list[tuple[int, bytes | None]]:
    """Dynamo's KvCacheEvent JSON per event (None: clear that worker), encoded ahead of timing."""
    out: list[tuple[int, bytes | None]] = []
    event_id = 0
    for replica, batch in recording.batches:
        for event in batch.events:
            event_id += 1
            if isinstance(event, BlockStored):
                blocks = [{"block_hash": h, "tokens_hash": h} for h in event.block_hashes]
                data: dict[str, Any] = {"stored": {"parent_hash": event.parent_block_hash, "blocks": blocks}}
            elif isinstance(event, BlockRemoved):
                data = {"removed": {"block_hashes": event.block_hashes}}
            else:
                out.append((replica, None))
                continue
            out.append((replica, json.dumps({"event_id": event_id, "data": data}).encode()))
    return out


def measure_dynamo(
    radix_tree_class: Any, recording: Recording, events: list[tuple[int, bytes | None]]
) -> tuple[Rate, Any, int]:
    """Apply the recording's events to a fresh RadixTree (its worker thread's CPU time counts too)."""
    tree = radix_tree_class()
    apply, clear = tree.apply_event, tree.clear_all_blocks
    failures = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for replica, payload in events:
        if payload is None:
            clear(replica)
            continue
        try:
            apply(replica, payload)
        except RuntimeError:
            failures += 1  # it refuses a store whose parent it lost, and a removal it never saw
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Rate(recording.blocks / wall, recording.blocks / cpu), tree, failures


def _scores_of(tree: Any) -> Callable[[list[int]], object]:
    """Dynamo's lookup with its per-worker scores materialised, as ours returns per-replica counts."""
    return lambda query: tree.find_matches(query).scores


def agreement(index: PrefixIndex, tree: Any, queries: list[list[int]], replicas: int) -> float:
    """Fraction of queries where Dynamo's per-worker scores equal our per-replica prefix lengths."""
    names = producer_names(replicas)
    same = 0
    for query in queries:
        ours = {names.index(name): counts.total for name, counts in index.lookup(query).items()}
        theirs = {worker: score for (worker, _), score in tree.find_matches(query).scores.items() if score}
        same += ours == theirs
    return same / len(queries) if queries else 1.0


# --------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    try:
        replica_counts = sorted({int(r) for r in str(args.replicas).split(",") if r.strip()})
    except ValueError:
        replica_counts = []
    if not replica_counts or min(replica_counts) < 1:
        raise ConfigError(f"--replicas must list positive counts, e.g. 8,64; got {args.replicas!r}")
    for flag in ("block_size", "lookup_block_size"):
        size = getattr(args, flag)
        if size < 1 or MOONCAKE_BLOCK_TOKENS % size:
            raise ConfigError(f"--{flag.replace('_', '-')} must divide {MOONCAKE_BLOCK_TOKENS}")
    if args.blocks < 1 or args.repeat < 1 or args.queries < 1 or (args.limit is not None and args.limit < 1):
        raise ConfigError("--blocks, --repeat, --queries and --limit must be >= 1")
    if args.scale_replicas < 0 or args.scale_spread < 1:
        raise ConfigError("--scale-replicas must be >= 0 (0 skips the scale run) and --scale-spread >= 1")
    _check_lookups(args.trace, args.lookup_limit, args.lookup_block_size)
    rng = random.Random(0)
    radix_tree = None if args.no_dynamo else load_dynamo()
    report: dict[str, Any] = {
        "block_size": args.block_size,
        "lookup_block_size": args.lookup_block_size,
        "target_blocks": args.blocks,
        "per_replicas": {},
        "e2e_skipped": None,
    }
    for replicas in replica_counts:
        result: dict[str, Any] = {}
        dynamo: dict[str, Any] = {}
        # 1. The event stream at vLLM's block size: ingest, end to end, Dynamo's ingest.
        started = time.perf_counter()
        stream = record(args.trace, args.limit, replicas, args.blocks, args.block_size)
        result["record_s"] = time.perf_counter() - started
        ingest, index = measure_ingest(stream, args.repeat)
        result.update(
            batches=len(stream.batches),
            blocks=stream.blocks,
            ingest_blocks_per_s=ingest.wall,
            ingest_blocks_per_cpu_s=ingest.cpu,
        )
        result["ingest_index_nodes"] = len(index)
        del index
        if replicas == min(replica_counts) and not args.no_e2e and replicas > E2E_MAX_REPLICAS:
            report["e2e_skipped"] = f"{replicas} publishers: more sockets than one ZeroMQ context allows"
        elif replicas == min(replica_counts) and not args.no_e2e:
            e2e, transport = measure_end_to_end(stream)
            result.update(
                e2e_blocks_per_s=e2e.wall,
                e2e_blocks_per_router_cpu_s=e2e.cpu,
                e2e_baseline_blocks_per_s=transport.wall,
                e2e_baseline_blocks_per_router_cpu_s=transport.cpu,
            )
        if radix_tree is not None:
            rate, tree, dynamo["rejected_events"] = measure_dynamo(radix_tree, stream, dynamo_events(stream))
            dynamo.update(ingest_blocks_per_s=rate.wall, ingest_blocks_per_cpu_s=rate.cpu)
            del tree
        del stream
        # 2. Lookups: prompts' first 32 blocks, on an index of the whole trace at a larger block size.
        lookup_result, lookup_dynamo = measure_lookup_index(args, replicas, 1, rng, radix_tree)
        result.update(lookup_result)
        if lookup_dynamo is not None:
            dynamo.update(lookup_dynamo)
            result["dynamo"] = dynamo
        report["per_replicas"][str(replicas)] = result
    report["scale"] = measure_scale(args, rng, radix_tree) if args.scale_replicas else None
    _summarise(report, radix_tree is not None)
    _print(report)
    if args.json:
        write_output("--json", args.json, json.dumps(report, indent=2) + "\n")
    return 0


def _check_lookups(trace: str, limit: int | None, block_size: int) -> None:
    """Raise ConfigError, before any work, unless some prompt of the trace gives a lookup to time (one
    of :data:`QUERY_BLOCKS` full blocks), naming the trace and the flags that decide it."""
    requests = 0
    for request in iter_trace(trace, limit):
        requests += 1
        if request.input_length // block_size >= QUERY_BLOCKS:
            return
    if not requests:
        raise ConfigError(f"trace {trace} holds no requests")
    raise ConfigError(
        f"no prompt of the {requests} requests of {trace} fills {QUERY_BLOCKS} blocks of --lookup-block-size "
        f"{block_size} tokens, so there is no lookup to time; use a trace with longer prompts (or more of "
        "them: --lookup-limit) or a smaller --lookup-block-size"
    )


def measure_lookup_index(
    args: argparse.Namespace, replicas: int, spread: int, rng: random.Random, radix_tree: Any | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Lookup latency (ours, and Dynamo's when given) on an index of the whole trace at the lookup block size.

    Returns our numbers and Dynamo's (None without Dynamo).
    """
    lookups = record(args.trace, args.lookup_limit, replicas, args.blocks, args.lookup_block_size, spread)
    index = fresh_index(replicas)
    names = producer_names(replicas)
    for seq, (replica, batch) in enumerate(lookups.batches):
        index.apply_batch(names[replica], seq, batch)
    check_index(index, lookups)
    stats = index.stats()
    queries = rng.sample(lookups.queries, min(args.queries, len(lookups.queries)))
    contenders: dict[str, Callable[[list[int]], object]] = {"ours": index.lookup}
    tree = None
    if radix_tree is not None:
        _, tree, _ = measure_dynamo(radix_tree, lookups, dynamo_events(lookups))
        contenders["dynamo"] = _scores_of(tree)
    timings = measure_lookups(contenders, queries)
    ours = timings["ours"]
    result: dict[str, Any] = {
        "index_nodes": stats.nodes,
        "index_entries": stats.entries,
        "lookup_p50_us": ours.wall.p50_us,
        "lookup_p99_us": ours.wall.p99_us,
        "lookup_mean_us": ours.wall.mean_us,
        "lookup_cpu_p50_us": ours.cpu.p50_us,
        "lookup_cpu_p99_us": ours.cpu.p99_us,
        "lookup_mean_matching_replicas": statistics.fmean(len(index.lookup(q)) for q in queries),
    }
    dynamo = None
    if tree is not None:
        theirs = timings["dynamo"]
        dynamo = {
            "lookup_p50_us": theirs.wall.p50_us,
            "lookup_p99_us": theirs.wall.p99_us,
            "agreement": agreement(index, tree, queries[:500], replicas),
        }
        del tree
    worst = measure_lookups({"ours": index.lookup}, worst_case_queries(index, replicas, 500, rng))["ours"]
    result.update(
        lookup_worst_case_p50_us=worst.wall.p50_us,
        lookup_worst_case_p99_us=worst.wall.p99_us,
        lookup_worst_case_cpu_p99_us=worst.cpu.p99_us,
    )
    return result, dynamo


def measure_scale(args: argparse.Namespace, rng: random.Random, radix_tree: Any | None) -> dict[str, Any]:
    """Index memory and lookups at ``--scale-replicas``, conversations spread over ``--scale-spread`` replicas."""
    replicas = args.scale_replicas
    spread = min(args.scale_spread, replicas)
    started = time.perf_counter()
    stream = record(args.trace, args.limit, replicas, args.blocks, args.block_size, spread)
    index_bytes, index = measure_index_memory(stream)
    stats = index.stats()
    holders = holders_per_block(stream)
    del index, stream
    scale: dict[str, Any] = {
        "replicas": replicas,
        "spread": spread,
        "memory_method": "tracemalloc",
        "index_bytes": index_bytes,
        "index_bytes_per_entry": index_bytes / stats.entries if stats.entries else None,
        "index_bytes_per_block": index_bytes / stats.nodes if stats.nodes else None,
        "entries": stats.entries,
        "blocks": stats.nodes,
        "blocks_held_by_several": sum(count for held, count in holders.items() if held > 1),
        "max_holders": max(holders, default=0),
    }
    lookup_result, lookup_dynamo = measure_lookup_index(args, replicas, spread, rng, radix_tree)
    lookup_result["lookup_index_nodes"] = lookup_result.pop("index_nodes")  # not the memory index above
    lookup_result["lookup_index_entries"] = lookup_result.pop("index_entries")
    scale.update(lookup_result)
    scale["dynamo"] = lookup_dynamo
    scale["elapsed_s"] = time.perf_counter() - started
    return scale


def _summarise(report: dict[str, Any], with_dynamo: bool) -> None:
    """Top-level numbers: the least favourable over the replica counts measured."""
    runs = list(report["per_replicas"].values())
    report["ingest_blocks_per_s"] = min(r["ingest_blocks_per_s"] for r in runs)
    report["ingest_blocks_per_cpu_s"] = min(r["ingest_blocks_per_cpu_s"] for r in runs)
    e2e = [r for r in runs if "e2e_blocks_per_s" in r]
    report["e2e_blocks_per_s"] = e2e[0]["e2e_blocks_per_s"] if e2e else None
    report["e2e_baseline_blocks_per_s"] = e2e[0]["e2e_baseline_blocks_per_s"] if e2e else None
    report["e2e_blocks_per_router_cpu_s"] = e2e[0]["e2e_blocks_per_router_cpu_s"] if e2e else None
    report["lookup_p50_us"] = max(r["lookup_p50_us"] for r in runs)
    report["lookup_p99_us"] = max(r["lookup_p99_us"] for r in runs)
    report["lookup_cpu_p99_us"] = max(r["lookup_cpu_p99_us"] for r in runs)
    report["dynamo"] = None
    if with_dynamo:
        report["dynamo"] = {
            "ingest_blocks_per_s": min(r["dynamo"]["ingest_blocks_per_s"] for r in runs),
            "ingest_blocks_per_cpu_s": min(r["dynamo"]["ingest_blocks_per_cpu_s"] for r in runs),
            "lookup_p50_us": max(r["dynamo"]["lookup_p50_us"] for r in runs),
            "lookup_p99_us": max(r["dynamo"]["lookup_p99_us"] for r in runs),
        }
        report["ingest_ratio_vs_dynamo"] = report["ingest_blocks_per_s"] / report["dynamo"]["ingest_blocks_per_s"]
        report["lookup_p99_ratio_dynamo_over_ours"] = report["dynamo"]["lookup_p99_us"] / report["lookup_p99_us"]


def _print(report: dict[str, Any]) -> None:
    print(
        f"router index benchmark: ~{report['target_blocks']:,} blocks held; stream of {report['block_size']}-token "
        f"blocks (ingest), lookups on {report['lookup_block_size']}-token blocks (32-block prompt prefixes)"
    )
    header = f"{'replicas':>8}{'nodes':>11}{'ingest blk/s':>14}{'(per CPU s)':>13}{'p50 us':>8}{'p99 us':>8}"
    print(header + f"{'cpu p99':>8}{'worst p99':>10}{'dynamo blk/s':>14}{'(per CPU s)':>13}{'dyn p99':>8}")
    for replicas, r in report["per_replicas"].items():
        dyn = r.get("dynamo")
        dynamo_cols = f"{'-':>14}{'-':>13}{'-':>8}"
        if dyn:
            dynamo_cols = (
                f"{dyn['ingest_blocks_per_s']:>14,.0f}{dyn['ingest_blocks_per_cpu_s']:>13,.0f}"
                f"{dyn['lookup_p99_us']:>8.1f}"
            )
        print(
            f"{replicas:>8}{r['index_nodes']:>11,}{r['ingest_blocks_per_s']:>14,.0f}{r['ingest_blocks_per_cpu_s']:>13,.0f}"
            f"{r['lookup_p50_us']:>8.1f}{r['lookup_p99_us']:>8.1f}{r['lookup_cpu_p99_us']:>8.1f}"
            f"{r['lookup_worst_case_p99_us']:>10.1f}" + dynamo_cols
        )
    if report["e2e_blocks_per_s"] is not None:
        print(
            f"end to end (ZMQ publishers -> listener -> index): {report['e2e_blocks_per_s']:,.0f} blocks/s "
            f"({report['e2e_blocks_per_router_cpu_s']:,.0f} per router CPU s); "
            f"transport alone: {report['e2e_baseline_blocks_per_s']:,.0f} blocks/s"
        )
    elif report["e2e_skipped"]:
        print(f"end to end: not measured ({report['e2e_skipped']}; include a count <= {E2E_MAX_REPLICAS})")
    if report["dynamo"] is not None:
        print(
            f"vs Dynamo RadixTree: ingest {report['ingest_ratio_vs_dynamo']:.2f}x, "
            f"lookup p99 {report['lookup_p99_ratio_dynamo_over_ours']:.2f}x faster"
        )
    else:
        print("Dynamo: not measured (--no-dynamo, or ai-dynamo-runtime is not installed)")
    scale = report["scale"]
    if scale is not None:
        several = scale["blocks_held_by_several"] / scale["blocks"] if scale["blocks"] else 0.0
        print(
            f"scale, {scale['replicas']:,} replicas (conversations spread over {scale['spread']}): index of "
            f"{scale['blocks']:,} blocks, {scale['entries']:,} (block, replica) entries ({several:.0%} of blocks "
            f"on several replicas, up to {scale['max_holders']:,}): {scale['index_bytes'] / 2**20:,.1f} MiB, "
            f"{scale['index_bytes_per_entry']:.1f} B per entry, {scale['index_bytes_per_block']:.1f} B per block "
            f"({scale['memory_method']})"
        )
        dyn = scale["dynamo"]
        theirs = f"; Dynamo p50 / p99 {dyn['lookup_p50_us']:.1f} / {dyn['lookup_p99_us']:.1f} us" if dyn else ""
        print(
            f"scale, {scale['replicas']:,} replicas: lookup p50 / p99 {scale['lookup_p50_us']:.1f} / "
            f"{scale['lookup_p99_us']:.1f} us (cpu p99 {scale['lookup_cpu_p99_us']:.1f}; "
            f"{scale['lookup_mean_matching_replicas']:,.0f} replicas matched on average; "
            f"worst case p99 {scale['lookup_worst_case_p99_us']:.1f} us){theirs}"
        )


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("router", help="prefix index ingest, end-to-end and lookup speed (vs Dynamo's RadixTree)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, default=3000, help="requests taken from the trace")
    p.add_argument(
        "--replicas",
        default="8,64",
        help="comma-separated replica counts, e.g. 8,64,1024 (default 8,64; end to end runs at the smallest, <= 256)",
    )
    p.add_argument("--blocks", type=int, default=1_100_000, help="blocks the replicas' pools hold together")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM's default)")
    p.add_argument("--repeat", type=int, default=3, help="ingest runs; the median is reported")
    p.add_argument("--queries", type=int, default=2000, help="lookups per pass (5 passes) per replica count")
    p.add_argument(
        "--lookup-block-size",
        type=int,
        default=64,
        help="block size of the lookup index: 32-block prompt prefixes then span 4 trace blocks (default 64)",
    )
    p.add_argument("--lookup-limit", type=int, default=None, help="requests for the lookup index (default: all)")
    p.add_argument("--no-e2e", action="store_true", help="skip the ZeroMQ end-to-end measurement")
    p.add_argument(
        "--scale-replicas",
        type=int,
        default=1024,
        help="index memory per entry and lookups at this many replicas (default 1024; 0 skips)",
    )
    p.add_argument(
        "--scale-spread",
        type=int,
        default=4,
        help="in the scale run, replicas each conversation's turns rotate over (default 4)",
    )
    p.add_argument("--no-dynamo", action="store_true", help="skip Dynamo even if installed")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
