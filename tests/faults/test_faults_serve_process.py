"""Faults against one real `kvstore serve` process: hostile bodies, slow clients, LoRA names, exposure, SIGTERM.

One process for the module (a start costs about 15 s): one worker, a tier
actor with its arena in a private tmpfs directory, and short HTTP deadlines
so the slow-client checks stay bounded. The router in it is also the Ray
driver, so its memory is the deployment's life. The tests run in file order;
the last one stops the process with SIGTERM while requests are in flight.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import ServeProcess
from slow_clients import all_held, held_for, status_of

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 40
DRAIN_TIMEOUT_S = 2.0
MAX_BODY = 4 << 20
HOSTILE = 16
RSS_BUDGET = 100 * 2**20


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    process = ServeProcess(
        f"router.header_timeout_s={HEADER_TIMEOUT_S}",
        f"router.body_timeout_s={BODY_TIMEOUT_S}",
        f"router.keep_alive_s={KEEP_ALIVE_S}",
        f"router.max_connections={MAX_CONNECTIONS}",
        f"router.drain_timeout_s={DRAIN_TIMEOUT_S}",
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


def url_of(serve: ServeProcess) -> str:
    assert serve.url is not None
    return serve.url


def port_of(serve: ServeProcess) -> int:
    return int(url_of(serve).rsplit(":", 1)[1])


def metric(page: str, name: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == name
    )  # fmt: skip


def settled_metrics(url: str) -> str:
    """/metrics once the workers' part (as of the router's last health poll, every second) stops changing."""
    page = httpx.get(f"{url}/metrics", timeout=10).text
    for _ in range(20):
        time.sleep(1.2)
        again = httpx.get(f"{url}/metrics", timeout=10).text
        if metric(again, "kvstore_prefix_cache_queries_total") == metric(page, "kvstore_prefix_cache_queries_total"):
            return again
        page = again
    raise AssertionError("the workers' metrics did not settle")


@pytest.mark.timeout(120)
def test_banner_says_one_worker_and_the_arena(serve: ServeProcess) -> None:
    text = serve.text()
    assert "kvstore is serving 1 worker at http://127.0.0.1:" in text, text
    assert f"tiers:       CPU arena 32 MiB in {serve.shm_dir} (" in text, text


@pytest.mark.timeout(120)
def test_every_listening_socket_of_the_process_tree_is_loopback(serve: ServeProcess) -> None:
    time.sleep(2.0)  # Ray's agents and exporters start in the first seconds after serve is ready
    listening: list[tuple[str, str, int]] = []
    for process in serve.snapshot():
        try:
            name = process.name()
            sockets = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [(name, c.laddr.ip, c.laddr.port) for c in sockets if c.status == psutil.CONN_LISTEN]
    exposed = [s for s in listening if s[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    processes = sorted({name for name, _, _ in listening})
    print(
        f"\nkvstore serve: {len(listening)} listening sockets in {len(processes)} processes, "
        f"{len(exposed)} beyond loopback"
    )
    assert len(listening) >= 8 and {"gcs_server", "raylet"} <= set(processes), listening
    assert not exposed, exposed


@pytest.mark.timeout(180)
@pytest.mark.parametrize("element", [b"{}", b"1"], ids=["empty-objects", "small-ints"])
def test_16_concurrent_hostile_bodies_cost_the_router_under_100_mib(serve: ServeProcess, element: bytes) -> None:
    count = (MAX_BODY - 64) // (len(element) + 1)
    body = b'{"prompt": [' + b",".join([element] * count) + b'], "max_tokens": 1}'
    assert len(body) <= MAX_BODY
    router = psutil.Process(serve.proc.pid)
    baseline = router.memory_info().rss
    peak = [baseline]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], router.memory_info().rss)
            time.sleep(0.01)

    def send(_: int) -> tuple[int, str]:
        response = httpx.post(
            f"{url_of(serve)}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
        )
        return response.status_code, response.json()["error"]["message"]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    with ThreadPoolExecutor(HOSTILE) as pool:
        answers = list(pool.map(send, range(HOSTILE)))
    took = time.monotonic() - started
    sampling.set()
    sampler.join()
    grew = peak[0] - baseline
    print(
        f"\n{HOSTILE} concurrent {len(body) / 2**20:.1f} MiB bodies of {count:,} `{element.decode()}`: answered in "
        f"{took:.2f} s, {answers[0][0]} `{answers[0][1]}`; router RSS {baseline / 2**20:.0f} -> peak "
        f"{peak[0] / 2**20:.0f} MiB (+{grew / 2**20:.0f} MiB)"
    )
    assert all(status == 400 for status, _ in answers), answers[:2]
    assert grew < RSS_BUDGET
    ok = httpx.post(f"{url_of(serve)}/v1/completions", json={"prompt": "still serving", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.timeout(120)
def test_slow_and_idle_connections_are_closed_within_their_deadlines(serve: ServeProcess) -> None:
    results = all_held(port_of(serve), bound_s=8.0)
    for name, held in results.items():
        print(f"\n{name}: closed after {held.seconds:.2f} s, status {status_of(held.answer)}", end="")
    print()
    deadlines = {
        "says nothing": HEADER_TIMEOUT_S,
        "half its headers": HEADER_TIMEOUT_S,
        "drips its headers": HEADER_TIMEOUT_S,
        "half its body": BODY_TIMEOUT_S,
        "idles after a response": KEEP_ALIVE_S,
    }
    for name, deadline in deadlines.items():
        held = results[name]
        assert held.closed and held.seconds < deadline + 1.0, (name, held)
        expected = 200 if name == "idles after a response" else 408
        assert status_of(held.answer) == expected, (name, held.answer[:300])
    body = results["half its body"].answer.partition(b"\r\n\r\n")[2]
    assert json.loads(body)["error"]["type"] == "RequestTimeoutError"


@pytest.mark.timeout(120)
def test_connections_beyond_the_limit_are_refused_and_the_service_recovers(serve: ServeProcess) -> None:
    port = port_of(serve)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        extra = held_for(port, lambda sock: None, bound_s=5.0)
        print(f"\nconnection {MAX_CONNECTIONS + 1}: status {status_of(extra.answer)} after {extra.seconds:.3f} s")
        assert extra.closed and extra.seconds < 1.0 and status_of(extra.answer) == 503, extra
    finally:
        for sock in idle:
            sock.close()
    ok = httpx.post(f"{url_of(serve)}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.timeout(120)
def test_a_lora_name_is_vllms_404_and_reaches_no_worker(serve: ServeProcess) -> None:
    url = url_of(serve)
    before = settled_metrics(url)
    for path, body in (
        ("/v1/completions", {"prompt": "a prompt for an adapter", "max_tokens": 2, "lora_name": "sql-adapter"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "lora_name": "sql-adapter"}),
    ):
        response = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert response.status_code == 404, response.text
        assert response.json() == {
            "error": {
                "message": "The lora adapter `sql-adapter` does not exist.",
                "type": "NotFoundError",
                "param": "lora_name",
                "code": 404,
            }
        }
    after = settled_metrics(url)
    for name in ("kvstore_router_decisions_total", "kvstore_prefix_cache_queries_total"):
        assert metric(after, name) == metric(before, name), name  # never routed, never looked up or hashed


@pytest.mark.timeout(150)
def test_sigterm_with_requests_in_flight_stops_within_the_drain_deadline(serve: ServeProcess) -> None:
    """Last: it stops the module's process. A streamed client that never reads holds its response forever."""
    body = json.dumps({"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    stalled = socket.create_connection(("127.0.0.1", port_of(serve)), timeout=10)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )  # fmt: skip
    plain = threading.Thread(
        target=lambda: httpx.post(
            f"{url_of(serve)}/v1/completions", json={"prompt": "y", "max_tokens": 2000, "ignore_eos": True}, timeout=60
        ),
        daemon=True,
    )
    plain.start()
    time.sleep(1.0)  # both are running on the worker
    try:
        code, took = serve.stop_with(signal.SIGTERM, timeout=60)
        output = serve.text()
        print(
            f"\nSIGTERM with 2 requests in flight: exit {code} after {took:.1f} s (drain deadline {DRAIN_TIMEOUT_S} s)"
        )
        assert code == 0, output
        assert took < DRAIN_TIMEOUT_S + 15.0, took  # the deadline, then the actors' shutdown and Ray's
        assert "Traceback" not in output and "kvstore stopped" in output, output[-6000:]
        survivors = serve.survivors(grace=10.0)
        assert not survivors, f"processes outlived kvstore serve: {survivors}"
        assert serve.arenas() == [], f"arena left behind: {serve.arenas()}"
    finally:
        stalled.close()
