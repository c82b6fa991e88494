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
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import ray
import zmq
import zmq.auth
from faults_helpers import BLOCK, tokens, wait_for

from kvstore.cli import main
from kvstore.deploy.config import config_from_dict, load_config
from kvstore.deploy.launcher import build_service, launch, place_workers, router_curve
from kvstore.deploy.router_cli import build_router
from kvstore.errors import ConfigError
from kvstore.router.app import create_app
from tests.http_servers import ServerThread


def router_cert(tmp_path: Path) -> tuple[str, Path]:
    """A certificate pair as zmq.auth writes it: the public key, and the secret file the router is given."""
    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "router")
    public, _ = zmq.auth.load_certificate(public_file)
    return public.decode(), Path(secret_file)


@pytest.mark.ray
@pytest.mark.parametrize("allow_list", [False, True], ids=["any-client", "allow-list"])
def test_serve_deployment_with_curve_routes_on_its_events_and_tail_needs_the_key(
    ray_session: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path, allow_list: bool
) -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    router_public, router_secret_file = router_cert(tmp_path)
    events: dict[str, Any] = {"curve_secret_key": secret, "curve_public_key": public}
    router: dict[str, Any] = {"health_interval_s": 0.2}
    if allow_list:  # only the router's key is listed: it must present it (router.curve_client_cert)
        events["curve_allowed_client_keys"] = [router_public]
        router["curve_client_cert"] = str(router_secret_file)
    config = config_from_dict(
        {
            "cache": {"block_size": BLOCK},
            "pool": {"num_blocks": 128},
            "events": events,
            "worker": {"device": "cpu"},
            "router": router,
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
        keyed = [*tail, f"--curve-server-key={public}"]  # =: a Z85 key may begin with "-"
        if allow_list:
            assert main([*keyed, "--duration", "1.5"]) == 0  # the server's key, but an unlisted client: nothing
            assert capsys.readouterr().out == ""
            keyed += ["--curve-client-cert", str(router_secret_file)]
        assert main([*keyed, "--count", "1", "--duration", "20"]) == 0
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
        bad = 'router.replicas=[{name="a", url="u", events="tcp://h:1", curve_server_key="short"}]'
        load_config(env={}, overrides=[bad])


def test_an_allow_list_without_the_routers_certificate_is_refused_before_anything_starts(tmp_path: Path) -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    router_public, router_secret_file = router_cert(tmp_path)
    other_public, _ = (key.decode() for key in zmq.curve_keypair())
    curve = {"curve_secret_key": secret, "curve_public_key": public}

    def config(events: dict[str, Any], router: dict[str, Any]) -> Any:
        return config_from_dict({"events": events, "router": router, "tiers": {"enabled": False}})

    cases = [
        ({**curve, "curve_allowed_client_keys": [router_public]}, {}, "set router.curve_client_cert"),
        (
            {**curve, "curve_allowed_client_keys": [other_public]},  # the router's key is not the listed one
            {"curve_client_cert": str(router_secret_file)},
            "whose public key is listed",
        ),
        ({}, {"curve_client_cert": str(router_secret_file)}, "events run without CURVE"),
        (curve, {"curve_client_cert": str(tmp_path / "missing.key_secret")}, "router.curve_client_cert: no file"),
        (curve, {"curve_client_cert": str(tmp_path / "router.key")}, "holds no secret key"),
    ]
    for events, router, message in cases:
        with pytest.raises(ConfigError, match=message):
            launch(config(events, router))  # refused before Ray or any actor starts
    keys = router_curve(config({**curve, "curve_allowed_client_keys": [router_public]}, {
        "curve_client_cert": str(router_secret_file)}))  # fmt: skip
    assert keys.server_key == public and keys.client_keys is not None and keys.client_keys.public == router_public


def test_kvstore_router_presents_its_certificate_to_curve_replicas_only(tmp_path: Path) -> None:
    public, _ = (key.decode() for key in zmq.curve_keypair())
    router_public, router_secret_file = router_cert(tmp_path)
    base = msgspec.to_builtins(config_from_dict({}))
    curved = {"name": "a", "url": "http://127.0.0.1:9", "events": "tcp://127.0.0.1:9", "curve_server_key": public}
    plain = {"name": "b", "url": "http://127.0.0.1:9", "events": "tcp://127.0.0.1:8"}
    router = {**base["router"], "curve_client_cert": str(router_secret_file)}
    service = build_router(config_from_dict({**base, "router": {**router, "replicas": [curved, plain]}}))
    try:
        keys = {name: service._replicas[name].spec.events.curve_client_keys for name in ("a", "b")}
        assert keys["a"] is not None and keys["a"].public == router_public and keys["b"] is None
    finally:
        service.listener.close()
    with pytest.raises(ConfigError, match=r"no \[\[router\.replicas\]\] has a curve_server_key"):
        build_router(config_from_dict({**base, "router": {**router, "replicas": [plain]}}))
