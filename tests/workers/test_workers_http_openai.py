"""A worker's own HTTP front (``kvstore worker``, no Ray) against the official ``openai`` client."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from workers_testlib import make_config

from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests import openai_conformance as check
from tests.http_servers import ServerThread

MODEL = "kvstore-toy"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, KVWorker]]:
    worker = KVWorker("http-0", make_config(num_blocks=512))
    server = ServerThread(create_worker_app(worker)).start()
    yield server.url, worker
    server.stop()
    worker.shutdown()


@pytest.mark.parametrize(
    "behaviour",
    [
        check.models_list,
        check.completions_plain_and_streamed,
        check.chat_plain_and_streamed_and_cached,
        check.seeded_sampling_is_reproducible,
        check.async_client_streams,
        check.unknown_model_is_404,
        check.unsupported_fields_are_named,
    ],
    ids=lambda f: f.__name__,
)
def test_openai_client(served: tuple[str, KVWorker], behaviour: check.Behaviour) -> None:
    behaviour(served[0], MODEL)


def test_a_client_that_disconnects_mid_stream_cancels_its_request(served: tuple[str, KVWorker]) -> None:
    url, worker = served
    before = _aborted(worker)
    check.disconnect_mid_stream(url, MODEL)
    deadline = time.monotonic() + 10
    while (_aborted(worker) == before or worker.load().running) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _aborted(worker) == before + 1 and worker.load().running == 0
    worker.check_invariants()


def _aborted(worker: KVWorker) -> float:
    for line in worker.metrics_text().decode().splitlines():
        if line.startswith("kvstore_requests_total") and 'outcome="aborted"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
