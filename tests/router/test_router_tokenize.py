"""vLLM's ``/tokenize`` and ``/detokenize`` through ``kvstore router`` in front of a fleet (forwarded, by load, to a
replica that serves them: here ``kvstore worker`` fronts) -- the same behaviour as on every front we serve."""

from __future__ import annotations

import httpx

from kvstore.deploy.config import config_from_dict
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.router.app import create_app
from kvstore.router.backends import HttpBackend
from kvstore.router.service import ProducerSpec, ReplicaSpec, RouterService
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests import openai_conformance as conformance
from tests.http_servers import ServerThread


def test_tokenize_and_detokenize_are_forwarded_to_the_fleet() -> None:
    config = config_from_dict({"pool": {"num_blocks": 64}, "worker": {"device": "cpu"}})
    workers = [KVWorker(f"tok-{i}", config) for i in range(2)]
    fronts = [ServerThread(create_worker_app(w)).start() for w in workers]
    info = workers[0].info()
    service = RouterService(config, load_tokenizer(""), ModelLimits(info.vocab_size, info.max_context), seed=0)
    for worker, front in zip(workers, fronts, strict=True):
        ep = worker.event_endpoints()
        events = ProducerSpec(f"{worker.name}/events", ep.endpoint, ep.replay_endpoint)
        service.add_replica(ReplicaSpec(worker.name, None, HttpBackend(worker.name, front.url), events))
    router = ServerThread(create_app(service)).start()
    try:
        assert service.forwards
        conformance.tokenize_and_detokenize(router.url, info.model_name)
        garbage = httpx.post(f"{router.url}/tokenize", content=b"\xff not json", timeout=30)  # the replica's 400
        assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "BadRequestError", garbage.text
    finally:
        router.stop()
        for front in fronts:
            front.stop()
        for worker in workers:
            worker.shutdown()
