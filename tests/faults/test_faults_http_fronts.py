"""The fronts of ``kvstore router`` and ``kvstore worker``: slow clients, bounded bodies, LoRA names.

A KV worker behind its OpenAI front and a router forwarding to it (the
``kvstore router`` path, with an API key), all in this process on 127.0.0.1.
The slow-client checks run them under the HTTP server both commands run
(:func:`kvstore.deploy.http_server.server_config`); `kvstore serve`'s front is
checked as a real process in test_faults_serve_process.py.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from faults_helpers import BLOCK, HttpFleet, fault_config, pool_state, tokens
from slow_clients import all_held, status_of

from kvstore.deploy.http_server import server_config
from kvstore.router.app import create_app
from kvstore.router.config import RouterConfig
from kvstore.workers.http import create_worker_app

API_KEY = "front-secret"
HEADER_TIMEOUT_S = 0.8
BODY_TIMEOUT_S = 1.2
KEEP_ALIVE_S = 0.8


class GuardedServer:
    """``app`` under the HTTP server of the kvstore commands, on a free loopback port, in a thread."""

    def __init__(self, app: Any, limits: RouterConfig) -> None:
        self.server = uvicorn.Server(server_config(app, limits, host="127.0.0.1", port=0, lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=20)


@pytest.fixture(scope="module")
def fleet() -> Iterator[HttpFleet]:
    config = fault_config(
        router={
            "api_key": API_KEY,
            "header_timeout_s": HEADER_TIMEOUT_S,
            "body_timeout_s": BODY_TIMEOUT_S,
            "keep_alive_s": KEEP_ALIVE_S,
        }
    )
    fleet = HttpFleet(["front"], config)
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("front", ["router", "worker"])
def test_slow_and_idle_connections_are_closed_on_both_fronts(fleet: HttpFleet, front: str) -> None:
    limits = fleet.config.router
    worker = fleet.workers["front"]
    app = (
        create_app(fleet.service, manage_lifecycle=False)
        if front == "router"
        else create_worker_app(worker, bounds=limits.body_bounds())
    )
    server = GuardedServer(app, limits)
    try:
        results = all_held(server.port, bound_s=6.0)
    finally:
        server.stop()
    for name, held in sorted(results.items()):
        print(f"\n{front} front, a client that {name}: closed after {held.seconds:.2f} s", end="")
    print()
    deadlines = {"idles after a response": KEEP_ALIVE_S, "half its body": BODY_TIMEOUT_S}
    for name, held in results.items():
        assert held.closed and held.seconds < deadlines.get(name, HEADER_TIMEOUT_S) + 1.0, (name, held)
        # The router checks the key as soon as the headers are in: a 401, and the connection is still closed.
        complete_headers = name in ("idles after a response", "half its body")
        expected = 401 if front == "router" and complete_headers else 200 if name == "idles after a response" else 408
        assert status_of(held.answer) == expected, (name, held.answer[:200])


def _post(fleet: HttpFleet, url: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=30)


@pytest.mark.timeout(60)
def test_a_lora_name_is_a_404_from_the_worker_and_through_the_router_and_is_never_hashed(fleet: HttpFleet) -> None:
    worker = fleet.workers["front"]
    prompt = tokens(random.Random(3), 4 * BLOCK)
    before = pool_state(worker)
    for url in (fleet.servers["front"].url, fleet.router.url):
        response = _post(fleet, url, {"prompt": prompt, "max_tokens": 2, "lora_name": "sql-adapter"})
        assert response.status_code == 404, response.text
        assert response.json()["error"] == {
            "message": "The lora adapter `sql-adapter` does not exist.",
            "type": "NotFoundError",
            "param": "lora_name",
            "code": 404,
        }
    assert pool_state(worker) == before  # nothing ran, nothing was cached under the adapter's hashes
    assert _post(fleet, fleet.servers["front"].url, {"prompt": prompt, "max_tokens": 2}).status_code == 200


@pytest.mark.timeout(60)
def test_bodies_are_bounded_before_decoding_and_strings_are_not_structure(fleet: HttpFleet) -> None:
    limits = fleet.config.router
    deep = b'{"prompt": ' + b"[" * (limits.max_json_depth + 1) + b"1" + b"]" * (limits.max_json_depth + 1) + b"}"
    wide = b'{"prompt": [' + b",".join([b"[]"] * (limits.max_json_containers + 1)) + b"]}"
    many = b'{"prompt": [' + b",".join([b"7"] * (limits.max_json_values + 1)) + b"]}"
    salt = {"prompt": [1, 2, 3], "cache_salt": "s" * 1025}
    for url in (fleet.servers["front"].url, fleet.router.url):
        for body, says in ((deep, "levels deep"), (wide, "arrays and objects"), (many, "values")):
            response = _post(fleet, url, body)
            assert response.status_code == 400 and says in response.json()["error"]["message"], response.text
    # A long cache_salt is refused by the worker (a name of at most 1024 characters); the router forwards it.
    response = _post(fleet, fleet.router.url, salt)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
    # Brackets and commas inside a string are text: a prompt made of them is served.
    text = "[{" * 200 + ',\\"' * 100
    response = _post(fleet, fleet.servers["front"].url, {"prompt": text, "max_tokens": 1})
    assert response.status_code == 200, response.text
