"""Reasoning split from content (vLLM's ``--reasoning-parser`` deepseek_r1 / qwen3), plain and streamed, read back
through the official ``openai`` client's types and stream accumulator; with a tool-call parser, calls come from the
content only."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvstore.events import Medium
from kvstore.openai.protocol import ModelLimits, decode_chat, parse_chat
from kvstore.openai.reasoning import ReasoningStream, split
from kvstore.openai.responses import ResponseBuilder
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.worker_api import ChoiceDelta, FinishReason, RequestStats, StreamChunk, fold_stream

TOK = ByteTokenizer()
STATS = RequestStats("w0", 5, 3, {Medium.GPU: 0, Medium.CPU: 0, Medium.STORAGE: 0}, 0.0, 0.01, 0.02, 0)
ANSWER = "Let me think: 2 + 2 is 4.</think>\n\nThe answer is 4."


def test_split_as_vllm_splits() -> None:
    assert split(ANSWER) == ("Let me think: 2 + 2 is 4.", "\n\nThe answer is 4.")
    assert split("<think>hmm</think>ok") == ("hmm", "ok")  # a <think> the model wrote is dropped
    assert split("still thinking when cut off") == ("still thinking when cut off", None)
    assert split("done</think>") == ("done", None)  # nothing after the tag: no content


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("text", [ANSWER, "\n<think>hmm</think>ok", "cut off mid-thought </thi", "a</think>"])
def test_the_stream_splits_the_same_however_the_text_is_cut(text: str, size: int) -> None:
    stream = ReasoningStream()
    pieces = [stream.push(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
    reasoning, content = "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)
    want_reasoning, want_content = split(text)
    assert reasoning.strip() == (want_reasoning or "").strip() and content == (want_content or "")


def builder(parser: str | None = "deepseek_r1", tools: bool = False, **body: Any) -> ResponseBuilder:
    extra: dict[str, Any] = {}
    if tools:
        extra = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    raw = json.dumps({"messages": [{"role": "user", "content": "2+2?"}], **extra, **body}).encode()
    parsed = parse_chat(
        decode_chat(raw), TOK, ModelLimits(512, 2048), tool_parser="hermes" if tools else None, reasoning_parser=parser
    )
    return ResponseBuilder(parsed, TOK, model="m", request_id="chatcmpl-r")


def chunks_of(text: str, size: int) -> list[StreamChunk]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    out = [StreamChunk("r", [ChoiceDelta(0, [1], piece)]) for piece in pieces[:-1]]
    return [*out, StreamChunk("r", [ChoiceDelta(0, [1], pieces[-1], None, FinishReason.STOP)], STATS)]


def test_a_plain_body_carries_reasoning_and_content_apart() -> None:
    body = builder().body(fold_stream(chunks_of(ANSWER, 7), 1))
    message = body["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Let me think: 2 + 2 is 4."
    assert message["content"] == "\n\nThe answer is 4."
    assert ChatCompletion.model_validate(body).choices[0].message.content == "\n\nThe answer is 4."
    thinking_off = builder("qwen3", chat_template_kwargs={"enable_thinking": False}).body(
        fold_stream(chunks_of("no thoughts here", 4), 1)
    )
    assert thinking_off["choices"][0]["message"] == {
        "role": "assistant", "content": "no thoughts here", "reasoning": None, "reasoning_content": None
    }  # fmt: skip
    unparsed = builder(None).body(fold_stream(chunks_of(ANSWER, 7), 1))
    assert unparsed["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}


@pytest.mark.parametrize("size", [1, 3, 500])
def test_a_stream_carries_reasoning_then_content_and_calls_come_from_the_content(size: int) -> None:
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    text = "Maybe <tool_call>not here</tool_call>?</think>Calling." + call
    made = builder(tools=True, stream=True)
    state = ChatCompletionStreamState()
    reasoning = []
    for chunk in chunks_of(text, size):
        for event in made.events(chunk):
            payload = json.loads(event[6:])
            for choice in payload["choices"]:
                reasoning.append(choice["delta"].get("reasoning", ""))
                assert choice["delta"].get("reasoning", "") == choice["delta"].get("reasoning_content", "")
            state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    assert "".join(reasoning) == "Maybe <tool_call>not here</tool_call>?"  # tags in the thinking are thinking
    final = state.get_final_completion().choices[0]
    assert final.message.content == "Calling." and final.finish_reason == "tool_calls"
    assert [c.function.name for c in final.message.tool_calls or []] == ["f"]
    plain = builder(tools=True).body(fold_stream(chunks_of(text, 9), 1))["choices"][0]
    assert plain["message"]["reasoning"] == "Maybe <tool_call>not here</tool_call>?"
    assert plain["message"]["content"] == "Calling." and [
        c["function"]["name"] for c in plain["message"]["tool_calls"]
    ] == ["f"]


def test_review_cases_no_thinking_qwen3_a_guided_choice_and_quiet_thinking_deltas() -> None:
    """A qwen3 chat with thinking off still splits at a </think> the model writes (vLLM's parser does), and with
    none is all content; a guided choice is the answer's content, not split; while thinking, a delta whose
    text is held back sends no empty content."""
    off = builder("qwen3", chat_template_kwargs={"enable_thinking": False})
    message = off.body(fold_stream(chunks_of("<think>\n\n</think>\n\nhi", 50), 1))["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("\n\n", "\n\nhi")
    message = off.body(fold_stream(chunks_of("just hi", 50), 1))["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "just hi")
    guided = builder(guided_choice=["yes", "no"]).body(fold_stream(chunks_of("yes", 50), 1))["choices"][0]
    assert guided["message"] == {"role": "assistant", "content": "yes"}
    made = builder(stream=True)
    events = [json.loads(e[6:]) for c in chunks_of("abc</thi", 1) for e in made.events(c)]
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    assert all("content" not in d or d["content"] or "role" in d for d in deltas), deltas
