"""The router's HTTP front end to end, over a plain-HTTP fleet (no Ray).

Two real replicas -- each a KVWorker (real model, real paged pool) behind the
OpenAI-compatible front of ``kvstore worker``, publishing real KV events on
ZeroMQ -- and the router app built by ``kvstore router``'s own code, all on
127.0.0.1 with free ports. This is the deployment of a vLLM fleet behind
``kvstore router``, with our workers standing in for vLLM.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from kvstore.deploy.config import Config, config_from_dict
from kvstore.deploy.router_cli import build_router
from kvstore.hashing import to_external
from kvstore.router.app import create_app
from kvstore.router.config import ExternalReplica
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests.http_servers import ServerThread
from tests.router.router_helpers import wait_for

BLOCK = 16


def base_config(**router: Any) -> Config:
    return config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 256},
            "worker": {"device": "cpu", "max_context": 1024},
            "router": {"health_interval_s": 0.2, "unhealthy_after": 1, **router},
        }
    )


class Fleet:
    def __init__(self, names: list[str], **router: Any) -> None:
        config = base_config()
        self.workers = {name: KVWorker(name, config) for name in names}
        self.servers = {name: ServerThread(create_worker_app(w)).start() for name, w in self.workers.items()}
        replicas = []
        for name, worker in self.workers.items():
            ep = worker.event_endpoints()
            replicas.append(
                msgspec.to_builtins(
                    ExternalReplica(
                        name=name, url=self.servers[name].url, events=ep.endpoint, replay=ep.replay_endpoint
                    )
                )
            )
        router_section = {**msgspec.to_builtins(config.router), "replicas": replicas, **router}
        router_config = config_from_dict({**msgspec.to_builtins(config), "router": router_section})
        self.service = build_router(router_config)
        self.router = ServerThread(create_app(self.service)).start()
        self.client = httpx.Client(base_url=self.router.url, timeout=60)

    def kill(self, name: str) -> None:
        self.servers[name].stop()
        self.workers[name].shutdown()

    def close(self) -> None:
        self.client.close()
        self.router.stop()
        for name, server in self.servers.items():
            server.stop()
            self.workers[name].shutdown()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(["a", "b"], vocab_size=512, max_context=1024, tokenizer="bytes")
    yield f
    f.close()


def complete(fleet: Fleet, prompt: Any, **extra: Any) -> httpx.Response:
    return fleet.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, **extra})


def test_shared_prefix_is_routed_to_the_replica_that_cached_it(fleet: Fleet) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(512) for _ in range(10 * BLOCK)]
    first = complete(fleet, [*prefix, *(rng.randrange(512) for _ in range(20))])
    assert first.status_code == 200, first.text
    body = first.json()
    owner = body["kvstore"]["replica"]
    assert body["usage"]["prompt_tokens"] == 10 * BLOCK + 20
    assert len(body["choices"][0]["token_ids"]) == 4

    # The router learns of the stored blocks from the owner's event stream.
    probe = {"prompt": [*prefix, 1, 2, 3], "max_tokens": 4}
    assert wait_for(lambda: fleet.client.post("/route", json=probe).json()["matched_blocks"][owner]["GPU"] >= 10)
    decision = fleet.client.post("/route", json=probe).json()
    assert decision["replica"] == owner
    assert set(decision["scores"]) == {"a", "b"}
    assert decision["scores"][owner] < min(v for k, v in decision["scores"].items() if k != owner)

    second = complete(fleet, [*prefix, 9, 9, 9, 9, 9])
    assert second.status_code == 200, second.text
    body = second.json()
    assert body["kvstore"]["replica"] == owner
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK
    assert body["kvstore"]["cached_tokens"]["GPU"] == 10 * BLOCK


def test_text_prompts_use_the_byte_tokenizer(fleet: Fleet) -> None:
    response = complete(fleet, "hello, kvstore")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(b"hello, kvstore")


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": "", "max_tokens": 4}, "prompt", "must not be empty"),
        ({"prompt": [], "max_tokens": 4}, "prompt", "must not be empty"),
        ({"prompt": [1, 600], "max_tokens": 4}, "prompt", "out of range"),
        ({"prompt": [1, -3], "max_tokens": 4}, "prompt", "out of range"),
        ({"prompt": [1] * 1020, "max_tokens": 8}, "max_tokens", "exceeds the model's context"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "must be >= 1"),
        ({"prompt": [1, 2], "max_tokens": -5}, "max_tokens", "must be >= 1"),
        ({"prompt": [1, 2], "max_tokens": "many"}, "max_tokens", "Expected `int"),
        ({"prompt": 42, "max_tokens": 4}, "prompt", "Expected `str | array`"),
        ({"prompt": [1, "x"], "max_tokens": 4}, "prompt", "list of integer token ids"),
        ({"prompt": [[1, 2], [[3]]], "max_tokens": 4}, "prompt[1]", "a batch of prompts inside a batch"),
        ({"prompt": [1, 2], "max_tokens": 4, "bogus": 1}, "bogus", "unknown field `bogus`"),
        ({"max_tokens": 4}, None, "missing required field `prompt`"),
    ],
)
def test_bad_input_gets_the_replicas_own_400_passed_through(
    fleet: Fleet, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    """The router forwards the body as sent, so the replica judges it and its answer comes back unchanged."""
    response = complete_raw(fleet, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    assert error["type"] == "BadRequestError" and error["param"] == param
    assert response.headers["x-kvstore-replica"] in ("a", "b")


def test_route_refuses_only_what_it_cannot_read(fleet: Fleet) -> None:
    response = fleet.client.post("/route", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]
    for body in ({"max_tokens": 4}, {"prompt": 42}, {"messages": []}, {"prompt": [1, 600]}):
        decision = fleet.client.post("/route", json=body)  # routed on load: the replica will judge the body
        assert decision.status_code == 200 and decision.json()["replica"] in ("a", "b"), decision.text
    # A completion is read as one whatever its strings say ("messages" as a value is no chat).
    decision = fleet.client.post("/route", json={"prompt": "hi there", "cache_salt": "messages"}).json()
    assert decision["prompt_tokens"] == len(b"hi there")


def complete_raw(fleet: Fleet, body: dict[str, Any]) -> httpx.Response:
    return fleet.client.post("/v1/completions", json=body)


def test_without_configured_limits_the_replica_rejects_and_its_message_is_returned() -> None:
    fleet = Fleet(["solo"])  # router.vocab_size / max_context unset: the router cannot check ids
    try:
        response = complete(fleet, [1, 600])
        assert response.status_code == 400
        assert "600" in response.json()["error"]["message"]
        assert complete(fleet, [1, 2]).status_code == 200  # the replica keeps serving
    finally:
        fleet.close()


def test_malformed_and_oversized_bodies(fleet: Fleet) -> None:
    response = fleet.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    response = fleet.client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "JSON object" in response.json()["error"]["message"]
    huge = b'{"prompt": "' + b"x" * (5 << 20) + b'"}'
    response = fleet.client.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert "larger than" in response.json()["error"]["message"]


def test_observability_endpoints(fleet: Fleet) -> None:
    assert complete(fleet, [5] * 40).status_code == 200
    health = fleet.client.get("/healthz")
    assert health.status_code == 200 and health.json()["healthy_replicas"] == 2
    workers = {w["name"]: w for w in fleet.client.get("/workers").json()["workers"]}
    assert set(workers) == {"a", "b"} and all(w["healthy"] for w in workers.values())
    assert all(w["events"] is not None and w["events"]["decode_errors"] == 0 for w in workers.values())
    text = fleet.client.get("/metrics").text
    for name in (
        "kvstore_router_decisions_total",
        "kvstore_router_route_seconds_bucket",
        "kvstore_router_events_total",
        "kvstore_router_event_gaps_total",
        "kvstore_router_decode_errors_total",
        "kvstore_router_requests_total",
        "kvstore_router_cached_tokens_total",
    ):
        assert name in text, name
    # The replicas' own metrics, merged into the router's page (one HELP/TYPE per family).
    assert wait_for(lambda: 'kvstore_gpu_cache_usage_perc{replica="b"}' in fleet.client.get("/metrics").text)
    text = fleet.client.get("/metrics").text
    for replica in ("a", "b"):
        for name in ("kvstore_gpu_cache_usage_perc", "kvstore_prefix_cache_queries_total",
                     "kvstore_prefix_cache_hits_total", "kvstore_preemptions_total"):  # fmt: skip
            assert f'{name}{{replica="{replica}"}}' in text, (name, replica)
    assert text.count("# TYPE kvstore_gpu_cache_usage_perc gauge") == 1


def test_a_dead_replica_is_routed_around_and_dropped_from_the_index() -> None:
    fleet = Fleet(["x", "y"])
    try:
        rng = random.Random(11)
        prefix = [rng.randrange(512) for _ in range(8 * BLOCK)]
        owner = complete(fleet, [*prefix, 1, 2, 3]).json()["kvstore"]["replica"]
        other = "y" if owner == "x" else "x"
        probe = {"prompt": [*prefix, 4], "max_tokens": 2}
        assert wait_for(lambda: fleet.client.post("/route", json=probe).json()["replica"] == owner)
        hashes = [to_external(h) for h in fleet.service.hasher.hash_blocks(prefix)]
        assert fleet.service.index.lookup(hashes)[owner].gpu == 8

        fleet.kill(owner)
        # The next request for that prefix would go to the dead owner: it must be served by the other.
        response = complete(fleet, [*prefix, 4, 5])
        assert response.status_code == 200, response.text
        assert response.json()["kvstore"]["replica"] == other
        # Within seconds the owner is out of routing and its blocks are out of the index.
        assert wait_for(lambda: fleet.client.get("/healthz").json()["healthy_replicas"] == 1, timeout=5)
        decision = fleet.client.post("/route", json=probe).json()
        assert decision["replica"] == other and set(decision["scores"]) == {other}
        assert owner not in fleet.service.index.lookup(hashes), "a dead replica's blocks must leave the index"
    finally:
        fleet.close()


def test_baseline_policies_ignore_the_cache() -> None:
    fleet = Fleet(["p", "q"], vocab_size=512, max_context=1024, policy="round_robin")
    try:
        replicas = [complete(fleet, [7] * 64).json()["kvstore"]["replica"] for _ in range(4)]
        assert replicas in (["p", "q", "p", "q"], ["q", "p", "q", "p"])  # identical prompts, alternating
        fleet.service.config = msgspec.structs.replace(
            fleet.service.config, router=msgspec.structs.replace(fleet.service.config.router, policy="random")
        )
        fleet.service._rng.seed(1)  # deterministic: both replicas must come up within 12 picks
        assert {complete(fleet, [7] * 64).json()["kvstore"]["replica"] for _ in range(12)} == {"p", "q"}
    finally:
        fleet.close()
