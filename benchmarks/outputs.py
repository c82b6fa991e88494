"""What the benchmark commands write: their ``--json``/``--plot`` files and their tables on stdout.

Every tool's command is wrapped in :func:`benchmark_command`: it checks the
``--json`` and ``--plot`` paths before any work (a run may take minutes; a
path it cannot write must not be found only afterwards), and carries on
quietly when the reader of stdout leaves (``kvstore simulate ... | head
-1``): the rest of its tables go to /dev/null, its files are still written,
and it exits 0 with nothing on stderr. The files themselves are written with
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
from typing import Any

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
    """``command``, after checking its ``--json``/``--plot`` paths (when it has them), carrying on quietly (exit
    code 0) when the reader of its stdout goes away (``| head``).

    Its stdout then points at /dev/null, as Python's documentation advises for
    SIGPIPE, so that the interpreter's last flush does not fail again; what
    it prints after that is dropped, and the files it writes are written. A
    write to stdout that bypasses ``sys.stdout`` and finds it gone stops the
    command there, still with exit code 0. A BrokenPipeError from anything but
    stdout (a socket) propagates.
    """

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        if getattr(args, "json", None) is not None:
            check_output("--json", args.json)
        if getattr(args, "plot", None) is not None:
            check_plot(args.plot)
        stdout = sys.stdout
        if stdout is not None:  # None: started with stdout closed (print() then writes nowhere)
            sys.stdout = _ReaderMayLeave(stdout)  # type: ignore[assignment]  # a stand-in for what print() writes to
        try:
            code = command(args)
            if stdout is not None:
                sys.stdout.flush()
        except BrokenPipeError:
            if not stdout_closed():
                raise
            discard_stdout()
            return 0
        finally:
            sys.stdout = stdout
        return code

    return run


class _ReaderMayLeave:
    """A command's stdout that, once its reader has gone, writes to /dev/null instead and lets the command go on, so
    that the files it was asked for (``--json``, ``--plot``) are still written. A broken pipe that is not stdout's
    reader leaving still raises."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            self._stream.write(text)
        except BrokenPipeError as exc:
            self._reader_gone(exc)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError as exc:
            self._reader_gone(exc)

    @staticmethod
    def _reader_gone(exc: BrokenPipeError) -> None:
        if not stdout_closed():
            raise exc
        discard_stdout()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


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
