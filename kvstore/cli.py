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

from kvstore.benchmarks import (
    chaos_bench,
    offload_bench,
    offload_serving,
    pool_bench,
    router_bench,
    router_overhead,
    ttft_bench,
)
from kvstore.benchmarks.replay import cli as replay_cli
from kvstore.benchmarks.simulate import cli as simulate_cli
from kvstore.deploy import events_cli, router_cli, serve_cli, worker_cli
from kvstore.errors import KVStoreError


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS, False):
            return text
        return f"{text} (default: %(default)s)".strip()


COMMANDS = (events_cli, worker_cli, router_cli, simulate_cli, serve_cli, replay_cli)
BENCHMARKS = (pool_bench, router_bench, offload_bench, offload_serving, ttft_bench, chaos_bench, router_overhead)


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
    _with_defaults(parser)
    return parser


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default not in (None, False):
            action.help = "(default: %(default)s)"  # argparse shows nothing for an option without help
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_defaults(child)


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
