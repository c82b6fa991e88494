"""``kvstore replay``: replay a request trace against a kvstore router and report what the cache did.

Two modes:

- ``--url URL``: load a running router (``kvstore serve``, ``kvstore
  router``) with a Mooncake trace slice or a synthetic shared-prefix
  workload (:mod:`kvstore.benchmarks.replay.workload`), on the trace's timestamps, a
  fixed rate, or a fixed concurrency (:mod:`kvstore.benchmarks.replay.client`);
- ``--compare``: start the service in this process three times and replay
  the same workload against cache-aware routing, round robin, and caching
  off (:mod:`kvstore.benchmarks.replay.compare`).

Either way it prints a table (:mod:`kvstore.benchmarks.replay.report` defines every
number), and optionally writes JSON (``--json``) and a PNG (``--plot``).
Every mistake a user can fix -- flags, URL, trace file, an unwritable
output path -- raises :class:`~kvstore.errors.ConfigError` before any
request is sent; the CLI prints it on one line and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from kvstore.benchmarks.mooncake import DEFAULT_TRACE
from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.benchmarks.replay.client import RunResult, Schedule, check_url, make_schedule, run_replay
from kvstore.benchmarks.replay.compare import BASE_OVERRIDES, RUNS, run_comparison, run_config
from kvstore.benchmarks.replay.plot import write_plot
from kvstore.benchmarks.replay.report import ReplayReport, format_table, summarize
from kvstore.benchmarks.replay.workload import ModelShape, Workload, mooncake_workload, synthetic_workload, trace_span_s
from kvstore.errors import ConfigError
from kvstore.workers.config import WorkerConfig

FORMATS = ("mooncake", "synthetic")
DEFAULT_BLOCK_TOKENS = 16
"""Replay tokens per Mooncake hash id (512 trace tokens): the cache's default block size, so one id is one block
and the trace's prompts (mean 12k tokens) fit the small model's 2,048-token context."""
DEFAULT_MAX_TOKENS = 32
DEFAULT_SYNTHETIC_REQUESTS = 200
DEFAULT_COMPARE_WORKERS = 2


def run(args: argparse.Namespace) -> int:
    """The command: validate everything, build the workload, replay, report. Returns the exit code."""
    _check_mode(args)
    shape = _model_shape(args)
    workload = build_workload(args, shape)
    has_timestamps = all(r.arrival_s is not None for r in workload.requests)
    schedule = make_schedule(
        rate=args.rate, concurrency=args.concurrency, speedup=args.speedup, has_timestamps=has_timestamps
    )
    progress = not args.no_progress
    num_workers = DEFAULT_COMPARE_WORKERS if args.workers is None else args.workers
    overrides: dict[str, list[str]] = {}
    results: dict[str, RunResult] = {}
    if args.compare:
        for compare_run in run_comparison(
            workload,
            schedule,
            num_workers=num_workers,
            config_path=args.config,
            overrides=args.set,
            progress=progress,
            timeout_s=args.timeout,
        ):
            results[compare_run.label] = compare_run.result
            overrides[compare_run.label] = compare_run.overrides
        where = f"{num_workers} in-process workers per run"
    else:
        url = check_url(args.url)
        result = asyncio.run(
            run_replay(url, workload, schedule, timeout_s=args.timeout, progress=progress, api_key=args.api_key)
        )
        results["replay"] = result
        where = f"{len(result.replicas)} replicas at {url}"
    reports = {label: summarize(result, label) for label, result in results.items()}
    heading = describe(workload, schedule, args.block_tokens, shape, where)
    print(heading)
    print(format_table(reports))
    if args.json:
        report = replay_json(workload, schedule, shape, args, reports, overrides, num_workers if args.compare else None)
        write_output("--json", args.json, json.dumps(report, indent=1) + "\n")
    if args.plot:
        write_plot(reports, args.plot, title=heading.splitlines()[0])
    return 0


def build_workload(args: argparse.Namespace, shape: ModelShape) -> Workload:
    """The workload the flags describe; raises ConfigError for bad flags or a bad trace."""
    if args.format not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {args.format!r}")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.format == "synthetic":
        if args.trace is not None:
            raise ConfigError("--format synthetic generates its requests: drop --trace")
        return synthetic_workload(
            requests=args.limit or DEFAULT_SYNTHETIC_REQUESTS,
            groups=args.groups,
            prefix_tokens=args.prefix_tokens,
            suffix_tokens=args.suffix_tokens,
            max_tokens=args.max_tokens,
            shape=shape,
            seed=args.seed,
        )
    trace = Path(args.trace) if args.trace is not None else DEFAULT_TRACE
    if args.compare and args.limit is None:
        raise ConfigError("--compare replays the trace three times: pass --limit N to choose the slice")
    if args.trace is None and trace.is_relative_to(Path.cwd()):
        trace = trace.relative_to(Path.cwd())  # shorter in the report
    return mooncake_workload(
        trace, limit=args.limit, block_tokens=args.block_tokens, max_tokens=args.max_tokens, shape=shape
    )


def describe(workload: Workload, schedule: Schedule, block_tokens: int, shape: ModelShape, where: str) -> str:
    """The lines printed above the table: what was replayed, how, against what."""
    span = trace_span_s(workload)
    timing = schedule.describe() + ("" if span is None else f" (trace span {span:.1f} s)")
    lines = [f"replay: {len(workload.requests)} requests of {workload.source}; {timing}; {where}"]
    if workload.source.startswith("mooncake:"):
        lines.append(f"  {block_tokens} tokens per 512-token trace block; longest prompt {workload.longest_prompt}")
    if workload.clipped:
        lines.append(
            f"  {workload.clipped} prompts clipped to fit the {shape.max_context}-token context "
            "(prompt + output), keeping their leading tokens"
        )
    return "\n".join(lines)


def replay_json(
    workload: Workload,
    schedule: Schedule,
    shape: ModelShape,
    args: argparse.Namespace,
    reports: dict[str, ReplayReport],
    overrides: dict[str, list[str]],
    workers: int | None,
) -> dict[str, Any]:
    """The ``--json`` document: settings, then one report per run under ``runs`` (``replay`` or the three)."""
    return {
        "mode": "compare" if args.compare else "url",
        "url": None if args.compare else args.url,
        "workers": workers,
        "workload": {
            "source": workload.source,
            "requests": len(workload.requests),
            "clipped": workload.clipped,
            "longest_prompt": workload.longest_prompt,
            "block_tokens": args.block_tokens if args.format == "mooncake" else None,
            "max_tokens": args.max_tokens,
            "trace_span_s": trace_span_s(workload),
        },
        "schedule": {"mode": schedule.mode, "value": schedule.value},
        "model": shape._asdict(),
        "config_overrides": overrides,
        "runs": {label: report.as_json() for label, report in reports.items()},
    }


def _check_mode(args: argparse.Namespace) -> None:
    if args.compare == (args.url is not None):
        raise ConfigError("pass --url URL of a running router, or --compare to start the service in-process")
    if args.compare:
        if args.api_key is not None:
            raise ConfigError("--api-key is for --url; --compare starts its own routers")
        if args.vocab_size is not None or args.max_context is not None:
            raise ConfigError("--vocab-size/--max-context are for --url; with --compare set worker.* with --set")
        if args.workers is not None and args.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    elif args.set or args.config is not None or args.workers is not None:
        raise ConfigError("--workers, --config and --set configure --compare's in-process service; drop them")
    else:
        check_url(args.url)  # a mistyped URL is told before the trace is read and expanded
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")


def _model_shape(args: argparse.Namespace) -> ModelShape:
    """With --compare the workers' config decides; with --url the flags (default: the worker defaults)."""
    if args.compare:
        config, _ = run_config("kvstore", args.config, args.set)
        return ModelShape(config.worker.vocab_size, config.worker.max_context)
    defaults = WorkerConfig()
    shape = ModelShape(args.vocab_size or defaults.vocab_size, args.max_context or defaults.max_context)
    if (args.vocab_size is not None and args.vocab_size < 1) or (args.max_context is not None and args.max_context < 2):
        raise ConfigError("--vocab-size must be >= 1 and --max-context >= 2")
    return shape


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay a Mooncake or synthetic trace against a router (or --compare routing/caching in-process)",
        description="Replay a request trace against a kvstore router and report what the cache did.",
    )
    target = p.add_argument_group("target (one of)")
    target.add_argument("--url", default=None, help="a running router, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--compare", action="store_true", help="start the service in-process 3 times: " + ", ".join(RUNS)
    )
    work = p.add_argument_group("workload")
    work.add_argument("--format", default="mooncake", help="mooncake (default) or synthetic")
    work.add_argument("--trace", default=None, help=f"Mooncake JSONL trace (default {DEFAULT_TRACE.name})")
    work.add_argument("--limit", type=int, default=None, help="the first N requests (synthetic: N requests, 200)")
    work.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help=f"tokens per 512-token trace block (default {DEFAULT_BLOCK_TOKENS})",
    )
    work.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"cap on output tokens (default {DEFAULT_MAX_TOKENS})",
    )
    work.add_argument("--groups", type=int, default=8, help="synthetic: shared prefixes (default 8)")
    work.add_argument("--prefix-tokens", type=int, default=256, help="synthetic: tokens per shared prefix (256)")
    work.add_argument("--suffix-tokens", type=int, default=32, help="synthetic: unique tokens per request (32)")
    work.add_argument("--seed", type=int, default=0, help="synthetic: random seed (0)")
    work.add_argument("--vocab-size", type=int, default=None, help="--url: the model's vocabulary (default 512)")
    work.add_argument("--max-context", type=int, default=None, help="--url: the model's context (default 2048)")
    pace = p.add_argument_group("schedule (default: trace timestamps)")
    pace.add_argument("--rate", type=float, default=None, help="send R requests per second")
    pace.add_argument("--concurrency", type=int, default=None, help="C clients, each waiting for its answer")
    pace.add_argument("--speedup", type=float, default=None, help="divide the trace's timestamps by S (default 1)")
    service = p.add_argument_group("--compare service")
    service.add_argument(
        "--workers", type=int, default=None, help=f"KV workers per run (default {DEFAULT_COMPARE_WORKERS})"
    )
    service.add_argument("--config", default=None, help="TOML config for the workers and routers")
    service.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="config override (after the defaults " + " ".join(BASE_OVERRIDES) + ")",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, help="write the results as JSON here")
    out.add_argument("--plot", default=None, help="write a PNG here (TTFT CDF, load per replica, cached fraction)")
    out.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    out.add_argument("--api-key", default=None, help="--url: bearer token of a router with router.api_key")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=benchmark_command(run))
