"""The ``kvstore bench`` parser with one benchmark's command only, as ``kvstore.cli`` registers it."""

from __future__ import annotations

import argparse
from types import ModuleType


def bench_parser(module: ModuleType) -> argparse.ArgumentParser:
    """``kvstore bench <name> ...`` for the benchmark ``module`` (its ``add_cli``)."""
    parser = argparse.ArgumentParser(prog="kvstore")
    bench = parser.add_subparsers(dest="command").add_parser("bench").add_subparsers(dest="bench")
    module.add_cli(bench)
    return parser
