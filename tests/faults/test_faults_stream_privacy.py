"""Who can read a tenant's prompt from the event stream.

``BlockStored`` carries the token ids of every block it announces, so anyone
who can subscribe (``kvstore events tail``) reads every tenant's prompts --
salted or not. Two protections, each against real workers and real sockets:

- ``events.include_token_ids = false`` publishes hashes only; the router,
  whose index needs only the hashes of our own producers, still routes.
- ``events.curve_allowed_client_keys`` (CURVE + ZAP): only subscribers whose
  client public key is listed can subscribe or replay -- a subscriber that
  holds the server key but an unlisted client key receives nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth
from faults_helpers import BLOCK, HttpFleet, PoolView, fault_config, pool_state, tokens, wait_for

from kvstore.cli import main
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.publisher import SNAPSHOT_REQUEST
from kvstore.subscriber import CurveKeyPair, EventListener
from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def tail(endpoint: str, replay_endpoint: str, seconds: float, *extra: str) -> list[dict[str, object]]:
    """Run ``kvstore events tail`` in this process for ``seconds``; the JSON objects it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        rc = main(["events", "tail", "--endpoint", endpoint, "--replay-endpoint", replay_endpoint,
                   "--duration", str(seconds), *extra])  # fmt: skip
    assert rc == 0
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_hashes_only_events_carry_no_prompt_and_the_router_still_routes() -> None:
    # A replay buffer of 2 batches: a late subscriber recovers by snapshot, the other path events take.
    fleet = HttpFleet(["w"], fault_config(events={"include_token_ids": False, "buffer_batches": 2}))
    worker = fleet.workers["w"]
    ep = worker.event_endpoints()
    try:
        rng = random.Random(71)
        prompts = [tokens(rng, 5 * BLOCK + 1) for _ in range(4)]
        for prompt in prompts:
            response = fleet.complete(prompt, cache_salt="tenant-a")
            assert response.status_code == 200, response.text
        # The router's index holds our producer's hashes without any token id: the prompts route.
        for prompt in prompts:
            assert wait_for(lambda p=prompt: fleet.route(p, cache_salt="tenant-a")["matched_blocks"]["w"]["GPU"] == 5)
        # What anyone who can subscribe sees: hashes, no token ids, by snapshot (late) and live.
        threading.Timer(1.0, lambda: fleet.complete(tokens(rng, 3 * BLOCK + 1), cache_salt="tenant-a")).start()
        records = tail(ep.endpoint, ep.replay_endpoint, 3.0)
        stored = [r for r in records if r.get("type") == "BlockStored"]
        resyncs = [r for r in records if r.get("type") == "Resync"]
        seen = {h for r in stored for h in r["block_hashes"]}  # type: ignore[attr-defined]
        print(f"\nhashes only: tail printed {len(stored)} BlockStored ({len(seen)} hashes, {len(resyncs)} resync), "
              f"token ids in none of them")  # fmt: skip
        assert resyncs and stored, "tail should have recovered the pool by snapshot, then followed it live"
        assert all(r["token_ids"] == [] for r in stored)
        assert set(pool_state(worker)) <= seen
    finally:
        fleet.close()


def cert_files(tmp: Path, name: str) -> tuple[CurveKeyPair, Path]:
    """A client key pair, and the secret certificate file ``events tail --curve-client-cert`` reads."""
    _, secret_file = zmq.auth.create_certificates(str(tmp), name)
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None
    return CurveKeyPair(public.decode(), secret.decode()), Path(secret_file)


