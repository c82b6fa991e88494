"""``kvstore bench ttft``: time to first token by prompt length, recompute vs a GPU-pool prefix hit.

One :class:`kvstore.workers.worker.KVWorker` (no Ray), one request at a time, one
output token each, so TTFT is the prefill. For each prompt length L:

- **recompute** (the baseline): a fresh random prompt of L tokens, nothing
  cached -- the model prefills all L tokens;
- **hit**: a prompt of the same length L sharing its first ``L - suffix``
  tokens with the prompt just computed, so the worker's pool serves that
  prefix (block-aligned) and only the rest is prefilled.

Each is the median of ``--repeats`` runs after one warm-up. The ratio
``recompute / hit`` is the TTFT a prefix hit saves; ``prefill tok/s`` is
L / recompute TTFT, the model's prefill throughput on this machine.

The benchmark model is bigger than the test default (see ``BENCH_MODEL``);
``--config``/``--set`` change it (``--set worker.num_layers=8``). ``--model
PATH`` measures a Hugging Face checkpoint instead, and ``--shape NAME`` a
real architecture with random weights (``--shape qwen2.5-0.5b``: nothing
downloaded; ``--set worker.dtype=float32`` to override its bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
from typing import Any, NamedTuple

import msgspec
import torch

from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.deploy.config import Config, load_config
from kvstore.deploy.model_args import add_model_arguments, model_overrides
from kvstore.errors import ConfigError
from kvstore.worker_api import GenerateRequest
from kvstore.workers.device import resolve_device
from kvstore.workers.model_source import describe_model
from kvstore.workers.worker import KVWorker

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096)
BENCH_MODEL = (
    "worker.num_layers=4",
    "worker.hidden_size=512",
    "worker.num_heads=8",
    "worker.num_kv_heads=2",
    "worker.head_dim=64",
    "worker.vocab_size=4096",
)


class Row(NamedTuple):
    prompt_tokens: int
    cached_tokens: int  # of the hit request
    ttft_recompute_s: float
    ttft_hit_s: float

    @property
    def speedup(self) -> float:
        return self.ttft_recompute_s / self.ttft_hit_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_recompute_s


def bench_config(args: argparse.Namespace) -> Config:
    """Benchmark defaults sized to the lengths, under the user's --config, KVSTORE_* variables and --set."""
    longest = max(args.lengths)
    blocks_per_prompt = -(-(longest + 1) // 16)
    sizing = (
        f"worker.max_context={longest + 1}",
        f"worker.max_num_batched_tokens={longest}",
        f"pool.num_blocks={4 * blocks_per_prompt + 64}",
    )
    overrides = (*BENCH_MODEL, *model_overrides(args), *sizing, *args.set)
    config = load_config(args.config, overrides=overrides)
    served = describe_model(config.worker, resolve_device(config.worker.device))
    if served.max_context <= longest:
        raise ConfigError(f"{served.name}'s context ({served.max_context} tokens) must exceed the longest prompt "
                          f"({longest}); see worker.max_context")  # fmt: skip
    return config


def measure(worker: KVWorker, length: int, repeats: int, suffix: int, rng: random.Random) -> Row:
    vocab = worker.info().vocab_size
    recompute: list[float] = []
    hit: list[float] = []
    cached = 0
    for _ in range(repeats):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        miss = worker.generate(GenerateRequest(prompt, 1))
        assert miss.cached_tokens == 0, "a fresh random prompt hit the cache"
        recompute.append(miss.ttft_s)
        follow = prompt[: length - suffix] + [rng.randrange(vocab) for _ in range(suffix)]
        result = worker.generate(GenerateRequest(follow, 1))
        cached = result.cached_tokens
        hit.append(result.ttft_s)
    return Row(length, cached, statistics.median(recompute), statistics.median(hit))


def run(args: argparse.Namespace) -> int:
    if not args.lengths or min(args.lengths) < 2:
        raise ConfigError("--lengths must be prompt lengths >= 2, e.g. 256,512,1024")
    if args.repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    if not 1 <= args.suffix < min(args.lengths):
        raise ConfigError(f"--suffix must be between 1 and the shortest length - 1, got {args.suffix}")
    config = bench_config(args)
    worker = KVWorker("ttft-bench", config)
    served = worker.served
    rng = random.Random(args.seed)
    try:
        measure(worker, min(args.lengths), 1, args.suffix, rng)  # warm-up: first-call allocations, kernels
        rows = []
        for length in args.lengths:
            rows.append(measure(worker, length, args.repeats, args.suffix, rng))
            worker.check_invariants()
    finally:
        worker.shutdown()
    spec = served.spec
    print(
        f"TTFT benchmark on {worker.device} ({torch.get_num_threads()} torch threads): {served.name} "
        f"({spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads / "
        f"{spec.num_kv_heads} kv heads x {spec.head_dim}, vocab {spec.vocab_size}, {served.dtype}); "
        f"median of {args.repeats}"
    )
    header = f"{'prompt':>8}{'cached':>8}{'recompute ms':>14}{'hit ms':>10}{'recompute/hit':>15}{'prefill tok/s':>15}"
    print(header)
    for r in rows:
        print(
            f"{r.prompt_tokens:>8}{r.cached_tokens:>8}{r.ttft_recompute_s * 1e3:>14.1f}{r.ttft_hit_s * 1e3:>10.1f}"
            f"{r.speedup:>14.1f}x{r.prefill_tokens_per_s:>15,.0f}"
        )
    longest = rows[-1]
    print(
        f"longest prompt: a prefix hit cuts TTFT {longest.speedup:.1f}x "
        f"(recompute {longest.ttft_recompute_s * 1e3:.0f} ms -> hit {longest.ttft_hit_s * 1e3:.0f} ms); "
        f"prefill {longest.prefill_tokens_per_s:,.0f} tokens/s"
    )
    if args.json:
        report: dict[str, Any] = {
            "benchmark": "ttft",
            "baseline": "recompute (no prefix hit)",
            "device": str(worker.device),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "model": msgspec.to_builtins(served),
            "block_size": config.cache.block_size,
            "repeats": args.repeats,
            "suffix_tokens": args.suffix,
            "rows": [
                {**r._asdict(), "speedup": r.speedup, "prefill_tokens_per_s": r.prefill_tokens_per_s} for r in rows
            ],
            "hit_speedup_longest": longest.speedup,
            "prefill_tokens_per_s": longest.prefill_tokens_per_s,
        }
        write_output("--json", args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _lengths(text: str) -> list[int]:
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("ttft", help="TTFT by prompt length: recompute vs a prefix hit in the worker's pool")
    p.add_argument("--lengths", type=_lengths, default=list(DEFAULT_LENGTHS), help="prompt lengths, e.g. 256,1024")
    p.add_argument("--repeats", type=int, default=3, help="runs per length and case; the median is reported")
    p.add_argument("--suffix", type=int, default=16, help="tokens of the hit request that are not cached")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    add_model_arguments(p, shapes=True)
    p.add_argument("--config", default=None, help="TOML config (applied over the benchmark model)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
