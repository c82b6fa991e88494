"""Streams: chunks as tokens are produced, equal to the plain result, and cancellation that frees blocks."""

from __future__ import annotations

import asyncio
import random
import time

from workers_testlib import WorkerFactory, random_tokens

from kvstore.worker_api import FinishReason, GenerateRequest, SamplingParams, StreamChunk

PROMPT = random_tokens(random.Random(5), 50)


def test_a_stream_is_the_result_told_token_by_token(make_worker: WorkerFactory) -> None:
    worker = make_worker()
    plain = worker.generate(GenerateRequest(PROMPT, 20))
    chunks = list(worker.submit(GenerateRequest(PROMPT, 20)))
    assert [len(c.deltas) for c in chunks] == [1] * 20  # one token per step, the first as soon as it exists
    assert [t for c in chunks for d in c.deltas for t in d.token_ids] == plain.output_token_ids
    assert "".join(d.text for c in chunks for d in c.deltas) == plain.choices[0].text
    assert all(c.stats is None for c in chunks[:-1]) and chunks[-1].stats is not None
    assert chunks[-1].deltas[0].finish_reason == FinishReason.LENGTH
    assert chunks[-1].stats.completion_tokens == 20 and chunks[-1].stats.prompt_tokens == 50


def test_an_asyncio_consumer_reads_the_same_stream(make_worker: WorkerFactory) -> None:
    worker = make_worker()
    plain = worker.generate(GenerateRequest(PROMPT, 10, sampling=SamplingParams(n=2, temperature=1.0, seed=3)))

    async def consume() -> list[int]:
        stream = worker.submit(GenerateRequest(PROMPT, 10, sampling=SamplingParams(n=2, temperature=1.0, seed=3)))
        return (await stream.aresult()).choices[1].token_ids

    assert asyncio.run(consume()) == plain.choices[1].token_ids


def test_cancel_drops_the_request_within_a_step_and_frees_its_blocks(make_worker: WorkerFactory) -> None:
    worker = make_worker(num_blocks=64)
    stream = worker.submit(GenerateRequest(PROMPT, 900))
    chunks = iter(stream)
    next(chunks)  # running: its blocks are held
    assert worker.load().running == 1
    with stream._cond:  # chunks the step loop made before the cancel was asked for (a busy host delays this thread)
        made_before = len(stream._items)
    stream.cancel()
    rest = list(chunks)
    assert rest[-1].deltas[-1].finish_reason == FinishReason.ABORT and rest[-1].stats is not None
    assert len(rest) - made_before < 5  # dropped within a step or two of the cancel, not run to its 900 tokens
    deadline = time.monotonic() + 5
    while worker.load().running and time.monotonic() < deadline:
        time.sleep(0.01)
    load = worker.load()
    assert (load.running, load.waiting) == (0, 0)
    worker.check_invariants()
    assert 'kvstore_requests_total{outcome="aborted",replica="w0"} 1.0' in worker.metrics_text().decode()
    # Only cached blocks are left: a new request can take the whole pool's free blocks.
    assert worker.generate(GenerateRequest(PROMPT, 4)).cached_tokens > 0


def test_cancel_of_a_waiting_request_and_after_the_end_are_harmless(make_worker: WorkerFactory) -> None:
    worker = make_worker(max_num_seqs=1)
    running = worker.submit(GenerateRequest(PROMPT, 200))
    waiting = worker.submit(GenerateRequest(PROMPT[:20], 5))
    waiting.cancel()
    assert waiting.result(timeout=30).choices[0].finish_reason == FinishReason.ABORT
    running.cancel()
    running.result(timeout=30)
    done = worker.submit(GenerateRequest(PROMPT, 3))
    done.result(timeout=30)
    done.cancel()  # already finished: nothing happens
    worker.check_invariants()
    assert worker.load().running == 0


def test_a_reader_whose_event_loop_closed_never_stops_the_worker(make_worker: WorkerFactory) -> None:
    """An asyncio reader that read one chunk and closed its loop without finishing the stream leaves a waker
    behind; the next chunk must not fail the step loop (before: the worker died, every request with it)."""
    worker = make_worker()
    stream = worker.submit(
        GenerateRequest(random_tokens(random.Random(3), 8), 40, sampling=SamplingParams(ignore_eos=True))
    )
    readers = []

    async def first_chunk() -> StreamChunk:
        reader = stream.__aiter__()
        readers.append(reader)  # kept alive: never finalized, its waker stays registered
        return await anext(reader)

    loop = asyncio.new_event_loop()
    first = loop.run_until_complete(first_chunk())
    loop.close()
    rest = stream.result(timeout=60).choices[0].token_ids  # the rest, read on this thread
    assert len(first.deltas[0].token_ids) + len(rest) == 40
    assert worker.health()["alive"] and worker.health()["last_error"] is None
    assert len(worker.generate(GenerateRequest([1, 2, 3], 3)).choices[0].token_ids) == 3
    worker.check_invariants()
