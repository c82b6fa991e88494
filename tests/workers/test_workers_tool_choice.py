"""A named or ``"required"`` ``tool_choice``: the answer is held by a grammar to the tool's arguments (or to an
array of calls), and comes back as ``tool_calls``, plain and streamed, as vLLM answers them -- checked with
``jsonschema`` against each tool's parameters, and streamed through the official client's accumulator."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from workers_testlib import make_config

from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import ModelLimits, decode_chat, parse_chat
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.openai.tool_calls import NamedCallStream, RequiredCallStream, read_required
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests import openai_conformance as check
from tests.checkpoints import VOCAB, TinyCheckpoint
from tests.http_servers import ServerThread

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "additionalProperties": False,
    "$defs": {"zone": {"enum": ["utc", "cet"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def server(qwen2_checkpoint: TinyCheckpoint) -> Iterator[tuple[str, str]]:
    worker = KVWorker("tool-choice", make_config(num_blocks=96, model=str(qwen2_checkpoint.path)))
    running = ServerThread(create_worker_app(worker)).start()
    yield running.url, worker.info().model_name
    running.stop()
    worker.shutdown()


def _checked(name: str, arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    jsonschema.validate(value, PARAMETERS[name])
    return value


def test_a_named_tool_choice_answers_one_call_of_that_function(server: tuple[str, str]) -> None:
    url, model = server
    client = check.client(url)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=80, temperature=1.0,  # type: ignore[arg-type]
            seed=seed, extra_body=COMPACT,
        )  # fmt: skip
        choice = answer.choices[0]
        assert choice.message.content == "" and choice.finish_reason == "stop", choice  # as vLLM answers
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")  # type: ignore[union-attr]
        _checked("get_weather", call.function.arguments)  # type: ignore[union-attr]
    # flexible whitespace (vLLM's default): the arguments still parse
    loose = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=0.0,  # type: ignore[arg-type]
    )  # fmt: skip
    if loose.choices[0].finish_reason == "stop":
        _checked("get_weather", (loose.choices[0].message.tool_calls or [])[0].function.arguments)  # type: ignore[union-attr]


def test_required_answers_calls_of_the_tools_with_their_parameters(server: tuple[str, str]) -> None:
    url, model = server
    client = check.client(url)
    names = set()
    finished = 0
    for seed in range(8):
        answer = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=1.0,  # type: ignore[arg-type]
            seed=seed, extra_body=COMPACT, parallel_tool_calls=seed % 3 != 0,  # false: one call at most
        )  # fmt: skip
        choice = answer.choices[0]
        if choice.finish_reason == "length":  # cut short: the calls that closed, the rest as content
            for call in choice.message.tool_calls or []:
                _checked(call.function.name, call.function.arguments)  # type: ignore[union-attr]
            assert choice.message.content
            continue
        finished += 1
        assert choice.finish_reason == "tool_calls" and choice.message.content == "", choice
        calls = choice.message.tool_calls or []
        assert calls and len({c.id for c in calls}) == len(calls)
        assert seed % 3 != 0 or len(calls) == 1
        for call in calls:
            names.add(call.function.name)  # type: ignore[union-attr]
            _checked(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    assert finished >= 3 and names <= set(PARAMETERS), (finished, names)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_streams_as_the_client_accumulates_it(server: tuple[str, str], choice: Any) -> None:
    url, model = server
    body = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120,
            "temperature": 1.0, "seed": 4, "stream": True, "parallel_tool_calls": False, **COMPACT}  # fmt: skip
    plain = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    state = ChatCompletionStreamState(input_tools=TOOLS)  # type: ignore[arg-type]
    finishes = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                if payload["choices"]:
                    finishes.append(payload["choices"][0]["finish_reason"])
                state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    final = state.get_final_completion().choices[0]
    expected = ChatCompletion.model_validate(plain).choices[0]
    assert [f for f in finishes if f] == [expected.finish_reason]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls or []]  # type: ignore[union-attr]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in expected.message.tool_calls or []]  # type: ignore[union-attr]
    assert got == want and got, (got, want)  # the same seed: the same calls, plain or streamed
    for name, value in got:
        jsonschema.validate(value, PARAMETERS[name])


def test_streams_of_forced_calls_split_anywhere() -> None:
    text = '[{"name":"get_weather","parameters":{"city":"Nice","unit":"c"}}, {"name":"get_time","parameters":{}}]'
    whole, rest, complete = read_required(text)
    assert rest == "" and complete
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert [name for name, _ in expected] == ["get_weather", "get_time"]
    for size in (1, 2, 5, 17, len(text)):
        stream = RequiredCallStream()
        calls = []
        for start in range(0, len(text), size):
            calls += stream.push(text[start : start + size]).tool_calls
        tail = stream.finish()
        assert tail.content == "" and not tail.tool_calls
        assert [c["index"] for c in calls] == [0, 1]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected
    cut = RequiredCallStream()
    assert len(cut.push(text[:80]).tool_calls) == 1
    assert cut.finish().content == '{"name":"get_ti'  # what never became a call is shown as text
    named = NamedCallStream("get_time")
    first, empty, more = named.push('{"zo'), named.push(""), named.push('ne":"utc"}')
    assert first.tool_calls[0]["function"] == {"name": "get_time", "arguments": '{"zo'} and "id" in first.tool_calls[0]
    assert not empty.tool_calls and more.tool_calls == [{"index": 0, "function": {"arguments": 'ne":"utc"}'}}]
    assert read_required('[{"name": "x"}]') == ([], '[{"name": "x"}]', False)  # not a call: all of it is text
    calls, rest, complete = read_required('[{"name":"x","parameters":{}}, {"na')
    assert [c["function"]["name"] for c in calls] == ["x"] and rest == '{"na' and not complete


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
         "not one of"),
        ({"tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "named"),
        ({"tool_choice": "sometimes"}, "tool_choice", "required"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
        ({"tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs.regex", "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "bad"}},
          "tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "strang"}}}]},
         "tool_choice", "strang"),
        ({"tool_choice": {"type": "function", "function": {"name": "bad"}},
          "tools": [{"type": "function", "function": {"name": "bad", "parameters": False}}]},
         "tool_choice", "admits no value"),  # false is a schema, not a missing one
        ({"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "a", "parameters": {"$defs": {"z": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {"$defs": {"z": {"type": "integer"}}}}}]},
         "tools[1].function.parameters", "$defs"),
    ],
)  # fmt: skip
def test_what_a_forced_call_cannot_be_is_a_400(
    qwen2_checkpoint: TinyCheckpoint, body: dict[str, Any], param: str, words: str
) -> None:
    tokenizer = load_tokenizer(str(qwen2_checkpoint.path))
    request = decode_chat(json.dumps({"messages": MESSAGES, "tools": TOOLS, **body}).encode())
    with pytest.raises(ApiError) as refused:
        parse_chat(request, tokenizer, ModelLimits(vocab_size=VOCAB, max_context=512))
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert words in refused.value.message, refused.value.message


def test_a_forced_call_needs_no_tool_call_parser_and_turns_auto_parsing_off(qwen2_checkpoint: TinyCheckpoint) -> None:
    tokenizer = load_tokenizer(str(qwen2_checkpoint.path))
    limits = ModelLimits(vocab_size=VOCAB, max_context=512)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        request = decode_chat(json.dumps({"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}).encode())
        parsed = parse_chat(request, tokenizer, limits, tool_parser="hermes")
        assert parsed.sampling.grammar and parsed.tool_parser is None
        assert (parsed.named_tool, parsed.tools_required) == (
            (None, True) if choice == "required" else ("get_time", False)
        )
