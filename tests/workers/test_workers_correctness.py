"""Greedy output with any mix of prefix-cache hits equals output with prefix caching disabled."""

from __future__ import annotations

import random

import pytest
from workers_testlib import Reference, WorkerFactory, random_tokens, shared_prefix_requests

from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequential_requests_with_shared_prefixes_match_the_uncached_model(
    make_worker: WorkerFactory, reference: Reference, seed: int
) -> None:
    worker = make_worker()
    hits = 0
    for request in shared_prefix_requests(seed, 12):
        result = worker.generate(request)
        assert result.output_token_ids == reference(request), request
        assert len(result.output_token_ids) == request.max_tokens
        hits += result.cached_tokens
        worker.check_invariants()
    assert hits > 0


def test_hit_on_blocks_written_by_a_different_finished_request(
    make_worker: WorkerFactory, reference: Reference
) -> None:
    worker = make_worker()
    rng = random.Random(10)
    prefix = random_tokens(rng, 48)
    first = GenerateRequest(prefix + random_tokens(rng, 10), 20, request_id="first")
    second = GenerateRequest(prefix + random_tokens(rng, 5), 8, request_id="second")
    r1 = worker.generate(first)
    r2 = worker.generate(second)
    assert r1.cached_tokens == 0
    assert (r2.request_id, r2.cached_tokens, r2.cached_tokens_by_medium) == (
        "second", 48, {"GPU": 48, "CPU": 0, "STORAGE": 0}
    )  # fmt: skip
    assert r1.output_token_ids == reference(first) and r2.output_token_ids == reference(second)

    # The next turn of the first conversation hits into the blocks its own decode filled.
    follow_up = GenerateRequest(first.token_ids + r1.output_token_ids + random_tokens(rng, 3), 6)
    r3 = worker.generate(follow_up)
    assert r3.cached_tokens == 64 > len(first.token_ids)
    assert r3.output_token_ids == reference(follow_up)

    # The same prompt again: every full block hits, the last token is always recomputed.
    again = worker.generate(GenerateRequest(first.token_ids, 20))
    assert again.cached_tokens == 48 and again.output_token_ids == r1.output_token_ids


def test_same_step_hits_and_chunked_prefills_match_the_uncached_model(
    make_worker: WorkerFactory, reference: Reference
) -> None:
    # A tight token budget chunks every prefill, and requests admitted in one step
    # hit blocks that an earlier request in that same step is computing.
    worker = make_worker(max_num_batched_tokens=48)
    requests = shared_prefix_requests(5, 16)
    futures = [worker.submit(r) for r in requests]
    results = [f.result(timeout=60) for f in futures]
    for request, result in zip(requests, results, strict=True):
        assert result.output_token_ids == reference(request), request
    assert sum(r.cached_tokens for r in results) > 0
    worker.check_invariants()


def test_cache_salt_isolates_the_cache(make_worker: WorkerFactory, reference: Reference) -> None:
    worker = make_worker()
    prompt = random_tokens(random.Random(4), 40)
    assert worker.generate(GenerateRequest(prompt, 4)).cached_tokens == 0
    salted = worker.generate(GenerateRequest(prompt, 4, cache_salt="tenant-a"))
    assert salted.cached_tokens == 0 and salted.output_token_ids == reference(GenerateRequest(prompt, 4))
    assert worker.generate(GenerateRequest(prompt, 4, cache_salt="tenant-a")).cached_tokens == 32
    assert worker.generate(GenerateRequest(prompt, 4, cache_salt="tenant-b")).cached_tokens == 0


def test_disabled_prefix_caching_never_hits(reference_worker: KVWorker) -> None:
    prompt = random_tokens(random.Random(6), 40)
    for _ in range(2):
        assert reference_worker.generate(GenerateRequest(prompt, 2)).cached_tokens == 0
    assert reference_worker.cached_hashes() == []
