"""``kvstore simulate``: the command line over :mod:`kvstore.benchmarks.simulate.engine`.

It lives in ``deploy`` because its defaults come from both sides: the
replicas' prefill throughput and decode rate are measured on the worker
model (:func:`kvstore.workers.throughput.measure_model_rates`), the routing is the
router's. ``--prefill-tps`` / ``--decode-tps`` skip the measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvstore.benchmarks.figures import pyplot, save_figure
from kvstore.benchmarks.mooncake import DEFAULT_TRACE, HASH_MODES, MOONCAKE_BLOCK_TOKENS, TraceExpander, read_trace
from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.benchmarks.simulate.engine import (
    DEFAULT_CAPACITY_TOKENS,
    DEFAULT_UTILIZATION,
    DEFAULT_WINDOW_S,
    MIN_WINDOW_S,
    POLICIES,
    PolicyResult,
    SimulationSettings,
    offered_prefill_tps,
    simulate_policy,
    speedup_for_utilization,
)
from kvstore.deploy.config import load_config
from kvstore.errors import ConfigError
from kvstore.hashing import BlockHasher


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError(f"--policies must name at least one of {', '.join(POLICIES)}")
    for policy in policies:
        if policy not in POLICIES:
            raise ConfigError(f"--policies: unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError("--limit must be >= 1")
    config = load_config(args.config, overrides=args.set)
    trace = read_trace(args.trace, args.limit)
    if not trace:
        raise ConfigError(f"trace {args.trace} holds no requests")
    prefill_tps, decode_tps, rates_from = args.prefill_tps, args.decode_tps, "flags"
    if prefill_tps is None or decode_tps is None:
        from kvstore.workers.throughput import measure_model_rates  # torch: only when measuring

        rates = measure_model_rates(config)
        rates_from = f"measured on the worker model ({rates.device}, {rates.prompt_tokens}-token prompt)"
        prefill_tps = rates.prefill_tps if prefill_tps is None else prefill_tps
        decode_tps = rates.decode_tps if decode_tps is None else decode_tps
    settings = SimulationSettings(
        replicas=args.replicas,
        capacity_tokens=args.capacity_tokens,
        block_tokens=args.block_tokens,
        prefill_tps=prefill_tps,
        decode_tps=decode_tps,
        step_tokens=config.worker.max_num_batched_tokens if args.step_tokens is None else args.step_tokens,
        speedup=1.0 if args.speedup is None else args.speedup,
        window_s=args.window_s,
        seed=args.seed,
    )
    settings.validate()  # every flag, before the speedup is derived from them
    speedup = args.speedup
    if speedup is None:
        speedup = speedup_for_utilization(trace, args.replicas, prefill_tps, args.utilization)
        settings = settings._replace(speedup=speedup)
    offered_tps = offered_prefill_tps(trace)
    offered = speedup * offered_tps / (settings.replicas * prefill_tps) if offered_tps else None
    hasher = BlockHasher(config.cache.hash_algo, config.cache.hash_seed, settings.block_tokens)
    expander = TraceExpander(hasher, args.hash)
    started = time.perf_counter()
    for request in trace:  # hash every block once, shared by all policies
        expander.expand(request, with_tokens=False)
    hashing_s = time.perf_counter() - started
    _print_header(settings, len(trace), rates_from, offered)
    results: dict[str, PolicyResult] = {}
    for policy in policies:
        results[policy] = simulate_policy(policy, trace, settings, expander, config.router)
        _print_row(policy, results[policy])
    _print_summary(results)
    if args.json:
        report: dict[str, Any] = {
            "trace": str(args.trace),
            "requests": len(trace),
            "hash_mode": args.hash,
            "hashing_s": hashing_s,
            **settings._asdict(),
            "rates_from": rates_from,
            "offered_utilization": offered,
            "router": msgspec.to_builtins(config.router),
            "policies": {name: result.as_json() for name, result in results.items()},
        }
        report.update(_ratios(results))
        write_output("--json", args.json, json.dumps(report, indent=2) + "\n")
    if args.plot:
        write_plot(
            results, args.plot, title=f"{len(trace)} requests, {settings.replicas} replicas, speedup {speedup:.3g}"
        )
    return 0


def _ratios(results: Mapping[str, PolicyResult]) -> dict[str, float]:
    ours = results.get("kvstore")
    if ours is None:
        return {}
    out: dict[str, float] = {}
    best = results.get("global_cache")
    if best is not None and best.hit_rate > 0:
        out["kvstore_hit_rate_vs_global_cache"] = ours.hit_rate / best.hit_rate
    for other in ("round_robin", "least_loaded", "dynamo"):
        if other in results and results[other].ttft(0.99) > 0:
            out[f"kvstore_ttft_p99_vs_{other}"] = ours.ttft(0.99) / results[other].ttft(0.99)
    return out


def _print_header(settings: SimulationSettings, requests: int, rates_from: str, offered: float | None) -> None:
    load = "n/a (the trace spans no time)" if offered is None else f"{offered:.0%} of capacity"
    print(
        f"routing simulation: {requests} requests, {settings.replicas} replicas x {settings.capacity_tokens:,} "
        f"tokens of cache, {settings.block_tokens}-token blocks\n"
        f"replica: prefill {settings.prefill_tps:,.0f} tokens/s, decode {settings.decode_tps:,.1f} tokens/s per "
        f"request ({rates_from}), {settings.step_tokens} tokens per step\n"
        f"speedup {settings.speedup:.4g}: offered prefill load (prompt tokens, none cached) = {load}"
    )
    print(
        f"{'policy':<14}{'hit rate':>9}{'saved tokens':>15}{'TTFT p50 s':>11}{'p90 s':>9}{'p99 s':>9}"
        f"{'max/mean':>9}{'win p99':>9}{'util':>7}{'seconds':>9}"
    )


def _print_row(name: str, r: PolicyResult) -> None:
    print(
        f"{name:<14}{r.hit_rate:>9.3f}{r.cached_tokens:>15,}{r.ttft(0.5):>11.2f}{r.ttft(0.9):>9.2f}"
        f"{r.ttft(0.99):>9.2f}{r.max_mean_load:>9.3f}{r.window_imbalance_p99:>9.2f}{r.utilization:>7.0%}"
        f"{r.wall_s:>9.1f}",
        flush=True,
    )


def _print_summary(results: Mapping[str, PolicyResult]) -> None:
    for key, value in _ratios(results).items():
        print(f"{key}: {value:.3f}")
    ours = results.get("kvstore")
    if ours is not None and ours.index_mismatches:
        print(f"warning: the index mispredicted {ours.index_mismatches} prefixes")


def write_plot(results: Mapping[str, PolicyResult], path: str | Path, *, title: str) -> None:
    """Two panels: TTFT CDF per policy (log time), and hit rate against window load imbalance p99."""
    plt = pyplot()
    fig, (cdf, scatter) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.5, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, result) in enumerate(results.items()):
        color = colors[i % len(colors)]
        xs = sorted(max(t, 1e-3) for t in result.ttfts_s)
        if xs:
            cdf.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", color=color, label=name)
        scatter.scatter(result.window_imbalance_p99, result.hit_rate, color=color, s=60, label=name)
        scatter.annotate(
            name,
            (result.window_imbalance_p99, result.hit_rate),
            fontsize="small",
            xytext=(5, 3),
            textcoords="offset points",
        )
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT, seconds (log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF per policy")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize="small", loc="lower right")
    scatter.set_xlabel("load imbalance per window, p99 (max/mean outstanding prefill)")
    scatter.set_ylabel("prefix hit rate")
    scatter.set_title("hit rate vs load imbalance (up and left is better)")
    scatter.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "simulate", help="replay a Mooncake trace over simulated replicas in simulated time, per routing policy"
    )
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument(
        "--capacity-tokens",
        type=int,
        default=DEFAULT_CAPACITY_TOKENS,
        help=f"KV cache per replica, in tokens (default {DEFAULT_CAPACITY_TOKENS:,})",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first K requests of the trace")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS, help="tokens per simulated block")
    p.add_argument(
        "--prefill-tps",
        type=float,
        default=None,
        help="prefill tokens/s per replica (default: measured on the worker model)",
    )
    p.add_argument(
        "--decode-tps",
        type=float,
        default=None,
        help="output tokens/s per request (default: measured on the worker model)",
    )
    p.add_argument(
        "--step-tokens", type=int, default=None, help="prefill tokens per step (default: worker.max_num_batched_tokens)"
    )
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--speedup", type=float, default=None, help="trace time / simulated time")
    timing.add_argument(
        "--utilization",
        type=float,
        default=DEFAULT_UTILIZATION,
        help="pick the speedup at which the uncached prompt tokens are this share of the "
        f"fleet's prefill capacity (default {DEFAULT_UTILIZATION})",
    )
    p.add_argument(
        "--window-s",
        type=float,
        default=DEFAULT_WINDOW_S,
        help=f"load-imbalance sampling period, simulated seconds, at least {MIN_WINDOW_S:g} "
        f"(default {DEFAULT_WINDOW_S:g})",
    )
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ", ".join(POLICIES))
    p.add_argument("--seed", type=int, default=0, help="seed of the tie-breaking and random policies")
    p.add_argument(
        "--hash",
        choices=HASH_MODES,
        default="tokens",
        help="block hashes: our BlockHasher over the expanded tokens, or a derived chain (faster)",
    )
    p.add_argument("--config", default=None, help="kvstore TOML config (router weights, worker model, hashing)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override (repeatable)"
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG here: TTFT CDF, hit rate vs load imbalance")
    p.set_defaults(func=benchmark_command(run))
