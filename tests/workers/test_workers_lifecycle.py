"""Shutdown, a failing model step (fault injected), and the worker's descriptive methods."""

from __future__ import annotations

import random

import pytest
from workers_testlib import Reference, WorkerFactory, fail_once, random_tokens

from kvstore.errors import ConfigError
from kvstore.worker_api import GenerateRequest, ModelInfo, WorkerShutdownError


def test_shutdown_fails_unfinished_requests_and_refuses_new_ones(make_worker: WorkerFactory) -> None:
    worker = make_worker(max_num_seqs=1, events=True)
    futures = [worker.submit(GenerateRequest([1, 2, 3], 1000)) for _ in range(5)]
    worker.shutdown()
    for future in futures:
        with pytest.raises(WorkerShutdownError, match="shut down before request"):
            future.result(timeout=10)
    with pytest.raises(WorkerShutdownError, match="is shut down"):
        worker.submit(GenerateRequest([1], 1))
    assert worker.health()["alive"] is False
    with pytest.raises(RuntimeError, match="closed"):
        worker.kv_pool.read_blocks([0])
    with pytest.raises(RuntimeError, match="closed"):
        worker.publisher.publish([])
    worker.shutdown()  # idempotent


def test_a_failing_model_step_fails_running_requests_drops_the_cache_and_the_worker_recovers(
    make_worker: WorkerFactory, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker()
    prompt = random_tokens(random.Random(8), 40)
    worker.generate(GenerateRequest(prompt, 4))
    assert worker.cached_hashes()
    fail_once(monkeypatch, worker._runner, "execute", MemoryError("injected: out of device memory"))
    with pytest.raises(RuntimeError, match=r"model step failed .*injected"):
        worker.generate(GenerateRequest([*prompt, 5, 6, 7], 4))
    assert worker.cached_hashes() == []  # blocks registered for the failed step are never served
    assert "injected" in worker.health()["last_error"]
    worker.check_invariants()
    again = GenerateRequest([*prompt, 5, 6, 7], 4)
    result = worker.generate(again)
    assert result.cached_tokens == 0 and result.output_token_ids == reference(again)
    assert 'kvstore_requests_total{outcome="failed",replica="w0"} 1.0' in worker.metrics_text().decode()


def test_a_sampler_fault_is_recovered_from_as_a_failed_model_step(
    make_worker: WorkerFactory, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling runs outside the model step; a fault there (a bug: any valid request samples) fails the running
    requests as a failed model step does, and the worker serves on (before: the step loop died)."""
    worker = make_worker()
    fail_once(monkeypatch, worker._sampler, "sample", RuntimeError("injected sampler fault"))
    with pytest.raises(RuntimeError, match=r"model step failed .*injected sampler fault"):
        worker.generate(GenerateRequest([1, 2, 3, 4], 4))
    assert worker.health()["alive"]
    again = GenerateRequest([1, 2, 3, 4], 4)
    assert worker.generate(again).output_token_ids == reference(again)
    worker.check_invariants()


def test_info_health_and_endpoints(make_worker: WorkerFactory) -> None:
    worker = make_worker(events=True)
    assert worker.info() == ModelInfo(model_name="kvstore-toy", vocab_size=512, max_context=2048, block_size=16,
                                      hash_algo="sha256_cbor", hash_seed="kvstore")  # fmt: skip
    endpoints = worker.event_endpoints()
    assert endpoints.endpoint.startswith("tcp://127.0.0.1:") and endpoints.replay_endpoint.startswith(
        "tcp://127.0.0.1:"
    )
    assert endpoints.endpoint != endpoints.replay_endpoint
    health = worker.health()
    assert health["alive"] is True and health["device"] == "cpu" and health["last_error"] is None
    with pytest.raises(ConfigError, match=r"events\.enabled is false"):
        make_worker("quiet").event_endpoints()
