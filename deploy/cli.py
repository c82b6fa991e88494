"""The ``kvstore`` command line.

Each subcommand lives with the code it drives; a module listed in
COMMAND_MODULES provides ``add_cli(subparsers)``, which adds its parser and
sets ``func`` (taking the parsed args, returning an exit code). Errors a user
can fix (bad config, bad flags, unreadable files) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError

COMMAND_MODULES: tuple[str, ...] = (
    "deploy.events_cli",
    "deploy.worker_http",
    "router.cli",
    "deploy.simulate_cli",
    "deploy.serve_cli",
    "deploy.replay",
    "benchmarks.pool_bench",
    "benchmarks.router_bench",
    "benchmarks.offload_bench",
    "benchmarks.ttft_bench",
    "benchmarks.chaos_bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Distributed multi-tier KV cache for LLM serving.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks: each prints a table and writes JSON")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    parser.set_defaults(_bench_subparsers=bench_sub)
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        module.add_cli(bench_sub if getattr(module, "IS_BENCHMARK", False) else sub)
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


if __name__ == "__main__":
    sys.exit(main())
