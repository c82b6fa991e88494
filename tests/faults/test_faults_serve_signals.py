"""SIGINT and SIGTERM while `kvstore serve` starts: a clean exit whenever the signal lands.

Each case starts a real ``kvstore serve`` process and signals it at a moment
of its start, found by watching its process tree: Ray's GCS up (Ray is still
starting), its raylet up, the tier actor's process up (the deployment is
being placed). Each must exit promptly with status 0 and no traceback,
leave no process of its tree running (Ray's agents included) and no arena
in its (private) shared-memory directory.

A signal while serving, with requests in flight, is the last test of
test_faults_serve_process.py.
"""

from __future__ import annotations

import signal
import time

import pytest
from serve_helpers import ServeProcess


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("signum", "moment"),
    [(signal.SIGINT, "gcs_server"), (signal.SIGTERM, "raylet"), (signal.SIGTERM, "ray::TierActor")],
    ids=["SIGINT-while-ray-starts", "SIGTERM-once-the-raylet-runs", "SIGTERM-while-placing-the-tier"],
)
def test_a_signal_during_start_exits_cleanly(signum: int, moment: str) -> None:
    serve = ServeProcess()
    try:
        deadline = time.monotonic() + 60
        while moment not in serve.names():
            assert serve.proc.poll() is None and time.monotonic() < deadline, serve.text()
            time.sleep(0.02)
        at = time.monotonic() - serve.started
        code, took = serve.stop_with(signum, timeout=45)
        survivors = serve.survivors(grace=10.0)
        output = serve.text()
        print(
            f"\n{signal.Signals(signum).name} {at:.1f} s into the start ({moment} up): exit {code} after {took:.1f} s; "
            f"{len(survivors)} processes left, arenas left: {serve.arenas()}"
        )
        assert code == 0, output
        assert "Traceback" not in output, output
        assert not survivors, f"processes outlived kvstore serve: {survivors}"
        assert serve.arenas() == [], serve.arenas()
    finally:
        serve.kill()
