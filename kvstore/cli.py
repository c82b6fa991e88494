"""The ``kvstore`` command line: the one module above every layer.

Each subcommand lives with the code it drives and provides
``add_cli(subparsers)``, which adds its parser and sets ``func`` (taking the
parsed args, returning an exit code). This module only assembles them, with
plain imports so the layering check sees every edge. Errors a user can fix
(bad config, bad flags, unreadable files) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvstore.benchmarks import chaos_bench, offload_bench, pool_bench, router_bench, ttft_bench
from kvstore.benchmarks.replay import cli as replay_cli
from kvstore.benchmarks.simulate import cli as simulate_cli
from kvstore.deploy import events_cli, router_cli, serve_cli, worker_cli
from kvstore.errors import KVStoreError

COMMANDS = (events_cli, worker_cli, router_cli, simulate_cli, serve_cli, replay_cli)
BENCHMARKS = (pool_bench, router_bench, offload_bench, ttft_bench, chaos_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Distributed multi-tier KV cache for LLM serving.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_cli(sub)
    bench = sub.add_parser("bench", help="benchmarks: each prints a table and writes JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for benchmark in BENCHMARKS:
        benchmark.add_cli(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KVStoreError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
