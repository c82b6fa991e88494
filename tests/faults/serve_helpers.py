"""`kvstore serve` as a process, for the fault tests that need the real thing (a uniquely named module).

:class:`ServeProcess` starts ``python -m kvstore serve`` on an embedded Ray
with its CPU arena in a private tmpfs directory (so the arena left behind, or
not, is this run's alone), follows its process tree as it grows (Ray's
processes appear over the first seconds), and says what outlived it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

READY = re.compile(r"kvstore is serving \d+ workers? at (http://\S+)")


class ServeProcess:
    """One ``kvstore serve --port 0`` process; ``overrides`` are ``--set`` values on top of a small CPU setup."""

    def __init__(self, *overrides: str, workers: int = 1) -> None:
        self.shm_dir = Path(tempfile.mkdtemp(prefix="kvtest-", dir="/dev/shm"))
        command = [
            sys.executable, "-m", "kvstore", "serve", "--workers", str(workers), "--port", "0",
            "--set", "worker.device=cpu", "--set", "pool.num_blocks=256",
            "--set", "tiers.cpu_capacity_bytes=33554432", "--set", f"tiers.shm_dir={self.shm_dir}",
            *(arg for value in overrides for arg in ("--set", value)),
        ]  # fmt: skip
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.output: list[str] = []
        self.url: str | None = None
        self._tree: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._reader.start()
        self._watcher.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self.output.append(line)
                match = READY.search(line)
                if match:
                    self.url = match.group(1)

    def _watch(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self.snapshot()
            time.sleep(0.05)

    def snapshot(self) -> list[psutil.Process]:
        """The process tree now (and remember every process ever seen in it)."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        with self._lock:
            for process in tree:
                self._tree.setdefault(process.pid, process)
        return tree

    def names(self) -> set[str]:
        names = set()
        for process in self.snapshot():
            with contextlib.suppress(psutil.Error):
                names.add(process.name())
        return names

    def text(self) -> str:
        with self._lock:
            return "".join(self.output)

    def wait_ready(self, timeout: float = 150) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.url is not None and any(line.lstrip().startswith("try:") for line in self.output):
                    return self.url
            assert self.proc.poll() is None, self.text()
            time.sleep(0.05)
        raise AssertionError(f"kvstore serve was not ready within {timeout:.0f} s:\n{self.text()}")

    def stop_with(self, signum: int, timeout: float = 60) -> tuple[int | None, float]:
        """Send ``signum``; (exit code or None if it did not exit within ``timeout``, seconds it took)."""
        sent = time.monotonic()
        self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - sent
        return code, time.monotonic() - sent

    def survivors(self, grace: float) -> list[tuple[int, str]]:
        """Processes of the tree still running ``grace`` seconds from now (zombies count as gone)."""
        self._stop.set()
        with self._lock:
            tree = list(self._tree.values())
        _gone, alive = psutil.wait_procs(tree, timeout=grace)
        left = []
        for process in alive:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    left.append((process.pid, process.name()))
            except psutil.Error:
                pass
        return left

    def arenas(self) -> list[str]:
        return sorted(p.name for p in self.shm_dir.iterdir())

    def kill(self) -> None:
        """Clean up whatever is left, whatever happened (test teardown)."""
        self._stop.set()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        with self._lock:
            tree = list(self._tree.values())
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.kill()
        for entry in self.shm_dir.iterdir():
            entry.unlink()
        self.shm_dir.rmdir()
