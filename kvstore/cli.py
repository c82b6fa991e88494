"""The ``kvstore`` command line: the one module above every layer.

Each subcommand lives with the code it drives and provides
``add_cli(subparsers)``, which adds its parser and sets ``func`` (taking the
parsed args, returning an exit code). This module only assembles them.
Errors a user can fix (bad config, bad flags, unreadable files) print one
line and exit 2.

A command's module is imported only when that command runs (or when the
whole parser is built, for ``--help`` and anything not recognised): the
router and the event tools then start without torch, Ray or the model code,
which only workers, ``serve`` and the benchmarks need. The tables below name
each command's module; a test checks that every module registers the name it
is listed under.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError

# command name -> the module whose add_cli() adds it
COMMANDS = {
    "events": "kvstore.deploy.events_cli",
    "worker": "kvstore.deploy.worker_cli",
    "router": "kvstore.deploy.router_cli",
    "simulate": "kvstore.benchmarks.simulate.cli",
    "serve": "kvstore.deploy.serve_cli",
    "replay": "kvstore.benchmarks.replay.cli",
}
BENCHMARKS = {  # `kvstore bench NAME`
    "pool": "kvstore.benchmarks.pool_bench",
    "router": "kvstore.benchmarks.router_bench",
    "offload": "kvstore.benchmarks.offload_bench",
    "offload-serving": "kvstore.benchmarks.offload_serving",
    "ttft": "kvstore.benchmarks.ttft_bench",
    "chaos": "kvstore.benchmarks.chaos_bench",
    "overhead": "kvstore.benchmarks.router_overhead",
    "structured": "kvstore.benchmarks.structured_bench",
}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS, False):
            return text
        return f"{text} (default: %(default)s)".strip()


def build_parser(command: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser: every command's, or (``command`` = ``["router"]``, ``["bench", "offload"]``) only
    that one's, so only its module is imported."""
    commands, benchmarks = dict(COMMANDS), dict(BENCHMARKS)
    if command:
        if command[0] == "bench":
            commands = {}
            benchmarks = {name: benchmarks[name] for name in command[1:2]}
        else:
            commands, benchmarks = {command[0]: commands[command[0]]}, {}
    parser = argparse.ArgumentParser(prog="kvstore", description="Distributed multi-tier KV cache for LLM serving.")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="Python logging level (default WARNING)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in commands.values():
        importlib.import_module(module).add_cli(sub)
    if benchmarks:
        bench = sub.add_parser("bench", help="benchmarks: each prints a table and writes JSON")
        bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
        for module in benchmarks.values():
            importlib.import_module(module).add_cli(bench_sub)
    _with_defaults(parser)
    return parser


def chosen_command(argv: Sequence[str]) -> list[str] | None:
    """The command ``argv`` names (``["router"]``, ``["bench", "offload"]``), or None when it names no known
    one, or asks for the top-level help: then the whole parser is built, to list them or say what is wrong."""
    words = list(argv)
    index = 0
    while index < len(words) and words[index].startswith("-"):
        if words[index] in ("-h", "--help"):
            return None
        index += 2 if words[index] == "--log-level" else 1  # the one top-level option with a value
    if index >= len(words):
        return None
    name = words[index]
    if name == "bench":
        rest = words[index + 1 :]
        return ["bench", rest[0]] if rest and rest[0] in BENCHMARKS else None
    return [name] if name in COMMANDS else None


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default not in (None, False):
            action.help = "(default: %(default)s)"  # argparse shows nothing for an option without help
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _with_defaults(child)


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(chosen_command(words))
    args = parser.parse_args(words)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KVStoreError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader left (``| head``): end quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return 0
    except KeyboardInterrupt:
        return 130
