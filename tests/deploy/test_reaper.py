"""The reaper of ``kvstore serve``: nothing Ray leaves behind outlives serve.

Each scenario runs in a process of its own, which becomes a child subreaper: the test process must not
adopt the orphans of its other children (the session's Ray cluster among them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")

# A child that ignores SIGTERM and starts a grandchild that ignores it too: as a raylet killed while it starts
# leaves its agents. The grandchild is adopted only once the child is killed, late in the reaper's time.
SCENARIO = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from kvstore.deploy.reaper import become_subreaper, stop_children
    assert become_subreaper()
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         f"g = subprocess.Popen([sys.executable, '-c', {deaf!r}], stdout=subprocess.DEVNULL); "
         "print(g.pid, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,  # no pipe of ours held open by them
    )
    grandchild = int(child.stdout.readline())
    time.sleep(0.3)  # both have set SIG_IGN by now
    started = time.monotonic()
    signalled = stop_children(timeout_s=float(sys.argv[1]), grace_s=float(sys.argv[2]))
    print(grandchild, child.pid in signalled, grandchild in signalled, round(time.monotonic() - started, 2))
    """
)


@pytest.mark.parametrize(("timeout_s", "grace_s"), [(2.0, 2.0), (1.0, 0.3)])
def test_an_orphan_adopted_late_and_deaf_to_sigterm_is_killed_before_the_reaper_returns(
    timeout_s: float, grace_s: float
) -> None:
    """(2.0, 2.0): the child is killed at half the time, its orphan adopted then and sent SIGTERM, which it
    ignores; its SIGKILL would come after the deadline, so the reaper's last second sends it."""
    # A session of its own: whatever the scenario leaves behind, even on a failure, is killed at the end.
    scenario = subprocess.Popen(
        [sys.executable, "-c", SCENARIO, str(timeout_s), str(grace_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = scenario.communicate(timeout=30)
        assert scenario.returncode == 0, err
        grandchild, child_signalled, grandchild_signalled, took = out.split()
        assert child_signalled == "True" and grandchild_signalled == "True"
        assert float(took) <= timeout_s + 1.5
        time.sleep(0.2)  # the scenario's process is gone; an orphan of it would now be init's
        assert not os.path.exists(f"/proc/{grandchild}"), "the deaf grandchild outlived the reaper"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(scenario.pid, signal.SIGKILL)
        scenario.wait()
