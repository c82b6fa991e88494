"""`kvstore serve` under a 64 MiB /dev/shm (Docker's default): it refuses in one line naming the fix.

A real 64 MiB tmpfs, mounted in a private mount namespace (``unshare
--mount``, so nothing outside the test sees it), is the arena's directory
(``tiers.shm_dir``). The default arena does not fit: serve must say so in
one line and exit 2 before starting Ray -- not die 15 s later with Ray's
ActorDiedError trace. An arena that fits (32 MiB) passes the same check.
Ray's own object store still uses the host's /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstore.tiers.config import TierConfig


def in_small_shm(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (a shell line; $SHM is the mount point) with a 64 MiB tmpfs at $SHM; skip if impossible."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    shm = tmp_path / "shm"
    shm.mkdir()
    script = f"mount -t tmpfs -o size=64m tmpfs {shm} || exit 99; export SHM={shm}; {command}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True, text=True, timeout=90, env=env,
        )  # fmt: skip
    except OSError as exc:
        pytest.skip(f"cannot run unshare: {exc}")
    if done.returncode == 99 or "unshare:" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    return done


@pytest.mark.timeout(120)
def test_serve_refuses_a_too_small_shm_in_one_line(tmp_path: Path) -> None:
    done = in_small_shm(
        tmp_path, f'exec {sys.executable} -m kvstore serve --port 0 --set "tiers.shm_dir=$SHM" --set worker.device=cpu'
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    print(f"\nexit {done.returncode}: {done.stderr.strip()}")
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    line = lines[0]
    capacity = TierConfig().cpu_capacity_bytes // 2**20
    assert line.startswith("kvstore: error: ") and "64 MiB free" in line and f"{capacity} MiB CPU arena" in line, line
    assert "--shm-size" in line and "tiers.cpu_capacity_bytes=" in line, line
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.timeout(60)
def test_an_arena_that_fits_the_small_shm_passes_the_check(tmp_path: Path) -> None:
    check = textwrap.dedent(
        """
        import os
        from kvstore.deploy.shm import check_arena_fits
        from kvstore.tiers.config import TierConfig
        print(check_arena_fits(TierConfig(shm_dir=os.environ["SHM"], cpu_capacity_bytes=32 * 2**20)))
        """
    )
    done = in_small_shm(tmp_path, f"exec {sys.executable} -c '{check}'")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("CPU arena 32 MiB in ") and done.stdout.strip().endswith("(64 MiB free)")