def test_curve_allow_list_admits_only_listed_client_keys(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    listed, listed_cert = cert_files(tmp_path, "listed")
    unlisted, unlisted_cert = cert_files(tmp_path, "unlisted")
    config = fault_config(events={"curve_secret_key": secret, "curve_public_key": public,
                                  "curve_allowed_client_keys": [listed.public]})  # fmt: skip
    worker = KVWorker("sealed", config)
    ep = worker.event_endpoints()
    subscribers: dict[str, tuple[EventListener, PoolView]] = {}
    try:
        rng = random.Random(72)
        assert worker.generate(GenerateRequest(tokens(rng, 4 * BLOCK + 1), 1)).cached_tokens == 0
        for name, keys in (("listed", listed), ("unlisted", unlisted), ("own key pair", None)):
            view = PoolView()
            listener = EventListener(view, context=ctx, sync_timeout_s=1.0)
            listener.add_producer("sealed", ep.endpoint, ep.replay_endpoint, curve_server_key=public,
                                  curve_client_keys=keys)  # fmt: skip
            subscribers[name] = (listener.start(), view)
        time.sleep(0.3)
        worker.generate(GenerateRequest(tokens(rng, 3 * BLOCK + 1), 1))
        listed_view = subscribers["listed"][1]
        # The listed client recovers the history (replay over the ROUTER) and follows the live stream.
        assert wait_for(lambda: listed_view.view("sealed") == pool_state(worker), timeout=10)
        # Holding the server key is not enough: the handshake of an unlisted client is refused.
        for name in ("unlisted", "own key pair"):
            listener, view = subscribers[name]
            assert view.batches == 0 and listener.health()[0].batches == 0, name
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.curve_serverkey = public.encode()
        raw.curve_publickey, raw.curve_secretkey = unlisted.public.encode(), unlisted.secret.encode()
        raw.connect(ep.replay_endpoint)
        with contextlib.suppress(zmq.Again):  # the handshake never completes: the send may not even queue
            raw.send_multipart([b"", SNAPSHOT_REQUEST], zmq.NOBLOCK)
        assert raw.poll(500) == 0
        raw.close(linger=0)
        # `kvstore events tail` with the listed client's certificate reads the stream; with another, nothing.
        # The key goes as --curve-server-key=KEY: a Z85 key may begin with "-", which a separate argument
        # would have argparse read as an option.
        got = tail(ep.endpoint, ep.replay_endpoint, 2.0, f"--curve-server-key={public}",
                   "--curve-client-cert", str(listed_cert))  # fmt: skip
        refused = tail(ep.endpoint, ep.replay_endpoint, 1.5, f"--curve-server-key={public}",
                       "--curve-client-cert", str(unlisted_cert))  # fmt: skip
        print(f"\nallow-list: the listed subscriber holds {sum(listed_view.view('sealed').values())} blocks; "
              f"unlisted ones 0; tail printed {len(got)} events with the listed certificate, {len(refused)} "
              f"with another")  # fmt: skip
        assert any(r.get("type") == "BlockStored" for r in got)
        assert refused == []
    finally:
        for listener, _ in subscribers.values():
            listener.close()
        worker.shutdown()


def test_allow_lists_and_client_keys_are_validated() -> None:
    public, secret = (key.decode() for key in zmq.curve_keypair())
    client_public, client_secret = (key.decode() for key in zmq.curve_keypair())
    with pytest.raises((ValueError, msgspec.ValidationError), match="curve_secret_key"):
        EventsConfig(curve_allowed_client_keys=(client_public,))  # an allow-list needs CURVE on
    with pytest.raises((ValueError, msgspec.ValidationError), match="Z85"):
        EventsConfig(curve_secret_key=secret, curve_public_key=public, curve_allowed_client_keys=("short",))
    listener = EventListener(PoolView())
    with pytest.raises(ConfigError, match="secret"):
        listener.add_producer("p", "tcp://127.0.0.1:1", curve_server_key=public,
                              curve_client_keys=CurveKeyPair(client_public, secret))  # fmt: skip
    with pytest.raises(ConfigError, match="curve_server_key"):
        listener.add_producer("p", "tcp://127.0.0.1:1", curve_client_keys=CurveKeyPair(client_public, client_secret))


def test_tail_refuses_a_client_certificate_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    public, _ = (key.decode() for key in zmq.curve_keypair())
    public_only, _ = zmq.auth.create_certificates(str(tmp_path), "client")
    base = ["events", "tail", "--endpoint", "tcp://127.0.0.1:1", f"--curve-server-key={public}", "--duration", "0.1"]
    assert main([*base, "--curve-client-cert", str(tmp_path / "missing")]) == 2
    assert "no file" in capsys.readouterr().err
    assert main([*base, "--curve-client-cert", public_only]) == 2  # the .key file: public half only
    assert "no secret key" in capsys.readouterr().err
