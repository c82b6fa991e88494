"""`kvstore serve` as a user runs it: a subprocess on an embedded Ray, then Ctrl-C.

Brings the service up with the real CLI, sends completions through the URL
it prints (a repeated shared-prefix request must report cached tokens),
reads /metrics, runs the official openai client's checks (models,
completions and chat, plain and streamed), sends SIGINT, and checks that nothing is left behind: no
process of the service's tree, no listening port it printed, no new
shared-memory segment.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests import openai_conformance as check

READY = re.compile(r"kvstore is serving \d+ workers at (http://\S+)")
ENDPOINT = re.compile(r"tcp://127\.0\.0\.1:(\d+)")


def shm_entries() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(240)
def test_serve_embedded_then_sigint_leaves_nothing_behind(tmp_path: Path) -> None:
    shm_before = shm_entries()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "kvstore", "serve", "--workers", "2", "--port", "0",
        "--set", "pool.num_blocks=256", "--set", "worker.device=cpu",
        "--set", f"tiers.disk_dir={tmp_path / 'disk'}", "--set", "tiers.cpu_capacity_bytes=33554432",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    output: list[str] = []
    url = None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 150
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            output.append(line)
            match = READY.search(line)
            if match:
                url = match.group(1)
        assert url is not None, "".join(output)
        # The lines after the banner list the event endpoints; the curl line ends them.
        while not output[-1].lstrip().startswith("try:"):
            line = proc.stdout.readline()
            assert line, "".join(output)
            output.append(line)
        printed = "".join(output)
        assert "events tier " in printed, printed  # one tier actor on the (single) node
        ports = {int(p) for p in ENDPOINT.findall(printed)} | {int(url.rsplit(":", 1)[1])}
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]

        with httpx.Client(base_url=url, timeout=60) as client:
            prompt = "A shared system prompt that every request of this tenant starts with. " * 3
            first = client.post("/v1/completions", json={"prompt": prompt + "Q1", "max_tokens": 4})
            assert first.status_code == 200, first.text
            second = None
            for _ in range(50):  # the router learns the first request's blocks from the event stream
                second = client.post("/v1/completions", json={"prompt": prompt + "Q2", "max_tokens": 4})
                assert second.status_code == 200, second.text
                if second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                    break
                time.sleep(0.1)
            assert second is not None and second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            metrics = client.get("/metrics").text
            router_metrics = (
                "kvstore_router_decisions_total",
                "kvstore_router_route_seconds",
                "kvstore_router_events_total",
                "kvstore_router_event_gaps_total",
                "kvstore_router_decode_errors_total",
            )
            for name in router_metrics:
                assert name in metrics, name
            deadline = time.monotonic() + 10
            while not ("kvstore_gpu_cache_usage_perc" in metrics and "kvstore_tier_usage_bytes" in metrics) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.2)
                metrics = client.get("/metrics").text
            for name in ("kvstore_gpu_cache_usage_perc", "kvstore_prefix_cache_queries_total",
                         "kvstore_prefix_cache_hits_total", "kvstore_preemptions_total",
                         "kvstore_tier_usage_bytes", "kvstore_tier_hits_total",
                         "kvstore_offload_bytes_total"):  # fmt: skip
                assert name in metrics, name

        # The official openai client, against the service a user runs: models, completions and chat, plain and
        # streamed, a cached repeated chat prompt, seeded sampling, a 404 for an unknown model.
        for behaviour in check.every_behaviour():
            behaviour(url, "kvstore-toy")

        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
        shutdown = proc.stdout.read() or ""
        assert code == 0, "".join(output) + shutdown
        assert "Traceback" not in shutdown and "kvstore stopped" in shutdown, shutdown
        _gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"processes left behind: {[(p.pid, p.name()) for p in alive]}"
        assert not [p for p in ports if port_open(p)], "a printed port is still listening"
        # A deployment's arena is kvstore-<digest>-<owner>; other processes' (benchmarks, tests) are not ours.
        new = shm_entries() - shm_before
        leaked = {n for n in new if n.startswith("kvstore-") and not n.startswith(("kvstore-bench-", "kvtest-"))}
        assert not leaked, f"shared memory left behind: {leaked}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
