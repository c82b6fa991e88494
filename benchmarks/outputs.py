"""What the benchmark commands write: their ``--json``/``--plot`` files and their tables on stdout.

Every tool's command is wrapped in :func:`benchmark_command`: it checks the
``--json`` and ``--plot`` paths before any work (a run may take minutes; a
path it cannot write must not be found only afterwards), and ends quietly
when the reader of stdout leaves (``kvstore simulate ... | head -1``), as
command-line tools do. The files themselves are written with
:func:`write_output` (and :func:`~kvstore.benchmarks.figures.save_figure`).
"""

from __future__ import annotations

import argparse
import functools
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path

from kvstore.errors import ConfigError


def check_output(flag: str, path: str | Path) -> None:
    """Raise ConfigError unless ``path`` can be opened for writing; leaves no file behind that was not there."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file path")
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def check_plot(path: str | Path) -> None:
    """:func:`check_output` for ``--plot``, and a file type matplotlib can write (the suffix chooses it)."""
    from kvstore.benchmarks.figures import pyplot

    check_output("--plot", path)
    suffix = Path(path).suffix.lower().lstrip(".")
    supported = pyplot().figure().canvas.get_supported_filetypes()
    pyplot().close("all")
    if suffix and suffix not in supported:
        raise ConfigError(
            f"--plot {path}: matplotlib cannot write .{suffix} files; use one of .{', .'.join(supported)}"
        )


def write_output(flag: str, path: str | Path, text: str) -> None:
    """Write a command's output file; a path that cannot be written is the user's to fix (ConfigError)."""
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {flag} {path}: {exc.strerror or exc}") from None


Command = Callable[[argparse.Namespace], int]


def benchmark_command(command: Command) -> Command:
    """``command``, after checking its ``--json``/``--plot`` paths (when it has them), and stopped quietly
    (exit code 0) when the reader of its stdout goes away (``| head``).

    Its stdout then points at /dev/null, as Python's documentation advises for
    SIGPIPE, so that the interpreter's last flush does not fail again. A
    BrokenPipeError from anything but stdout (a socket) propagates.
    """

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "json", None) is not None:
            check_output("--json", args.json)
        if getattr(args, "plot", None) is not None:
            check_plot(args.plot)
        try:
            code = command(args)
            sys.stdout.flush()
        except BrokenPipeError:
            if not stdout_closed():
                raise
            discard_stdout()
            return 0
        return code

    return run


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR is always reported: for a pipe, that its reading end is closed
    return any(events & select.POLLERR for _, events in poller.poll(0))


def discard_stdout() -> None:
    """Point stdout at /dev/null, dropping whatever it still buffers for a reader that has gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
