"""10,000 malformed HTTP requests, interleaved with valid ones, against a real ``kvstore router`` process.

The router runs as its own process (``python -m kvstore router --config``,
the command an operator runs), in front of two KV workers behind the
OpenAI-compatible front of ``kvstore worker``. It forwards bodies unchanged,
so the replica judges a body's fields and the router only what it must
read itself (JSON, size, content, routes). Every malformed request must get
a 4xx with an OpenAI-style error body naming the problem, from whichever of
the two judged it; every valid one must succeed; the router process's
resident memory must stay bounded (psutil) -- and every socket it listens on
is loopback.

10,000 malformed *event frames* on a live router's stream are tested in
tests/router/test_service_garbage.py.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil
import pytest
from faults_helpers import VOCAB, tokens, wait_for

from kvstore.deploy.config import config_from_dict
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests.http_servers import ServerThread

BAD_REQUESTS = 10_000
VALID_EVERY = 50  # one valid request after every 49 bad ones
MAX_BODY = 64 * 1024
MAX_CONTEXT = 1024
CONCURRENCY = 16
RSS_GROWTH_BOUND = 64 * 1024 * 1024  # after warm-up; a leak of one small object per request would pass 64 MiB fast


ROUTER_JUDGES = frozenset({"bad json", "not an object", "wrong content", "oversized body"})


class Case(NamedTuple):
    kind: str
    method: str
    path: str
    content: bytes | None
    headers: dict[str, str]
    status: int  # what the router must answer
    chunked: bool = False  # send the body without a Content-Length


def _json(body: Any, path: str = "/v1/completions") -> tuple[str, bytes]:
    return path, json.dumps(body).encode()


def bad_cases(rng: random.Random) -> list[Case]:
    """One of each kind of malformed request, with random variations; the caller cycles through them.

    What the router itself must read (JSON, an object, size, content) goes to /v1/completions or /route;
    what only the replica judges (a field's type or range) goes to /v1/completions.
    """
    router_path = rng.choice(["/v1/completions", "/route"])
    t = tokens(rng, rng.randint(1, 30))
    js = {"content-type": "application/json"}
    cases: list[Case] = []

    def add(kind: str, body: Any, status: int = 400, headers: dict[str, str] | None = None) -> None:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        path = router_path if kind in ROUTER_JUDGES else "/v1/completions"
        cases.append(Case(kind, "POST", path, content, headers or js, status))

    # Not JSON at all, or not a JSON object.
    add("bad json", b'{"prompt": [1, 2' + rng.randbytes(rng.randint(0, 8)).replace(b"]", b"").replace(b"}", b""))
    add("bad json", b"")
    add("bad json", b'{"prompt": [1], "temperature": NaN}')
    add("bad json", b'{"prompt": "\xff\xfe\xfd"}')  # invalid UTF-8 inside a string
    add("bad json", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")  # nesting deeper than any parser stack
    add("not an object", rng.choice([b"[1, 2]", b'"prompt"', b"42", b"null", b"true"]))
    # Wrong types, field by field.
    add("wrong type", {"prompt": 42, "max_tokens": 4})
    add("wrong type", {"prompt": {"text": "hi"}, "max_tokens": 4})
    add("wrong type", {"prompt": [*t, "x"], "max_tokens": 4})
    add("wrong type", {"prompt": [1.5, 2.5], "max_tokens": 4})
    add("wrong type", {"prompt": [True, False], "max_tokens": 4})
    add("wrong type", {"prompt": t, "max_tokens": "many"})
    add("wrong type", {"prompt": t, "max_tokens": 2.5})
    add("wrong type", {"prompt": t, "cache_salt": 7})
    add("wrong type", {"prompt": t, "temperature": "hot"})
    add("wrong type", {"prompt": t, "stop": {"a": 1}})
    # Out of range: token ids, numbers, context.
    add("out of range", {"prompt": [*t, VOCAB + rng.randrange(10_000)], "max_tokens": 4})
    add("out of range", {"prompt": [*t, -1 - rng.randrange(100)], "max_tokens": 4})
    add("out of range", {"prompt": [10**30], "max_tokens": 4})
    add("out of range", b'{"prompt": [1e400], "max_tokens": 4}')
    add("huge prompt", {"prompt": tokens(rng, MAX_CONTEXT + rng.randint(0, 500)), "max_tokens": 4})
    add("huge prompt", {"prompt": "x" * (MAX_CONTEXT + rng.randint(0, 4000)), "max_tokens": 4})
    add("huge prompt", {"prompt": t, "max_tokens": MAX_CONTEXT + rng.randint(0, 10**9)})
    add("non-positive max_tokens", {"prompt": t, "max_tokens": -rng.randint(1, 10**6)})
    add("non-positive max_tokens", {"prompt": t, "max_tokens": 0})
    add("empty prompt", {"prompt": rng.choice(["", []]), "max_tokens": 4})
    add("unknown field", {"prompt": t, "max_tokens": 4, rng.choice(["bogus", "temperture", "Prompt"]): 1})
    add("bad batch", {"prompt": [[t], t[:1]], "max_tokens": 4})  # a batch inside a batch
    add("bad batch", {"prompt": ["hello", 5], "max_tokens": 4})  # strings and ids mixed
    add("bad batch", {"prompt": ["hello", ""], "max_tokens": 4})  # an empty prompt in a batch
    add("unsupported", {"prompt": t, "max_tokens": 4, "use_beam_search": True})
    add("unsupported", {"prompt": t, "max_tokens": 4, "best_of": rng.randint(2, 8)})
    add("unsupported", {"prompt": t, "max_tokens": 4, "response_format": {"type": "structural_tag", "format": {}}})
    add("bad structural tag", {"prompt": t, "max_tokens": 4, "response_format": {"type": "structural_tag"}})
    add("unsupported", {"prompt": t, "max_tokens": 4, "n": 100})
    # Wrong content: not JSON, whatever the content type claims.
    add("wrong content", b"prompt=hello&max_tokens=4", headers={"content-type": "application/x-www-form-urlencoded"})
    add("wrong content", b"hello there", headers={"content-type": "text/plain"})
    add("wrong content", rng.randbytes(rng.randint(1, 256)), headers={"content-type": "application/octet-stream"})
    add("wrong content", b"\x82\xa6prompt\x91\x01\xaamax_tokens\x04", headers={"content-type": "application/msgpack"})
    # Too large: declared up front, or streamed without a Content-Length.
    big = b'{"prompt": "' + b"a" * (MAX_BODY + rng.randint(1, 4096)) + b'"}'
    add("oversized body", big, status=413)
    cases.append(Case("oversized body (chunked)", "POST", router_path, big, js, 413, chunked=True))
    # Routes and methods that do not exist.
    cases.append(Case("wrong method", "GET", "/v1/completions", None, {}, 405))
    cases.append(Case("wrong method", "PUT", "/route", b"{}", js, 405))
    cases.append(Case("wrong path", "POST", "/v1/embeddings", b'{"input": "x"}', js, 404))
    cases.append(Case("empty chat", "POST", "/v1/chat/completions", b'{"messages": []}', js, 400))
    return cases


def valid_case(rng: random.Random) -> Case:
    body: dict[str, Any] = {"prompt": tokens(rng, rng.randint(8, 80)), "max_tokens": rng.randint(1, 3)}
    if rng.random() < 0.2:
        body["prompt"] = "a valid text prompt " + str(rng.randrange(10**6))
    if rng.random() < 0.2:
        body["cache_salt"] = f"tenant-{rng.randrange(3)}"
    path, content = _json(body)
    return Case("valid", "POST", path, content, {"content-type": "application/json"}, 200)


class RouterProcess(NamedTuple):
    proc: subprocess.Popen[str]
    url: str
    port: int


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def router_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    config = config_from_dict({"worker": {"device": "cpu", "max_context": MAX_CONTEXT}, "pool": {"num_blocks": 256}})
    workers = {name: KVWorker(name, config) for name in ("bad-a", "bad-b")}
    servers = {name: ServerThread(create_worker_app(w)).start() for name, w in workers.items()}
    toml = Path(tmp_path_factory.mktemp("router")) / "router.toml"
    lines = [
        "[worker]", f"max_context = {MAX_CONTEXT}",
        "[router]", f"vocab_size = {VOCAB}", f"max_context = {MAX_CONTEXT}", f"max_body_bytes = {MAX_BODY}",
        'tokenizer = "bytes"',
        "health_interval_s = 0.5",
    ]  # fmt: skip
    for name, worker in workers.items():
        ep = worker.event_endpoints()
        lines += [
            "[[router.replicas]]", f'name = "{name}"', f'url = "{servers[name].url}"',
            f'events = "{ep.endpoint}"', f'replay = "{ep.replay_endpoint}"',
        ]  # fmt: skip
    toml.write_text("\n".join(lines) + "\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "router", "--config", str(toml), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=1).json().get("healthy_replicas") == 2
        except httpx.HTTPError:
            return proc.poll() is not None

    try:
        assert wait_for(ready, timeout=60, interval=0.1)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield RouterProcess(proc, url, port)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        for name, server in servers.items():
            server.stop()
            workers[name].shutdown()


def send(conn: http.client.HTTPConnection, case: Case) -> tuple[int, Any]:
    """One request on a keep-alive connection (reopened after a response that closes it)."""
    body: Any = case.content
    if case.chunked and body is not None:
        data = body
        body = (data[start : start + 8192] for start in range(0, len(data), 8192))  # no Content-Length
    try:
        conn.request(case.method, case.path, body=body, headers=case.headers, encode_chunked=case.chunked)
        response = conn.getresponse()
        payload = response.read()
    except (OSError, http.client.HTTPException) as exc:  # the router dropped the connection: a wrong answer
        conn.close()
        return -1, f"{type(exc).__name__}: {exc}"
    try:
        return response.status, json.loads(payload)
    except ValueError:
        return response.status, payload[:200]


def is_openai_error(body: Any, status: int) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    return isinstance(error.get("message"), str) and bool(error["message"]) and error.get("code") == status


def flood(port: int, cases: list[Case], rss: list[int], pid: int) -> list[tuple[Case, int, Any]]:
    """Send every case from CONCURRENCY threads, one keep-alive connection each; sample the router's RSS.

    A plain http.client client: the flood measures the router, not the client library.
    """
    process = psutil.Process(pid)
    local = threading.local()

    def one(item: tuple[int, Case]) -> tuple[Case, int, Any]:
        i, case = item
        if i % 500 == 0:
            rss.append(process.memory_info().rss)
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        return (case, *send(local.conn, case))

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, enumerate(cases), timeout=300))
    rss.append(process.memory_info().rss)
    return results


def test_ten_thousand_malformed_requests_get_4xx_and_valid_ones_succeed(router_process: RouterProcess) -> None:
    rng = random.Random(2024)
    cases: list[Case] = []
    bad = 0
    templates: list[Case] = []
    while bad < BAD_REQUESTS:
        if len(cases) % VALID_EVERY == VALID_EVERY - 1:
            cases.append(valid_case(rng))
            continue
        if not templates:
            templates = bad_cases(rng)
        cases.append(templates.pop())
        bad += 1
    rss: list[int] = []
    router = psutil.Process(router_process.proc.pid)
    cpu_before, started = sum(router.cpu_times()[:2]), time.monotonic()
    results = flood(router_process.port, cases, rss, router.pid)
    cpu_s, wall_s = sum(router.cpu_times()[:2]) - cpu_before, time.monotonic() - started
    assert len(results) == len(cases)

    wrong = [(c.kind, c.path, status, str(body)[:200]) for c, status, body in results
             if status != c.status or (c.status != 200 and not is_openai_error(body, status))]  # fmt: skip
    kinds = Counter(c.kind for c, _, _ in results)
    growth = rss[-1] - min(rss[1:]) if len(rss) > 2 else 0
    print(
        f"\nbad-input flood: {sum(n for k, n in kinds.items() if k != 'valid')} malformed + {kinds['valid']} valid "
        f"requests, {len(kinds) - 1} kinds; router RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB "
        f"(max {max(rss) / 2**20:.1f}); growth after warm-up {growth / 2**20:.1f} MiB; {wall_s:.1f} s, "
        f"router CPU {1000 * cpu_s / len(cases):.2f} ms per request"
    )
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[:5]}"
    for case, _, body in results:
        if case.kind == "valid":
            assert len(body["choices"][0]["token_ids"]) == json.loads(case.content or b"{}")["max_tokens"]
    assert growth < RSS_GROWTH_BOUND
    assert router_process.proc.poll() is None, "the router process died"


def test_router_process_listens_only_on_loopback(router_process: RouterProcess) -> None:
    listening = [
        c.laddr for c in psutil.Process(router_process.proc.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]  # fmt: skip
    assert listening and {addr.ip for addr in listening} == {"127.0.0.1"}, listening
