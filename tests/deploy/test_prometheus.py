"""A real Prometheus scrapes a running `kvstore serve`: scripts/check-prometheus, when Prometheus is here.

The script checks every documented family (with its documented labels) and
every dashboard query through Prometheus' HTTP API. Skipped where no
`prometheus` binary is on the PATH: the script itself installs the Debian
package, which a test must not do (`apt-get install -y prometheus`, then
run this test or the script).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check-prometheus"


@pytest.mark.timeout(420)
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (apt-get install prometheus)")
def test_a_real_prometheus_sees_every_documented_family_and_every_dashboard_query() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 undocumented" in done.stdout and "duplicate samples 0" in done.stdout, done.stdout
