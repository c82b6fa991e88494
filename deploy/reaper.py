"""Ray's processes that outlive Ray's shutdown are stopped by ``kvstore serve`` on its way out.

An embedded Ray's raylet starts agents of its own (the dashboard agent, the
runtime-env agent, listening on ports of their own). Stopped in an orderly
way, the raylet stops them; killed while it was still starting (a signal in
the first seconds), it leaves them running, orphaned, for about a minute
until they notice. So ``kvstore serve`` makes itself their child subreaper
(Linux ``PR_SET_CHILD_SUBREAPER``): whatever Ray leaves orphaned is
re-parented to it instead of to init, and :func:`stop_children` stops it
after Ray's own shutdown. Elsewhere both are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants; False where the kernel does not offer it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def children() -> list[int]:
    """This process's children (adopted orphans included), from /proc; [] where there is none."""
    me = os.getpid()
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()  # after "pid (command)": state, ppid, ...
            if int(fields[1]) == me:
                found.append(int(stat.parent.name))
    return found


def stop_children(timeout_s: float = 10.0, grace_s: float = 2.0) -> list[int]:
    """Stop every child, adopted ones included, until none is left; returns those signalled.

    Call once Ray has shut down: every child left is one Ray failed to stop. A child is sent SIGTERM,
    then SIGKILL if it is still there ``grace_s`` later (at most half of ``timeout_s``); children that
    appear meanwhile (a process's orphans, adopted as it exits) are handled the same way. When
    ``timeout_s`` runs out, whatever is left -- an orphan adopted late, its SIGTERM not yet escalated --
    is sent SIGKILL and reaped for up to a second more, so nothing outlives the caller.
    """
    signalled: dict[int, float] = {}
    grace_s = min(grace_s, timeout_s / 2)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = _reap(children())
        if not alive:
            return list(signalled)
        now = time.monotonic()
        for pid in alive:
            if pid not in signalled:
                signalled[pid] = now
                _signal(pid, signal.SIGTERM)
            elif now - signalled[pid] > grace_s:
                _signal(pid, signal.SIGKILL)
        time.sleep(0.05)
    last = time.monotonic() + 1.0
    while (alive := _reap(children())) and time.monotonic() < last:
        for pid in alive:
            signalled.setdefault(pid, time.monotonic())
            _signal(pid, signal.SIGKILL)
        time.sleep(0.02)
    return list(signalled)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _reap(pids: list[int]) -> list[int]:
    """Reap those of ``pids`` that exited; return those still running."""
    running = []
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours to wait for, or already reaped
            done = pid if not Path(f"/proc/{pid}").exists() else 0
        if done == 0:
            running.append(pid)
    return running
