"""Serving mode of the offload benchmark: a decoding batch's step time with and without tier traffic.

One worker with its node's tier in process (a real TierStore behind a
LocalTierClient, the TierLink and TierOffload a Ray worker uses). A batch of
``--batch`` requests decodes for the whole run. Phases alternate, ``quiet``
and ``traffic`` (the order flips every repeat):

- quiet: the batch decodes alone;
- traffic: a driver thread also sends one request after another, each
  ``--doc-blocks`` full blocks plus one token and a single output token:
  every other one is a new document (its blocks are stored in the tier after
  it finishes: spill traffic), the others re-read an earlier document the
  small pool has evicted (its blocks are loaded from the tier: promote
  traffic).

Only *decode-only* steps are compared (the step computed exactly the
batch's ``--batch`` tokens; steps that also prefilled a traffic request are
counted apart), from the worker's own step log (``KVWorker.recent_steps``).
Reported, as medians over the phases:

- the step-time ratio, traffic / quiet;
- the blocked share: time the step loop spent inside the offloader over
  step time (the target is <= 1%: copies and tier calls run on the offload
  thread);
- what the ratio is made of: per phase, CPU seconds of the step-loop
  thread, of the offload thread and of every other thread (torch's
  intra-op pool, the copy engine, the tier's event loop), from
  ``/proc/self/task``: on a CPU-only machine the copies share the cores
  with the model.

``kvstore bench offload-serving`` (this module's :func:`add_cli`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.benchmarks.ttft_bench import BENCH_MODEL
from kvstore.deploy.config import Config, load_config
from kvstore.errors import ConfigError
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.link import TierLink
from kvstore.worker_api import GenerateRequest, SamplingParams
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker, StepRecord

BLOCK = 16
PROMPT = 2 * BLOCK  # the decoding requests' prompts
DOCS_IN_POOL = 2  # traffic documents the pool has room for besides the batch's final size


class Phase(NamedTuple):
    mode: str  # "quiet" or "traffic"
    decode_steps: int  # decode-only steps in the phase
    median_step_ms: float  # of the decode-only steps
    mixed_steps: int  # steps that also computed a traffic request's tokens
    step_s: float  # wall time of every step of the phase
    blocked_s: float  # of which inside the offloader (step-loop bookkeeping)
    decode_blocked_s: float  # the same, decode-only steps
    decode_step_s: float
    loaded_blocks: int
    stored_blocks: int
    wall_s: float
    cpu_s: dict[str, float]  # CPU seconds by thread group (see _groups)


def _pool_blocks(args: argparse.Namespace, max_tokens: int) -> int:
    per_request = -(-(PROMPT + max_tokens) // BLOCK) + 1
    return args.batch * per_request + DOCS_IN_POOL * (args.doc_blocks + 1) + 8


def _ring(args: argparse.Namespace, max_tokens: int) -> int:
    """Documents in the ring: more than fit in the pool at once, so each re-read was evicted."""
    return _pool_blocks(args, max_tokens) // (args.doc_blocks + 1) + 2


def _config(args: argparse.Namespace, max_tokens: int, disk_dir: str) -> Config:
    model = list(BENCH_MODEL) if args.model == "bench" else [f"worker.shape={args.model}"]
    doc = args.doc_blocks + 1
    blocks = _pool_blocks(args, max_tokens)
    block_bytes = cache_identity(load_config(overrides=[*model, f"cache.block_size={BLOCK}"])).block_bytes
    return load_config(
        overrides=[
            *model,
            f"cache.block_size={BLOCK}",
            f"pool.num_blocks={blocks}",
            "pool.watermark=0",
            "events.enabled=false",
            "worker.device=cpu",
            f"worker.max_context={PROMPT + max_tokens + 64}",
            f"worker.max_num_seqs={args.batch + 4}",
            f"tiers.cpu_capacity_bytes={(_ring(args, max_tokens) + 4) * doc * block_bytes}",
            "tiers.cpu_prefault=false",
            f"tiers.disk_dir={disk_dir}",
        ]
    )


def _groups(worker: KVWorker) -> dict[int, str]:
    """Native thread id -> its group: the step loop, the offload thread, the copy engine, the tier's event
    loop and disk I/O pool, the traffic driver, this benchmark's main thread (polling the step log). Of the
    threads that are no Python threads, the copy kernel's helpers name themselves ``kv-copy`` (read from
    /proc); the rest (torch's intra-op pool) are "torch"."""
    names = {
        "step loop": worker._thread.name,
        "offload thread": "kv-offload",
        "copy engine": "kv-copy",
        "tier loop": "kv-tier-loop",
        "tier disk I/O": "kv-disk",
        "bench main": "MainThread",
        "traffic driver": "traffic",
    }
    found = {}
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        for group, prefix in names.items():
            if thread.name.startswith(prefix):
                found[thread.native_id] = group
                break
        else:
            found[thread.native_id] = "other python"
    for tid in _native_copy_threads():
        found.setdefault(tid, "copy engine")
    return found


def _native_copy_threads() -> list[int]:
    """Native ids of this process's threads named ``kv-copy`` (the copy kernel's helpers); [] off Linux."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().startswith("kv-copy"):
                found.append(int(tid))
        except OSError:
            continue
    return found


def _thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process, by native id; {} off Linux."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


class Traffic:
    """Sends traffic requests one after another until stopped (see the module docstring).

    ``ring`` holds more documents than the pool has room for besides the
    batch, re-read oldest first, so each re-read finds its blocks evicted and
    loads them from the tier; after each re-read, a new document takes the
    ring slot (computed, then stored).
    """

    def __init__(self, worker: KVWorker, rng: random.Random, doc_blocks: int, ring: int, vocab: int) -> None:
        self._worker = worker
        self._rng = rng
        self._vocab = vocab
        self._size = doc_blocks * BLOCK
        self.ring = [self.new_doc() for _ in range(ring)]
        self.sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def new_doc(self) -> list[int]:
        return [self._rng.randrange(self._vocab) for _ in range(self._size)]

    def warm_up(self) -> None:
        for doc in self.ring:
            self._send(doc)

    def one(self) -> None:
        slot = (self.sent // 2) % len(self.ring)
        if self.sent % 2 == 1:
            self.ring[slot] = self.new_doc()
        self._send(self.ring[slot])
        self.sent += 1

    def _send(self, doc: list[int]) -> None:
        self._worker.generate(GenerateRequest([*doc, self._rng.randrange(self._vocab)], 1))

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.one()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=600)


def _counters(worker: KVWorker) -> tuple[int, int]:
    state = worker.offload_state()
    if state is None:
        return 0, 0
    return state.counters.blocks_loaded, state.counters.blocks_stored


def _phase(worker: KVWorker, mode: str, traffic: Traffic, args: argparse.Namespace) -> Phase:
    groups = _groups(worker)
    first = len(worker.recent_steps())
    loaded0, stored0 = _counters(worker)
    cpu0 = _thread_cpu()
    started = time.perf_counter()
    if mode == "traffic":
        traffic.start()
        groups.update(_groups(worker))
    deadline = time.monotonic() + args.phase_timeout_s
    while time.monotonic() < deadline:
        steps = worker.recent_steps()[first:]
        if sum(1 for s in steps if _decode_only(s, args.batch)) >= args.steps:
            break
        time.sleep(0.01)
    if mode == "traffic":
        traffic.stop()
    wall = time.perf_counter() - started
    cpu1 = _thread_cpu()
    steps = worker.recent_steps()[first:]
    loaded1, stored1 = _counters(worker)
    decode = [s for s in steps if _decode_only(s, args.batch)]
    groups.update(_groups(worker))
    cpu: dict[str, float] = {}
    for tid, seconds in cpu1.items():
        group = groups.get(tid, "torch")
        cpu[group] = cpu.get(group, 0.0) + seconds - cpu0.get(tid, 0.0)
    return Phase(
        mode=mode,
        decode_steps=len(decode),
        median_step_ms=statistics.median(s.seconds for s in decode) * 1e3 if decode else float("nan"),
        mixed_steps=len(steps) - len(decode),
        step_s=sum(s.seconds for s in steps),
        blocked_s=sum(s.offload_seconds for s in steps),
        decode_blocked_s=sum(s.offload_seconds for s in decode),
        decode_step_s=sum(s.seconds for s in decode),
        loaded_blocks=loaded1 - loaded0,
        stored_blocks=stored1 - stored0,
        wall_s=wall,
        cpu_s=cpu,
    )


def _decode_only(step: StepRecord, batch: int) -> bool:
    return step.requests == batch and step.tokens == batch


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the phases; returns the report (see the module docstring)."""
    rng = random.Random(args.seed)
    max_tokens = 2 * args.repeats * (args.steps + 40) + 64
    with tempfile.TemporaryDirectory(prefix="kvstore-serving-") as tmp:
        config = _config(args, max_tokens, tmp)
        identity = cache_identity(config)
        client = LocalTierClient(config.tiers, identity)
        offload = TierOffload(TierLink(client, identity))
        worker = KVWorker("serving", config, offload=offload)
        vocab = worker.info().vocab_size
        try:
            traffic = Traffic(worker, rng, args.doc_blocks, _ring(args, max_tokens), vocab)
            traffic.warm_up()  # every document computed once, and stored
            decode = SamplingParams(ignore_eos=True)  # they decode for the whole run, whatever they sample
            prompts = [[rng.randrange(vocab) for _ in range(PROMPT)] for _ in range(args.batch)]
            batch = [worker.submit(GenerateRequest(p, max_tokens, sampling=decode)) for p in prompts]
            while sum(1 for s in worker.recent_steps()[-4:] if _decode_only(s, args.batch)) < 4:
                time.sleep(0.01)  # every request of the batch is decoding
            phases: list[Phase] = []
            for repeat in range(args.repeats):
                order = ("quiet", "traffic") if repeat % 2 == 0 else ("traffic", "quiet")
                for mode in order:
                    phases.append(_phase(worker, mode, traffic, args))
            for stream in batch:
                stream.cancel()
            return report(phases, args, config)
        finally:
            worker.shutdown()
            offload.close()
            client.close()


def report(phases: list[Phase], args: argparse.Namespace, config: Config) -> dict[str, Any]:
    quiet = [p for p in phases if p.mode == "quiet"]
    busy = [p for p in phases if p.mode == "traffic"]
    q_ms = statistics.median(p.median_step_ms for p in quiet)
    t_ms = statistics.median(p.median_step_ms for p in busy)
    blocked = sum(p.blocked_s for p in busy) / max(1e-9, sum(p.step_s for p in busy))
    decode_blocked = sum(p.decode_blocked_s for p in busy) / max(1e-9, sum(p.decode_step_s for p in busy))

    groups = sorted({g for p in phases for g in p.cpu_s})

    def cores(group: list[Phase], name: str) -> float:
        """Median over the phases of the group's CPU seconds per wall second (cores busy)."""
        return statistics.median(p.cpu_s.get(name, 0.0) / p.wall_s for p in group)

    made_of = {name: {"quiet": cores(quiet, name), "traffic": cores(busy, name)} for name in groups}
    return {
        "model": args.model,
        "block_bytes": cache_identity(config).block_bytes,
        "batch": args.batch,
        "doc_blocks": args.doc_blocks,
        "quiet_step_ms": q_ms,
        "traffic_step_ms": t_ms,
        "step_time_ratio": t_ms / q_ms,
        "blocked_share": blocked,
        "decode_blocked_share": decode_blocked,
        "blocked_target": 0.01,
        "loaded_blocks_per_traffic_phase": statistics.median(p.loaded_blocks for p in busy),
        "stored_blocks_per_traffic_phase": statistics.median(p.stored_blocks for p in busy),
        "cores_busy_by_thread_group": made_of,
        "cores": os.cpu_count(),
        "phases": [p._asdict() for p in phases],
    }


def print_report(result: dict[str, Any]) -> None:
    print(
        f"\nserving mode: {result['model']} ({result['block_bytes'] // 1024} KiB blocks), a batch of "
        f"{result['batch']} decoding; traffic = {result['doc_blocks']}-block documents stored and loaded back"
    )
    print(f"{'phase':<8} {'decode steps':>12} {'median ms':>10} {'mixed':>6} {'blocked %':>9} "
          f"{'loaded':>7} {'stored':>7} {'wall s':>7}")  # fmt: skip
    for p in result["phases"]:
        share = 100 * p["blocked_s"] / max(1e-9, p["step_s"])
        print(
            f"{p['mode']:<8} {p['decode_steps']:>12} {p['median_step_ms']:>10.2f} {p['mixed_steps']:>6} "
            f"{share:>9.3f} {p['loaded_blocks']:>7} {p['stored_blocks']:>7} {p['wall_s']:>7.2f}"
        )
    print(
        f"decode step: quiet {result['quiet_step_ms']:.2f} ms, with traffic {result['traffic_step_ms']:.2f} ms: "
        f"ratio {result['step_time_ratio']:.3f} (median of phase medians)\n"
        f"blocked on offloading: {100 * result['blocked_share']:.3f}% of step time under traffic "
        f"(decode-only steps {100 * result['decode_blocked_share']:.3f}%; target <= 1%)\n"
        f"cores busy by thread group (CPU s per wall s, median of phases; {result['cores']} cores):"
    )
    print(f"  {'group':<16} {'quiet':>7} {'traffic':>8}")
    for name, busy in result["cores_busy_by_thread_group"].items():
        print(f"  {name:<16} {busy['quiet']:>7.3f} {busy['traffic']:>8.3f}")


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.steps < 1 or args.repeats < 1 or args.doc_blocks < 1:
        raise ConfigError("--batch, --steps, --repeats and --doc-blocks must be >= 1")
    if not (math.isfinite(args.phase_timeout_s) and args.phase_timeout_s > 0):
        raise ConfigError(f"--phase-timeout-s must be a number of seconds > 0, got {args.phase_timeout_s}")
    result = measure(args)
    print_report(result)
    if args.json:
        write_output("--json", args.json, json.dumps(result, indent=2) + "\n")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "offload-serving", help="a decoding batch's step time with and without tier spill/promote traffic"
    )
    p.add_argument("--model", default="qwen2.5-0.5b", help="'bench' (the TTFT benchmark's toy) or a worker.shape")
    p.add_argument("--batch", type=int, default=8, help="requests decoding throughout")
    p.add_argument("--doc-blocks", type=int, default=8, help="full blocks per traffic document")
    p.add_argument("--steps", type=int, default=24, help="decode-only steps measured per phase")
    p.add_argument("--repeats", type=int, default=3, help="quiet/traffic pairs (the order alternates)")
    p.add_argument("--phase-timeout-s", type=float, default=120.0, help="longest a phase may run")
    p.add_argument("--seed", type=int, default=0, help="prompts' seed")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
