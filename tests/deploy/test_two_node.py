"""`kvstore serve --address` on a two-node Ray cluster started on this machine.

`ray start --head` plus a second `ray start` joining it, each a separate
raylet with its own resources (every port chosen free at run time, a private
temp dir, so the test session's own Ray is untouched). The service must put
a tier actor on each node, workers on both, and the router must subscribe to
every producer of both nodes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ray_start(temp_dir: str, env: dict[str, str], *args: str) -> None:
    ports = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
             "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
             "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]  # fmt: skip
    done = subprocess.run(
        [RAY, "start", "--num-cpus", "2", "--temp-dir", temp_dir, "--disable-usage-stats", *ports, *args],
        check=False, env=env, capture_output=True, timeout=120, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def kill_cluster(temp_dir: str) -> None:
    """Stop every process of this cluster (and only this one): their command lines name its temp dir."""
    procs = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                procs.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=20)


@pytest.mark.timeout(300)
def test_serve_on_a_two_node_cluster_places_a_tier_per_node() -> None:
    temp_dir = tempfile.mkdtemp(prefix="kvray-")
    # A private throwaway cluster on this machine: Ray's token auth is off for it (a joining node found
    # no usable token when started here); a real cluster keeps it on (see the deployment guide).
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    gcs = free_port()
    serve = None
    try:
        ray_start(temp_dir, env, "--head", "--port", str(gcs), "--include-dashboard", "false",
                  "--ray-client-server-port", str(free_port()), "--resources", '{"head_node": 1}')  # fmt: skip
        ray_start(temp_dir, env, "--address", f"127.0.0.1:{gcs}", "--resources", '{"second_node": 1}')
        serve = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--address", f"127.0.0.1:{gcs}", "--workers", "2",
             "--port", "0", "--set", "worker.device=cpu", "--set", "pool.num_blocks=128",
             "--set", "tiers.cpu_capacity_bytes=16777216"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
        )  # fmt: skip
        assert serve.stdout is not None
        lines: list[str] = []
        while not lines or not lines[-1].lstrip().startswith("try:"):
            line = serve.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        printed = "".join(lines)
        url = re.search(r"at (http://\S+)", printed).group(1)  # type: ignore[union-attr]
        tier_nodes = re.findall(r"events tier (\w+):", printed)
        assert len(set(tier_nodes)) == 2, printed  # a tier actor on each node

        with httpx.Client(base_url=url, timeout=60) as client:
            workers = client.get("/workers").json()["workers"]
            assert {w["node"] for w in workers} == set(tier_nodes)  # one worker on each node
            # The router subscribes to both workers' and both tiers' streams.
            deadline = time.monotonic() + 20
            producers: set[str] = set()
            while time.monotonic() < deadline and len(producers) < 4:
                metrics = client.get("/metrics").text
                producers = set(re.findall(r'kvstore_router_events_total\{producer="([^"]+)"\}', metrics))
                time.sleep(0.2)
            assert len(producers) == 4 and sum(p.startswith("tier-") for p in producers) == 2, producers
            response = client.post("/v1/completions", json={"prompt": "two nodes, one router", "max_tokens": 4})
            assert response.status_code == 200, response.text
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=90) == 0
    finally:
        if serve is not None and serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        kill_cluster(temp_dir)
