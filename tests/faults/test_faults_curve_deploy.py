"""CURVE on the event sockets through the deployment paths, not only the library.

With ``events.curve_secret_key`` / ``curve_public_key`` set, every publisher
of a ``kvstore serve`` deployment (workers and tier actors) accepts only
subscribers that present its public key. The router the launcher builds
must present it (or it would hear nothing and route blind); so must
``kvstore events tail --curve-server-key``; ``[[router.replicas]]`` takes it
per replica for ``kvstore router``.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import msgspec
import pytest
import ray
import zmq
from faults_helpers import BLOCK, tokens, wait_for

from kvstore.cli import main
from kvstore.deploy.config import config_from_dict, load_config
from kvstore.deploy.launcher import build_service, place_workers
from kvstore.deploy.router_cli import build_router
from kvstore.errors import ConfigError
from kvstore.router.app import create_app
from tests.http_servers import ServerThread


@pytest.mark.ray
def test_serve_deployment_with_curve_routes_on_its_events_and_tail_needs_the_key(
    ray_session: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    config = config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 128},
            "events": {"curve_secret_key": secret, "curve_public_key": public},
            "worker": {"device": "cpu"},
            "router": {"health_interval_s": 0.2},
            "tiers": {"enabled": False},
        }
    )
    (worker,) = place_workers(config, 1, start_index=900)
    service = build_service(config, [worker])
    server = ServerThread(create_app(service)).start()
    client = httpx.Client(base_url=server.url, timeout=60)
    try:
        prompt = tokens(random.Random(5), 6 * BLOCK + 1)
        first = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert first.status_code == 200, first.text

        def routed_blocks() -> int:
            matched = client.post("/route", json={"prompt": prompt, "max_tokens": 1}).json()["matched_blocks"]
            return int(matched[worker.name]["GPU"])

        assert wait_for(lambda: routed_blocks() == 6, timeout=15), "the router heard nothing over CURVE"
        assert service.listener.health()[0].decode_errors == 0

        endpoint, replay = worker.endpoint, worker.replay_endpoint
        tail = ["events", "tail", "--endpoint", endpoint, "--replay-endpoint", replay]
        assert main([*tail, "--curve-server-key", public, "--count", "1", "--duration", "20"]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        assert json.loads(line)["type"] == "BlockStored"
        assert main([*tail, "--duration", "1.5"]) == 0  # no key: the handshake never completes, nothing arrives
        assert capsys.readouterr().out == ""
    finally:
        client.close()
        server.stop()
        ray.get(worker.handle.shutdown.remote(), timeout=30)
        ray.kill(worker.handle, no_restart=True)


def test_router_replicas_take_a_curve_key_and_reject_a_bad_one() -> None:
    public, _ = (key.decode() for key in zmq.curve_keypair())
    base = msgspec.to_builtins(config_from_dict({}))
    replica = {"name": "vllm-0", "url": "http://127.0.0.1:9", "events": "tcp://127.0.0.1:9", "curve_server_key": public}
    config = config_from_dict({**base, "router": {**base["router"], "replicas": [replica]}})
    service = build_router(config)
    try:
        assert service.replica_names() == ["vllm-0"]
        assert service._replicas["vllm-0"].spec.events.curve_server_key == public  # what the listener is given
    finally:
        service.listener.close()
    with pytest.raises(ConfigError, match="curve_server_key"):
        config_from_dict({**base, "router": {**base["router"], "replicas": [{**replica, "curve_server_key": "x"}]}})
    with pytest.raises(ConfigError, match="curve_server_key"):
        load_config(env={}, overrides=['router.replicas=[{name="a", url="u", events="e", curve_server_key="short"}]'])
