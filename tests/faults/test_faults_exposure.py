"""Isolation and exposure: tenants never share a block; nothing listens beyond loopback unless configured;
the HTTP app's bearer token; CURVE on the event sockets.

Every check runs against real components: KV workers with real pools and
publishers, the router app behind uvicorn, ``kvstore worker`` as a real
process whose listening sockets are read from the kernel (psutil).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq
from faults_helpers import BLOCK, HttpFleet, PoolView, fault_config, pool_state, tokens, wait_for

from kvstore.cli import build_parser
from kvstore.config import EventsConfig
from kvstore.deploy.config import load_config
from kvstore.errors import ConfigError
from kvstore.hashing import to_external
from kvstore.publisher import SNAPSHOT_REQUEST, ZmqEventPublisher
from kvstore.subscriber import EventListener


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


# ---------------------------------------------------------------- tenants


def test_tenants_with_different_cache_salts_never_share_a_block(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    fleet = HttpFleet(["solo"])  # one pool: both tenants' blocks live side by side in it
    view = PoolView()
    tail = EventListener(view, context=ctx)  # an independent subscriber, as `kvstore events tail`
    worker = fleet.workers["solo"]
    ep = worker.event_endpoints()
    tail.add_producer("solo", ep.endpoint, ep.replay_endpoint)
    tail.start()
    try:
        prompt = tokens(random.Random(41), 6 * BLOCK + 3)
        chains = {
            salt: [to_external(h) for h in fleet.service.hasher.hash_blocks(prompt, cache_salt=salt)]
            for salt in ("tenant-a", "tenant-b", None)
        }
        assert all(len(chain) == 6 for chain in chains.values())

        first = fleet.complete(prompt, cache_salt="tenant-a")
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert wait_for(lambda: fleet.route(prompt, cache_salt="tenant-a")["matched_blocks"]["solo"]["GPU"] == 6)

        # The router: the same tokens under another salt (or none) match nothing.
        for other in ("tenant-b", None):
            extra = {} if other is None else {"cache_salt": other}
            assert fleet.route(prompt, **extra)["matched_blocks"]["solo"] == {"GPU": 0, "CPU": 0, "STORAGE": 0}
        # The pool: tenant B recomputes everything, though the very same tokens sit in the pool.
        second = fleet.complete(prompt, cache_salt="tenant-b")
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = fleet.complete(prompt, cache_salt="tenant-a")
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK  # the cache works

        cached = pool_state(worker)
        a, b = set(chains["tenant-a"]), set(chains["tenant-b"])
        assert not a & b and not a & set(chains[None]) and not b & set(chains[None])
        assert a <= set(cached) and b <= set(cached), "each tenant's chain is cached under its own hashes"
        assert all(cached[h] == 1 for h in a | b), "one block per tenant per position: no block is shared"
        # The events: each tenant's blocks were announced under its own hashes, never the other's.
        assert wait_for(lambda: a | b <= view.stored.get("solo", set()))
        assert wait_for(lambda: view.view("solo") == pool_state(worker))
        assert not set(chains[None]) & view.stored["solo"]
        worker.check_invariants()
    finally:
        tail.close()
        fleet.close()


# ---------------------------------------------------------------- exposure


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_every_socket_binds_loopback_by_default() -> None:
    # The defaults, written once in the config tree.
    config = load_config(env={})
    assert config.events.endpoint.startswith("tcp://127.0.0.1:")
    assert config.events.replay_endpoint.startswith("tcp://127.0.0.1:")
    assert config.router.host == "127.0.0.1"
    parser = build_parser()
    for argv in (["serve"], ["worker"], ["router", "--config", "x.toml"]):
        host = parser.parse_args(argv).host
        assert host in (None, "127.0.0.1"), (argv, host)  # None: router.host, 127.0.0.1
    assert EventsConfig().curve_secret_key == ""  # CURVE is opt-in; loopback is what keeps plain TCP private

    # A real `kvstore worker` process with no host flags: every socket it listens on is loopback.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "worker", "--name", "exposed", "--port", "0",
         "--set", "worker.device=\"cpu\""],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stderr is not None
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
    try:
        # PUB + ROUTER (bound in the constructor) and the HTTP socket, and the banner printed.
        assert wait_for(
            lambda: (
                (len(listening_addresses(proc.pid)) >= 3 and any("at http://" in line for line in lines))
                or proc.poll() is not None
            ),
            timeout=60,
        )
        assert proc.poll() is None, "".join(lines)
        addresses = listening_addresses(proc.pid)
        assert len(addresses) == 3, addresses
        assert {ip for ip, _ in addresses} == {"127.0.0.1"}, addresses
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    # --port 0: the banner names the port the front really listens on (it once printed ":0").
    banner = "".join(lines)
    printed = re.search(r"at http://127\.0\.0\.1:(\d+)", banner)
    assert printed and int(printed.group(1)) in {port for _, port in addresses}, banner

    # In-process components: the publishers and the uvicorn servers.
    fleet = HttpFleet(["bound"])
    try:
        ep = fleet.workers["bound"].event_endpoints()
        assert ep.endpoint.startswith("tcp://127.0.0.1:") and ep.replay_endpoint.startswith("tcp://127.0.0.1:")
        for server in (fleet.router, fleet.servers["bound"]):
            for sock in server.server.servers[0].sockets:
                assert sock.getsockname()[0] == "127.0.0.1"
    finally:
        fleet.close()


def test_bearer_token_is_required_when_configured() -> None:
    fleet = HttpFleet(["guarded"], fault_config(router={"api_key": "s3cret-token"}))
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 2}
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"},
                        {"Authorization": "Bearer s3cret-tokenX"}, {"Authorization": "Basic czNjcmV0"}):  # fmt: skip
            for method, path in (("POST", "/v1/completions"), ("POST", "/route"), ("GET", "/workers"),
                                 ("GET", "/metrics")):  # fmt: skip
                response = fleet.client.request(method, path, json=body if method == "POST" else None, headers=headers)
                assert response.status_code == 401, (headers, path, response.text)
                error = response.json()["error"]
                assert error["type"] == "AuthenticationError" and error["message"]
        for probe in ("/healthz", "/health"):  # the liveness probe stays open, under vLLM's name too
            answer = fleet.client.get(probe)
            assert answer.status_code == 200 and answer.json()["healthy_replicas"] >= 1, (probe, answer.text)
        auth = {"Authorization": "Bearer s3cret-token"}
        response = fleet.client.post("/v1/completions", json=body, headers=auth)
        assert response.status_code == 200, response.text
        assert fleet.client.get("/workers", headers=auth).status_code == 200
    finally:
        fleet.close()


# ------------------------------------------------------------------ CURVE


def received_nothing(listener: EventListener, view: PoolView) -> bool:
    return view.batches == 0 and all(h.batches == 0 for h in listener.health())


def test_curve_event_stream_reaches_only_subscribers_with_the_server_key(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    config = fault_config(events={"curve_secret_key": secret, "curve_public_key": public})
    # The router's subscription (ProducerSpec.curve_server_key) is CURVE; so is one independent subscriber.
    fleet = HttpFleet(["sealed"], config, curve_server_key=public)
    worker = fleet.workers["sealed"]
    ep = worker.event_endpoints()
    outsiders: dict[str, tuple[EventListener, PoolView]] = {}
    for name, key in (("plain", None), ("wrong-key", zmq.curve_keypair()[0].decode())):
        view = PoolView()
        listener = EventListener(view, context=ctx, sync_timeout_s=0.5)
        listener.add_producer("sealed", ep.endpoint, ep.replay_endpoint, curve_server_key=key)
        outsiders[name] = (listener.start(), view)
    raw_sub = ctx.socket(zmq.SUB)
    raw_sub.setsockopt(zmq.SUBSCRIBE, b"")
    raw_sub.connect(ep.endpoint)
    insider_view = PoolView()
    insider = EventListener(insider_view, context=ctx, sync_timeout_s=2.0)
    try:
        time.sleep(0.3)  # give every subscriber time to (try to) connect before the first event
        prompt = tokens(random.Random(43), 5 * BLOCK + 1)
        response = fleet.complete(prompt)
        assert response.status_code == 200, response.text
        # The router hears the CURVE stream: the blocks are routable.
        assert wait_for(lambda: fleet.route(prompt)["matched_blocks"]["sealed"]["GPU"] == 5, timeout=10)
        # A late CURVE subscriber recovers over the CURVE ROUTER socket (replay) to the pool's exact state,
        # once live traffic tells it what it missed.
        insider.add_producer("sealed", ep.endpoint, ep.replay_endpoint, curve_server_key=public)
        insider.start()
        time.sleep(0.3)
        assert fleet.complete(tokens(random.Random(44), 3 * BLOCK)).status_code == 200
        assert wait_for(lambda: insider_view.view("sealed") == pool_state(worker), timeout=10)
        assert insider.health()[0].replays + insider.health()[0].snapshots >= 1

        # Without the key -- plain ZeroMQ, or CURVE with the wrong server key -- nothing arrives,
        # neither live (PUB) nor by replay/snapshot (ROUTER): the handshake never completes.
        for name, (listener, view) in outsiders.items():
            assert received_nothing(listener, view), name
        assert raw_sub.poll(200) == 0
        raw_dealer = ctx.socket(zmq.DEALER)
        raw_dealer.setsockopt(zmq.LINGER, 0)
        raw_dealer.connect(ep.replay_endpoint)
        with contextlib.suppress(zmq.Again):  # no peer ever becomes ready: the send may not even queue
            raw_dealer.send_multipart([b"", SNAPSHOT_REQUEST], zmq.NOBLOCK)
        assert raw_dealer.poll(500) == 0
        raw_dealer.close(linger=0)
        # Only the key holders' requests ever reached the ROUTER socket.
        publisher = worker.publisher
        assert isinstance(publisher, ZmqEventPublisher)
        stats = publisher.stats
        served = stats.replays_served + stats.snapshots_served
        router_side = fleet.service.listener.health()[0]
        assert served == sum(h.replays + h.snapshots for h in (insider.health()[0], router_side))
        assert stats.bad_requests == 0
    finally:
        raw_sub.close(linger=0)
        insider.close()
        for listener, _ in outsiders.values():
            listener.close()
        fleet.close()


def test_curve_keys_are_validated_on_load() -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    with pytest.raises(ConfigError, match="set together"):
        load_config(env={}, overrides=[f'events.curve_secret_key="{secret}"'])
    with pytest.raises(ConfigError, match="40-character Z85"):
        load_config(env={}, overrides=['events.curve_secret_key="short"', f'events.curve_public_key="{public}"'])
    listener = EventListener(PoolView())
    with pytest.raises(ConfigError, match="Z85 public key"):
        listener.add_producer("p", "tcp://127.0.0.1:1", curve_server_key="not-a-key")
