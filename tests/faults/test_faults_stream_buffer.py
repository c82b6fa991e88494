"""Huge strings in requests must not grow a producer's replay buffer without bound.

A ``lora_name`` (like other request strings) is carried in the events of
every block it names, and the publisher keeps each batch for replay. Its
buffer is bounded by a batch count, and with a 3 MB name each batch weighs
megabytes: the bound must hold in bytes too (``events.buffer_bytes``).

A real KV worker (toy model on the CPU, real pool and publisher, the default
EventsConfig) serves 50 requests naming the same 3 MB LoRA; the Python
memory the worker still holds once they are done (tracemalloc: the
publisher's buffered payloads are Python bytes) must stay within the
buffer's byte bound plus what one request needs.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

from faults_helpers import BLOCK, fault_config, tokens

from kvstore.config import EventsConfig
from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker

NAME_BYTES = 3 * 2**20
REQUESTS = 50
DEFAULT_BUFFER_BYTES = 64 * 2**20  # events.buffer_bytes' default
SLACK = 16 * 2**20  # the name itself, one batch in flight, the model's small Python objects


def test_requests_with_a_3mb_lora_name_keep_the_replay_buffer_within_its_byte_bound() -> None:
    worker = KVWorker("w", fault_config())
    rng = random.Random(11)
    name = "L" * NAME_BYTES
    try:
        worker.generate(GenerateRequest(tokens(rng, 2 * BLOCK + 1), 1))  # warm-up: the model's lazy state
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(REQUESTS):
            result = worker.generate(GenerateRequest(tokens(rng, 2 * BLOCK + 1), 1, lora_name=name))
            assert result.cached_tokens == 0
        assert worker.publisher.last_seq >= REQUESTS
        publisher = worker.publisher
        assert not hasattr(publisher, "flush") or publisher.flush(30)
        del result
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        bound = DEFAULT_BUFFER_BYTES + SLACK
        print(f"\n{REQUESTS} requests naming a {NAME_BYTES / 2**20:.0f} MiB LoRA: the worker holds "
              f"{held / 2**20:.1f} MiB more afterwards (bound {bound / 2**20:.0f} MiB)")  # fmt: skip
        assert held < bound
        assert EventsConfig().buffer_bytes == DEFAULT_BUFFER_BYTES
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        worker.shutdown()
