"""Response bodies and SSE chunks built from worker output: exact shapes, as vLLM's server sends them."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from kvstore.events import Medium
from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import (
    ModelLimits,
    decode_chat,
    decode_completion,
    parse_chat,
    parse_completion,
)
from kvstore.openai.responses import DONE, ResponseBuilder
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.worker_api import ChoiceDelta, FinishReason, RequestStats, StreamChunk, TokenLogprob, fold_stream

TOK = ByteTokenizer()
LIMITS = ModelLimits(512, 2048)
STATS = RequestStats("w0", 5, 3, {Medium.GPU: 4, Medium.CPU: 0, Medium.STORAGE: 0}, 0.0, 0.01, 0.02, 0)


def completion(**body: object) -> ResponseBuilder:
    raw = json.dumps({"prompt": "hello", **body}).encode()
    return ResponseBuilder(parse_completion(decode_completion(raw), TOK, LIMITS), TOK, model="m", request_id="cmpl-1")


def chat(**body: object) -> ResponseBuilder:
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode()
    return ResponseBuilder(parse_chat(decode_chat(raw), TOK, LIMITS), TOK, model="m", request_id="chatcmpl-1")


def events(builder: ResponseBuilder, chunks: list[StreamChunk]) -> list[dict[str, object]]:
    out = []
    for chunk in chunks:
        for event in builder.events(chunk):
            assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event != DONE
            out.append(json.loads(event[6:]))
    return out


# The second token was sampled outside the top 1 (b), and one alternative is ruled out (-inf).
LP = [TokenLogprob(ord("a"), -0.5, [(ord("a"), -0.5), (ord("b"), -1.5)]),
      TokenLogprob(ord("c"), -0.25, [(ord("b"), -0.1), (ord("d"), float("-inf"))])]  # fmt: skip
CHUNKS = [
    StreamChunk("r", [ChoiceDelta(0, [ord("a")], "a", LP[:1])]),
    StreamChunk("r", [ChoiceDelta(0, [ord("c")], "c", LP[1:], FinishReason.STOP, "x")], STATS),
]


def test_completion_body_with_logprobs_echo_and_usage() -> None:
    builder = completion(logprobs=1, max_tokens=2)
    body = builder.body(fold_stream(CHUNKS, 1))
    choice = body["choices"][0]  # type: ignore[index]
    assert body["object"] == "text_completion" and choice["text"] == "ac"
    assert choice["logprobs"] == {
        "tokens": ["a", "c"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"c": -0.25, "b": -0.1, "d": -9999.0}], "text_offset": [0, 1],
    }  # fmt: skip
    assert (choice["finish_reason"], choice["stop_reason"], choice["token_ids"]) == ("stop", "x", [97, 99])
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    echoed = completion(echo=True).body(fold_stream(CHUNKS, 1))
    assert echoed["choices"][0]["text"] == "helloac"  # type: ignore[index]


def test_logprobs_zero_still_names_the_chosen_token_as_vllm_does() -> None:
    only = [StreamChunk("r", [ChoiceDelta(0, [ord("a")], "a", [TokenLogprob(ord("a"), -0.5, [])], FinishReason.LENGTH)],
                        STATS)]  # fmt: skip
    body = completion(logprobs=0, max_tokens=1).body(fold_stream(only, 1))
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.5}]  # type: ignore[index]


def test_chat_stream_opens_with_the_role_and_ends_with_usage() -> None:
    out = events(chat(stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2), CHUNKS)
    assert [e["object"] for e in out] == ["chat.completion.chunk"] * 4
    assert out[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]  # fmt: skip
    assert out[1]["choices"][0]["delta"] == {"content": "a"}  # type: ignore[index]
    assert out[1]["choices"][0]["logprobs"]["content"][0] == {  # type: ignore[index]
        "token": "a", "logprob": -0.5, "bytes": [97],
        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                         {"token": "b", "logprob": -1.5, "bytes": [98]}],
    }  # fmt: skip
    assert out[2]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert out[3]["choices"] == [] and out[3]["usage"]["completion_tokens"] == 3  # type: ignore[index]
    plain = events(chat(stream=True), CHUNKS)
    assert len(plain) == 3 and "usage" not in plain[-1]


def test_without_a_generation_prompt_the_answer_continues_the_last_messages_role_as_in_vllm() -> None:
    # vLLM: no generation prompt -> the answer's role is the last message's, and echo repeats that message.
    body = chat(add_generation_prompt=False, echo=True).body(fold_stream(CHUNKS, 1))
    assert body["choices"][0]["message"] == {"role": "user", "content": "hiac"}  # type: ignore[index]
    out = events(chat(add_generation_prompt=False, stream=True), CHUNKS)
    assert out[0]["choices"][0]["delta"] == {"role": "user", "content": ""}  # type: ignore[index]
    # With the generation prompt (the default) the answer is the assistant's, and a user message is not echoed.
    body = chat(echo=True).body(fold_stream(CHUNKS, 1))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ac"}  # type: ignore[index]


def test_a_streamed_chat_echo_is_a_chunk_of_its_own_and_a_completion_echo_opens_the_text() -> None:
    """vLLM's streams: a chat's echoed message follows the role chunks, one chunk per choice (continuous usage:
    no token generated yet); a completion's echo is the start of each choice's first text."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    out = events(chat(add_generation_prompt=False, echo=True, n=2, stream=True, stream_options=options), CHUNKS)
    assert [e["choices"][0]["delta"] for e in out[:4]] == [  # type: ignore[index]
        {"role": "user", "content": ""}, {"role": "user", "content": ""}, {"content": "hi"}, {"content": "hi"},
    ]  # fmt: skip
    assert [e["choices"][0]["index"] for e in out[:4]] == [0, 1, 0, 1]  # type: ignore[index]
    assert [e["usage"]["completion_tokens"] for e in out[:4]] == [0, 0, 0, 0]  # type: ignore[index]
    assert out[4]["choices"][0]["delta"] == {"content": "a"}  # type: ignore[index]
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in out if e["choices"])  # type: ignore[index]
    plain = chat(add_generation_prompt=False, echo=True).body(fold_stream(CHUNKS, 1))
    assert streamed == "hi" * 2 + "ac" and plain["choices"][0]["message"]["content"] == "hiac"  # type: ignore[index]
    texts = [e["choices"][0]["text"] for e in events(completion(echo=True, stream=True), CHUNKS) if e["choices"]]  # type: ignore[index]
    assert texts == ["helloa", "c"]


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk() -> None:
    """vLLM's ``continuous_usage_stats``: each chunk carries the prompt and the tokens its own choice has generated
    so far (a chat stream's role chunks, all before any content: none yet), a token held back (no text yet) in a
    chunk of its own with no text; the closing usage chunk has the totals. With ``include_usage`` false the option
    does nothing, as in vLLM."""
    chunks = [
        StreamChunk("r", [ChoiceDelta(0, [ord("a")], "a"), ChoiceDelta(1, [ord("b")], "")]),  # choice 1 holds back
        StreamChunk("r", [ChoiceDelta(1, [ord("b"), ord("c")], "bbc")]),
        StreamChunk("r", [ChoiceDelta(0, [ord("d")], "d", None, FinishReason.LENGTH),
                          ChoiceDelta(1, [ord("e")], "e", None, FinishReason.LENGTH)], STATS),
    ]  # fmt: skip
    options = {"include_usage": True, "continuous_usage_stats": True}
    builder = chat(stream=True, n=2, stream_options=options)
    prompt = len(builder.parsed.token_ids)
    out = events(builder, chunks)
    seen = [(e["choices"][0]["index"] if e["choices"] else None, e["usage"]) for e in out]  # type: ignore[index]
    running = [(i, u["completion_tokens"]) for i, u in seen[:-1]]  # type: ignore[index]
    assert running == [(0, 0), (1, 0), (0, 1), (1, 1), (1, 3), (0, 2), (1, 4)]  # every role chunk first, as vLLM
    held = out[3]["choices"][0]  # type: ignore[index]
    assert (held["delta"], held["token_ids"]) == ({"content": ""}, [ord("b")])
    assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + c  # type: ignore[index]
               for (_, u), (_, c) in zip(seen, running, strict=False))  # fmt: skip
    assert seen[-1] == (None, {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                               "prompt_tokens_details": {"cached_tokens": 4}})  # fmt: skip
    plain = events(completion(stream=True, stream_options=options), CHUNKS)
    assert [e["usage"]["completion_tokens"] for e in plain] == [1, 2, 3]  # type: ignore[index]
    alone = events(completion(stream=True, stream_options={"continuous_usage_stats": True}), CHUNKS)
    assert [e["usage"]["completion_tokens"] for e in alone] == [1, 2, 3]  # include_usage defaults to true, as vLLM's
    quiet = {"include_usage": False, "continuous_usage_stats": True}
    assert not any("usage" in e for e in events(completion(stream=True, stream_options=quiet), CHUNKS))


