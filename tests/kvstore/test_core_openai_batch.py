"""A completions request with a batch of prompts: parsing each prompt, joining their streams, numbering choices."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from kvstore.events import Medium
from kvstore.openai.batch import batch_ids, combine_stats, merge_streams
from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import MAX_BATCH_CHOICES, ModelLimits, decode_completion, parse_completions
from kvstore.openai.responses import ResponseBuilder
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.worker_api import ChoiceDelta, FinishReason, RequestStats, StreamChunk, fold_stream

TOK = ByteTokenizer()
LIMITS = ModelLimits(512, 2048)


def stats(replica: str, prompt: int, completion: int, gpu: int) -> RequestStats:
    return RequestStats(replica, prompt, completion, {Medium.GPU: gpu, Medium.CPU: 1, Medium.STORAGE: 0},
                        0.1 * prompt, 0.2, 0.3 * prompt, 1)  # fmt: skip


def parse(body: dict[str, object]) -> list:
    return parse_completions(decode_completion(json.dumps(body).encode()), TOK, LIMITS)


def test_each_prompt_of_a_batch_is_parsed_alone_and_errors_name_it() -> None:
    two = parse({"prompt": ["ab", "cde"], "max_tokens": 3, "echo": True})
    assert [p.token_ids for p in two] == [[97, 98], [99, 100, 101]]
    assert [p.echo_text for p in two] == ["ab", "cde"] and {p.max_tokens for p in two} == {3}
    assert [p.token_ids for p in parse({"prompt": [[1, 2], [3]]})] == [[1, 2], [3]]
    assert [p.token_ids for p in parse({"prompt": ["x"]})] == [[120]]  # a batch of one
    assert [p.token_ids for p in parse({"prompt": [7, 8]})] == [[7, 8]]  # token ids: one prompt, not a batch
    for body, param, text in [
        ({"prompt": ["fine", ""]}, "prompt[1]", "prompt[1]: prompt must not be empty"),
        ({"prompt": [[1], [2, "x"]]}, "prompt[1]", "prompt[1]: prompt must be a string or a list of integer"),
        ({"prompt": [[[1]]]}, "prompt[0]", "prompt[0]: a batch of prompts inside a batch"),
        ({"prompt": [[1], [9999]]}, "prompt[1]", "prompt[1]"),
        ({"prompt": ["ok", 5]}, "prompt[1]", "prompt[1]: each prompt of a batch must be a string or a list"),
        ({"prompt": [3, "ok"]}, "prompt", "prompt must be a string or a list of integer token ids"),  # token ids
        ({"prompt": ["ok", None]}, "prompt[1]", "got NoneType"),
        ({"prompt": ["a"] * 20, "n": 17}, "n", "n must be between 1 and 16, got 17"),  # n's own error first
        ({"prompt": ["a"] * (MAX_BATCH_CHOICES // 2 + 1), "n": 2}, "prompt", "more than 256 choices"),
        ({"prompt": ["a", "b"], "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be between"),
        ({"prompt": ["a", "b"], "top_p": 7.0}, "top_p", "top_p"),
        ({"prompt": ["a", "b" * 3000], "max_tokens": 4}, "max_tokens", "prompt[1]: prompt (3000 tokens)"),
    ]:
        with pytest.raises(ApiError) as info:
            parse(body)
        assert info.value.status == 400 and info.value.param in (param, None), (body, info.value.param)
        assert text in info.value.message, info.value.message


async def _stream(chunks: list[StreamChunk], delay: float, closed: list[int], tag: int) -> AsyncGenerator[StreamChunk]:
    try:
        for chunk in chunks:
            await asyncio.sleep(delay)
            yield chunk
    finally:
        closed.append(tag)


def _prompt_chunks(tag: str, n: int, stats_: RequestStats) -> list[StreamChunk]:
    first = StreamChunk(tag, [ChoiceDelta(c, [1], f"{tag}{c}.") for c in range(n)])
    last = StreamChunk(tag, [ChoiceDelta(c, [2], "!", None, FinishReason.LENGTH) for c in range(n)], stats_)
    return [first, last]


def test_streams_are_joined_with_choices_renumbered_and_stats_combined() -> None:
    s0, s1 = stats("w0", 4, 4, 2), stats("w1", 6, 4, 0)
    closed: list[int] = []

    async def run() -> list[StreamChunk]:
        streams = [
            _stream(_prompt_chunks("a", 2, s0), 0.02, closed, 0),
            _stream(_prompt_chunks("b", 2, s1), 0.001, closed, 1),
        ]
        return [chunk async for chunk in merge_streams(streams, 2, "cmpl-9")]

    out = asyncio.run(run())
    assert {c.request_id for c in out} == {"cmpl-9"} and sorted(closed) == [0, 1]
    result = fold_stream(out, 4)
    assert [(c.index, c.text) for c in result.choices] == [(0, "a0.!"), (1, "a1.!"), (2, "b0.!"), (3, "b1.!")]
    assert out[-1].deltas == [] and out[-1].stats == combine_stats([s0, s1])
    combined = combine_stats([s0, s1, stats("w0", 1, 1, 1)])
    assert (combined.replica, combined.prompt_tokens, combined.completion_tokens) == ("w0,w1", 11, 9)
    assert combined.cached_tokens_by_medium == {Medium.GPU: 3, Medium.CPU: 3, Medium.STORAGE: 0}
    assert (combined.queue_s, combined.total_s, combined.preempted) == (pytest.approx(0.6), pytest.approx(1.8), 3)
    assert batch_ids("cmpl-9", 1) == ["cmpl-9"] and batch_ids("cmpl-9", 2) == ["cmpl-9-0", "cmpl-9-1"]


def test_a_failing_prompt_fails_the_batch_and_closes_the_others() -> None:
    closed: list[int] = []

    async def broken() -> AsyncGenerator[StreamChunk]:
        yield StreamChunk("x", [ChoiceDelta(0, [1], "x")])
        raise ApiError(503, "worker gone")

    async def run() -> None:
        slow = _stream(_prompt_chunks("a", 1, stats("w0", 1, 1, 0)) * 50, 0.01, closed, 0)
        async for _ in merge_streams([slow, broken()], 1, "cmpl-1"):
            pass

    with pytest.raises(ApiError, match="worker gone"):
        asyncio.run(run())
    assert closed == [0]  # the other prompt's request was cancelled, not left running


def test_the_builder_echoes_and_counts_each_prompt_of_its_batch() -> None:
    batch = parse({"prompt": ["ab", "cdef"], "echo": True, "stream": True, "max_tokens": 2,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    builder = ResponseBuilder(batch[0], TOK, model="m", request_id="cmpl-2", batch=batch)
    assert builder.num_choices == 2
    events = []
    for chunk in [StreamChunk("r", [ChoiceDelta(0, [1], "x"), ChoiceDelta(1, [1], "y")])]:
        for event in builder.events(chunk):
            events.append(json.loads(event[6:]))
    assert [(e["choices"][0]["index"], e["choices"][0]["text"], e["usage"]["prompt_tokens"]) for e in events] == [
        (0, "abx", 2), (1, "cdefy", 4)]  # fmt: skip


def test_an_error_about_no_prompt_in_particular_is_not_put_on_one() -> None:
    with pytest.raises(ApiError) as info:
        parse({"prompt": ["a", "b"], "prompt_logprobs": 2, "stream": True})
    assert info.value.param == "prompt_logprobs" and not info.value.message.startswith("prompt[")
