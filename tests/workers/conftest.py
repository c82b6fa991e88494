"""Fixtures for the workers tests: workers that are shut down after each test, reference outputs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from workers_testlib import Reference, WorkerFactory, make_config

from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker


@pytest.fixture
def make_worker() -> Iterator[WorkerFactory]:
    """Build workers from make_config's keywords; every one is shut down at teardown."""
    made: list[KVWorker] = []

    def factory(name: str = "w0", **kwargs: Any) -> KVWorker:
        worker = KVWorker(name, make_config(**kwargs))
        made.append(worker)
        return worker

    yield factory
    for worker in made:
        worker.shutdown()


@pytest.fixture(scope="module")
def reference_worker() -> Iterator[KVWorker]:
    """Prefix caching off and a roomy pool: the ground truth that cached runs must reproduce."""
    worker = KVWorker("reference", make_config(num_blocks=512, caching=False))
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def reference(reference_worker: KVWorker) -> Reference:
    """Greedy output of a request run alone on the reference worker (memoised)."""
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(request: GenerateRequest) -> list[int]:
        key = (tuple(request.token_ids), request.max_tokens)
        if key not in memo:
            result = reference_worker.generate(GenerateRequest(request.token_ids, request.max_tokens))
            assert result.cached_tokens == 0
            memo[key] = result.output_token_ids
        return memo[key]

    return run