def test_parse_rejects_by_field_and_fills_vllm_defaults() -> None:
    parsed = parse_chat(decode_chat(b'{"messages": [{"role": "user", "content": "hi"}]}'), TOK, LIMITS)
    assert parsed.max_tokens == 2048 - len(parsed.token_ids)  # chat: the rest of the context, as vLLM
    assert parsed.sampling.temperature is None  # the model's default decides
    assert parse_completion(decode_completion(b'{"prompt": [1, 2]}'), TOK, LIMITS).max_tokens == 16
    for body, param in [
        (b'{"prompt": "x", "logit_bias": {"9999": 1}}', "logit_bias"),
        (b'{"prompt": "x", "stop_token_ids": [600]}', "stop_token_ids"),
        (b'{"prompt": "x", "min_tokens": 20, "max_tokens": 4}', "min_tokens"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
        (b'{"prompt": "x", "best_of": 3}', "best_of"),
        (b'{"prompt": "x", "suffix": "y"}', "suffix"),
        (b'{"prompt": "x", "allowed_token_ids": []}', "allowed_token_ids"),
        (b'{"prompt": "x", "allowed_token_ids": [1, 512]}', "allowed_token_ids"),
        (b'{"prompt": [1, 2], "prompt_logprobs": -1}', "prompt_logprobs"),  # vLLM's "all": beyond its cap of 20
        (b'{"prompt": [1, 2], "prompt_logprobs": 21}', "prompt_logprobs"),
        (b'{"prompt": [1, 2], "prompt_logprobs": 1, "stream": true}', "prompt_logprobs"),
        (b'{"prompt": [1, 2], "max_tokens": 0}', "max_tokens"),  # 0 only with echo
        (b'{"prompt": "x", "max_tokens": 4000}', "max_tokens"),
    ]:
        with pytest.raises(ApiError) as info:
            parse_completion(decode_completion(body), TOK, LIMITS)
        assert info.value.param == param and info.value.status == 400


def test_streamed_token_ids_add_up_to_the_answers_when_text_is_held_back() -> None:
    """A byte-fallback token (half a UTF-8 character) has no text yet: its chunk still carries its id."""
    euro = "€".encode()
    chunks = [
        StreamChunk("r", [ChoiceDelta(0, [euro[0]], "")]),
        StreamChunk("r", [ChoiceDelta(0, [euro[1]], "")]),
        StreamChunk("r", [ChoiceDelta(0, [euro[2], ord("!")], "€!", None, FinishReason.LENGTH)], STATS),
    ]
    for builder in (completion(stream=True), chat(stream=True)):
        out = [e for e in events(builder, chunks) if e["choices"]]
        content = [c for e in out for c in e["choices"] if "role" not in c.get("delta", {})]  # type: ignore[union-attr, attr-defined]
        assert [c["token_ids"] for c in content] == [[euro[0]], [euro[1]], [euro[2], ord("!")]]
        texts = [c["delta"]["content"] if builder.chat else c["text"] for c in content]
        assert texts == ["", "", "€!"]


def test_a_checkpoints_max_new_tokens_caps_max_tokens_as_vllm_does() -> None:
    """vLLM takes the least of the request's max_tokens (or its default) and generation_config's max_new_tokens."""
    capped = ModelLimits(512, 2048, 8)
    assert parse_completion(decode_completion(b'{"prompt": [1, 2], "max_tokens": 100}'), TOK, capped).max_tokens == 8
    assert parse_completion(decode_completion(b'{"prompt": [1, 2], "max_tokens": 3}'), TOK, capped).max_tokens == 3
    assert parse_completion(decode_completion(b'{"prompt": [1, 2]}'), TOK, capped).max_tokens == 8  # 16 by default
    chat_body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    assert parse_chat(decode_chat(chat_body), TOK, capped).max_tokens == 8  # the rest of the context by default
    with pytest.raises(ApiError) as info:  # a bad value is still named, not capped into a good one
        parse_completion(decode_completion(b'{"prompt": [1, 2], "max_tokens": 0}'), TOK, capped)
    assert info.value.param == "max_tokens"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm_does() -> None:
    from kvstore.openai.routing import read_for_routing

    def completion_ids(body: dict[str, object]) -> list[int]:
        return parse_completion(decode_completion(json.dumps(body).encode()), TOK, LIMITS).token_ids

    assert completion_ids({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2}) == [4, 5]
    assert completion_ids({"prompt": "abcdef", "truncate_prompt_tokens": 3}) == list(b"def")
    assert completion_ids({"prompt": [1, 2], "truncate_prompt_tokens": 5}) == [1, 2]  # shorter: as it is
    long = list(range(1, 300)) * 8  # 2,392 tokens: over the 2,048 context, cut to what fits with max_tokens 16
    assert completion_ids({"prompt": long, "truncate_prompt_tokens": 2000}) == long[-2000:]
    echoed = completion(prompt="abcdef", truncate_prompt_tokens=3, echo=True)
    assert echoed.parsed.echo_text == "def"  # what the model read
    chat_body = {"messages": [{"role": "user", "content": "hello"}], "truncate_prompt_tokens": 4}
    chat_ids = parse_chat(decode_chat(json.dumps(chat_body).encode()), TOK, LIMITS).token_ids
    assert len(chat_ids) == 4
    for keep, fragment in [(0, "must be -1 or >= 1"), (-2, "must be -1 or >= 1"), (4096, "larger than the model's")]:
        with pytest.raises(ApiError) as info:
            completion_ids({"prompt": [1, 2], "truncate_prompt_tokens": keep})
        assert info.value.param == "truncate_prompt_tokens" and fragment in info.value.message
    # In front of a vLLM fleet the router hashes what the replica will read, on both of its paths.
    for body in ({"prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 2},
                 {"prompt": "abcde", "truncate_prompt_tokens": 2}):  # fmt: skip
        view = read_for_routing(json.dumps(body).encode(), "completion", TOK)
        assert view.token_ids == completion_ids(body)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id() -> None:
    body = completion(logprobs=1, max_tokens=2, return_tokens_as_token_ids=True).body(fold_stream(CHUNKS, 1))
    logprobs = body["choices"][0]["logprobs"]  # type: ignore[index]
    assert logprobs["tokens"] == ["token_id:97", "token_id:99"]
    assert logprobs["top_logprobs"][0] == {"token_id:97": -0.5, "token_id:98": -1.5}
    entry = chat(logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True).body(fold_stream(CHUNKS, 1))
    first = entry["choices"][0]["logprobs"]["content"][0]  # type: ignore[index]
    assert first["token"] == "token_id:97" and first["bytes"] == list(b"token_id:97")


class _WordTokenizer(ByteTokenizer):
    """Bytes, except for a few words a leading space tokenises differently (as BPE vocabularies do)."""

    WORDS: ClassVar[dict[str, list[int]]] = {
        "foo": [300], " foo": [301], "bar baz": [302, 32, 303], " bar baz": [304, 32, 303],
        "qux": [305, 306], " qux": [32, 305, 306],
    }  # fmt: skip

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.WORDS.get(text) or super().encode(text, add_special_tokens=add_special_tokens)


def test_bad_words_are_tokenised_as_vllm_does_at_the_start_and_after_a_space() -> None:
    """Each word, leading spaces stripped, as it reads at a text's start; and after a space where that makes a
    different first token in as many tokens (vLLM's rule). Bad words the model cannot hold are refused."""
    body = {"prompt": "hi", "bad_words": ["foo", "  bar baz", "qux", "ab"]}
    parsed = parse_completion(decode_completion(json.dumps(body).encode()), _WordTokenizer(), LIMITS)
    assert parsed.sampling.bad_words_token_ids == ((300,), (301,), (302, 32, 303), (304, 32, 303), (305, 306),
                                                   (97, 98))  # fmt: skip
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "bad_words": ["ab"]}
    assert parse_chat(decode_chat(json.dumps(chat_body).encode()), TOK, LIMITS).sampling.bad_words_token_ids == (
        (97, 98),
    )
    for words, message in ((["  "], "has no tokens"), (["ok", ""], "has no tokens")):
        with pytest.raises(ApiError, match=message) as info:
            parse_completion(decode_completion(json.dumps({"prompt": "hi", "bad_words": words}).encode()), TOK, LIMITS)
        assert info.value.param == "bad_words"
    small = ModelLimits(100, 2048)
    with pytest.raises(ApiError, match="token 122 is outside"):  # "z"
        parse_completion(decode_completion(b'{"prompt": "hi", "bad_words": ["z"]}'), TOK, small)
    with pytest.raises(ApiError, match="length <= 64") as info:
        decode_completion(json.dumps({"prompt": "hi", "bad_words": ["w"] * 65}).encode())
    assert info.value.param == "bad_words"


def test_echoed_prompt_scores_show_only_logprobs_alternatives_and_a_chat_echo_scores_as_vllm() -> None:
    """A prompt scored with more alternatives (prompt_logprobs=5) than the echo's logprobs=1 shows at most the
    token and one alternative per position, as vLLM cuts them; a chat's echo asks for prompt_logprobs=0."""
    raw = b'{"prompt": "abc", "max_tokens": 1, "echo": true, "logprobs": 1, "prompt_logprobs": 5}'
    parsed = parse_completion(decode_completion(raw), TOK, LIMITS)
    assert parsed.sampling.prompt_logprobs == 5
    top5 = [(100 + i, -1.0 - i) for i in range(5)]
    scored = [None] + [TokenLogprob(t, -3.0, top5, 7) for t in parsed.token_ids[1:]]
    delta = ChoiceDelta(0, [120], "x", [TokenLogprob(120, -1.0, [(120, -1.0)])], FinishReason.LENGTH, None, scored)
    body = ResponseBuilder(parsed, TOK, model="m", request_id="c").body(
        fold_stream([StreamChunk("r", [delta], STATS)], 1)
    )
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and [len(t) for t in tops[1:]] == [2, 2, 1]
    assert len(body["choices"][0]["prompt_logprobs"][1]) == 6  # the field itself keeps all 5 and the token
    echo = parse_chat(decode_chat(b'{"messages": [{"role": "user", "content": "hi"}], "echo": true}'), TOK, LIMITS)
    assert echo.sampling.prompt_logprobs == 0 and echo.sampling.logprobs is None
