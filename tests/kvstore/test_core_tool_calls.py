"""Tool calls parsed out of chat answers (vLLM's ``hermes`` parser): the parser on its own, and the bodies and
streams a front builds with it, read back by the official ``openai`` client's own types and stream
accumulator (the oracle for what a client sees)."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvstore.events import Medium
from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import ModelLimits, decode_chat, parse_chat
from kvstore.openai.responses import ResponseBuilder
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.openai.tool_calls import (
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    Piece,
    ToolCallStream,
    extract,
    read_required,
)
from kvstore.worker_api import ChoiceDelta, FinishReason, RequestStats, StreamChunk, fold_stream

TOK = ByteTokenizer()
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | length }}{% endif %}"
)
STATS = RequestStats("w0", 5, 3, {Medium.GPU: 0, Medium.CPU: 0, Medium.STORAGE: 0}, 0.0, 0.01, 0.02, 0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_extract_finds_every_call_and_the_content_before_them() -> None:
    found = extract("Let me check." + WEATHER + "\n" + TIME)
    assert found.content == "Let me check."
    assert [c["function"]["name"] for c in found.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(found.tool_calls[0]["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    assert "Zürich" in found.tool_calls[0]["function"]["arguments"]  # ensure_ascii=False, as vLLM
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in found.tool_calls)
    assert len({c["id"] for c in found.tool_calls}) == 2
    assert extract(WEATHER).content is None  # nothing before the call
    cut = extract('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}')  # the answer ended in the block
    assert cut.content is None and json.loads(cut.tool_calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    for text in ["no calls here", "<tool_call>{not json}</tool_call>", '<tool_call>["a"]</tool_call>',
                 WEATHER + '<tool_call>{"arguments": {}}</tool_call>']:  # fmt: skip
        assert extract(text) == (text, [])  # any bad block: the whole answer is content, as vLLM falls back


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_the_stream_gives_the_same_calls_and_content_however_the_text_is_cut(size: int) -> None:
    text = "Sure <tool" + " thing. " + WEATHER + " then " + TIME + " done <tool_call>{bad}</tool_call> <tool_"
    stream = ToolCallStream()
    content, calls = [], []
    for start in range(0, len(text), size):
        piece = stream.push(text[start : start + size])
        content.append(piece.content)
        calls.extend(piece.tool_calls)
    tail = stream.finish()
    content.append(tail.content)
    calls.extend(tail.tool_calls)
    # text after the first call is no content (as in the plain answer); a block that is not a call still is
    assert "".join(content) == "Sure <tool thing. <tool_call>{bad}</tool_call>"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich", "days": 2}


def test_a_held_back_tag_prefix_goes_out_as_soon_as_the_next_delta_rules_it_out() -> None:
    stream = ToolCallStream()
    assert stream.push("abc <tool_c").content == "abc "
    assert stream.push("ar").content == "<tool_car"
    assert stream.push("<").content == ""
    assert stream.finish().content == "<"


def parsed_chat(parser: str | None = "hermes", **body: Any) -> Any:
    raw = json.dumps({"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
                      "chat_template": TEMPLATE, **body}).encode()  # fmt: skip
    return parse_chat(decode_chat(raw), TOK, ModelLimits(512, 2048), trust_template=True, tool_parser=parser)


def test_auto_needs_a_parser_and_a_forced_call_a_hugging_face_tokenizer() -> None:
    with pytest.raises(ApiError, match="needs a tool-call parser") as info:
        parsed_chat(None)
    assert info.value.param == "tool_choice"
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        with pytest.raises(ApiError, match="Hugging Face tokenizer") as info:  # the byte model has no EOS
            parsed_chat(tool_choice=choice)
        assert info.value.param == "tool_choice"
    parsed = parsed_chat()
    assert parsed.tool_parser == "hermes"
    assert parsed.sampling.skip_special_tokens is False  # tool-call tags may be special tokens, as vLLM keeps them
    assert parsed_chat(tool_choice="none").tool_parser is None  # tools rendered, the answer plain text
    assert parsed_chat(tool_choice="auto").tool_parser == "hermes"


def builder(**body: Any) -> ResponseBuilder:
    return ResponseBuilder(parsed_chat(**body), TOK, model="m", request_id="chatcmpl-1")


def chunks_of(text: str, size: int, finish: FinishReason = FinishReason.STOP) -> list[StreamChunk]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    out = [StreamChunk("r", [ChoiceDelta(0, [1], piece)]) for piece in pieces[:-1]]
    out.append(StreamChunk("r", [ChoiceDelta(0, [1], pieces[-1], None, finish)], STATS))
    return out


def accumulated(made: ResponseBuilder, chunks: list[StreamChunk]) -> tuple[ChatCompletionStreamState, list[str]]:
    """The stream of ``chunks`` read by the openai client's own accumulator, and the finish reasons it carried."""
    state = ChatCompletionStreamState(input_tools=TOOLS)  # type: ignore[arg-type]
    finishes = []
    for chunk in chunks:
        for event in made.events(chunk):
            payload = json.loads(event[6:])
            if payload["choices"] and payload["choices"][0]["finish_reason"] is not None:
                finishes.append(payload["choices"][0]["finish_reason"])
            state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    return state, finishes


def test_a_plain_body_carries_the_calls_as_the_openai_client_reads_them() -> None:
    text = "Checking." + WEATHER
    body = builder().body(fold_stream(chunks_of(text, 7), 1))
    completion = ChatCompletion.model_validate(body)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather")]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Zürich", "days": 2}  # type: ignore[union-attr]
    plain = builder().body(fold_stream(chunks_of("No tools needed.", 4), 1))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "No tools needed.", "tool_calls": []}
    assert plain["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("size", [1, 4, 13, 500])
def test_a_stream_carries_the_calls_as_the_openai_client_accumulates_them(size: int) -> None:
    # what a model writes between and after its calls is no content, as in the plain answer
    text = "Checking." + WEATHER + "\n" + TIME + "\nDone, anything else?\n"
    made = builder(stream=True)
    state, finishes = accumulated(made, chunks_of(text, size))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking."
    assert [c.function.name for c in message.tool_calls or []] == ["get_weather", "get_time"]
    assert json.loads((message.tool_calls or [])[0].function.arguments) == {"city": "Zürich", "days": 2}
    assert [f for f in finishes if f is not None] == ["tool_calls"]


LLAMA_CALLS = '{"name": "get_weather", "parameters": {"city": "Zürich"}}; {"name": "get_time", "arguments": {}}'


def test_llama3_json_reads_every_object_as_a_call_or_leaves_the_answer_as_content() -> None:
    for text in (LLAMA_CALLS, "<|python_tag|>" + LLAMA_CALLS):
        found = extract(text, "llama3_json")
        assert found.content is None
        assert [c["function"]["name"] for c in found.tool_calls] == ["get_weather", "get_time"]
        assert json.loads(found.tool_calls[0]["function"]["arguments"]) == {"city": "Zürich"}  # parameters, as vLLM
    for text in ["It is sunny.", "use {braces} loosely", '{"city": "Paris"}', '{"name": "f"} and {oops']:
        assert extract(text, "llama3_json") == (text, [])


@pytest.mark.parametrize("size", [1, 3, 500])
def test_llama3_json_streams_prose_as_it_comes_and_holds_a_json_answer_whole(size: int) -> None:
    def run(text: str) -> tuple[str, list[dict[str, Any]], list[str]]:
        stream = ToolCallStream("llama3_json")
        content, calls, early = [], [], []
        for start in range(0, len(text), size):
            piece = stream.push(text[start : start + size])
            content.append(piece.content)
            early.append(piece.content)
            calls.extend(piece.tool_calls)
        tail = stream.finish()
        return "".join(content) + tail.content, calls + tail.tool_calls, early

    content, calls, early = run("<|python_tag|>" + LLAMA_CALLS)
    assert content == "" and [(c["index"], c["function"]["name"]) for c in calls] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    content, calls, early = run("<|pyth is not a tag, and {this} is prose.")
    assert content == "<|pyth is not a tag, and {this} is prose." and calls == []
    assert "".join(early) == content  # streamed as it came, not held to the end
    content, calls, _ = run('{"no": "name"}')
    assert content == '{"no": "name"}' and calls == []


def test_a_llama3_json_stream_reads_back_as_calls_through_the_openai_client() -> None:
    made = ResponseBuilder(parsed_chat("llama3_json", stream=True), TOK, model="m", request_id="chatcmpl-2")
    state, _ = accumulated(made, chunks_of("<|python_tag|>" + LLAMA_CALLS, 5))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [c.function.name for c in final.message.tool_calls or []] == ["get_weather", "get_time"]
    body = ResponseBuilder(parsed_chat("llama3_json"), TOK, model="m", request_id="c").body(
        fold_stream(chunks_of(LLAMA_CALLS, 9), 1)
    )
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == "tool_calls"


def test_review_cases_prose_in_llama3_json_and_calls_without_arguments() -> None:
    """A llama3_json answer that is prose streams as it came, whatever tags it holds, however it is cut; a call
    without its arguments is no call, as in vLLM's parsers (the answer stays content)."""
    for text in ["see <tool_call> and more", 'prose <tool_call>{"name": "f", "arguments": {}}</tool_call> end']:
        for size in (1, 3, 1000):
            stream = ToolCallStream("llama3_json")
            pieces = [stream.push(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
            assert "".join(p.content for p in pieces) == text and not any(p.tool_calls for p in pieces)
    assert extract('<tool_call>{"name": "f"}</tool_call>') == ('<tool_call>{"name": "f"}</tool_call>', [])
    assert extract('{"name": "f"}', "llama3_json") == ('{"name": "f"}', [])


def test_a_required_answer_cut_short_streams_its_whole_calls_and_ends_with_length() -> None:
    """As the plain body: ``tool_calls`` only for a whole answer; the calls that closed still went out."""
    text = '[{"name": "get_weather", "parameters": {"city": "Nice"}}, {"name": "get_weather", "param'
    parsed = parsed_chat(tool_choice="none")._replace(tools_required=True, tool_parser=None)
    for finish, expected in [(FinishReason.LENGTH, "length"), (FinishReason.STOP, "tool_calls")]:
        whole = text if finish is FinishReason.LENGTH else text[: text.index(", {")] + "]"
        made = ResponseBuilder(parsed, TOK, model="m", request_id="chatcmpl-1")
        state, finishes = accumulated(made, chunks_of(whole, 9, finish))
        message = state.current_completion_snapshot.choices[0].message  # the final one refuses a "length"
        assert [f for f in finishes if f] == [expected]
        streamed_content = message.content
        assert [json.loads(c.function.arguments) for c in message.tool_calls or []] == [{"city": "Nice"}]
        plain = ResponseBuilder(parsed, TOK, model="m", request_id="chatcmpl-1").body(
            fold_stream(chunks_of(whole, 9, finish), 1)
        )["choices"][0]
        assert plain["finish_reason"] == expected
        assert [json.loads(c["function"]["arguments"]) for c in plain["message"]["tool_calls"]] == [{"city": "Nice"}]
        # cut short: the calls that closed, and what follows them as content -- the same plain and streamed
        assert (
            plain["message"]["content"]
            == (streamed_content or "")
            == ("" if finish is FinishReason.STOP else '{"name": "get_weather", "param')
        )


def test_a_named_call_cut_short_while_thinking_makes_no_call() -> None:
    """With a reasoning parser the answer's thinking comes first; cut short before it ends, there are no arguments,
    so there is no call, plain or streamed."""
    parsed = parsed_chat(tool_choice="none")._replace(named_tool="get_weather", tool_parser=None,
                                                      reasoning_parser="deepseek_r1")  # fmt: skip
    plain = ResponseBuilder(parsed, TOK, model="m", request_id="chatcmpl-1").body(
        fold_stream(chunks_of("still thinking", 5, FinishReason.LENGTH), 1)
    )["choices"][0]
    assert plain["message"]["tool_calls"] == [] and plain["message"]["reasoning"] == "still thinking"
    made = ResponseBuilder(parsed, TOK, model="m", request_id="chatcmpl-1")
    streamed = [json.loads(e[6:]) for c in chunks_of("still thinking", 5, FinishReason.LENGTH) for e in made.events(c)]
    assert not any(c["choices"] and "tool_calls" in c["choices"][0]["delta"] for c in streamed)


MISTRAL_V03 = 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}}, {"name": "get_time"}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "days": 2}[TOOL_CALLS]get_time{}'
PYTHONIC = '[get_weather(city="Paris", days=2, hourly=True, tags=["a", None]), get_time()]'


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("mistral", MISTRAL_V03, "Sure.", [("get_weather", {"city": "Zürich"}), ("get_time", {})]),
        ("mistral", MISTRAL_V11, None, [("get_weather", {"city": "Nice", "days": 2}), ("get_time", {})]),
        ("mistral", "No tools.", "No tools.", []),
        ("mistral", "x[TOOL_CALLS] [{not json", "x[TOOL_CALLS] [{not json", []),  # as written, all content
        ("mistral", "[TOOL_CALLS]no_arguments", "[TOOL_CALLS]no_arguments", []),
        ("pythonic", PYTHONIC, None,
         [("get_weather", {"city": "Paris", "days": 2, "hourly": True, "tags": ["a", None]}), ("get_time", {})]),
        ("pythonic", "<|python_start|>[get_time(zone='utc')]<|python_end|>", None, [("get_time", {"zone": "utc"})]),
        ("pythonic", "  [get_time()]\n", None, [("get_time", {})]),
        ("pythonic", "get_time()", "get_time()", []),  # not a list
        ("pythonic", "[get_time(zone=utc)]", "[get_time(zone=utc)]", []),  # not a literal
        ("pythonic", "[get_time(1)]", "[get_time(1)]", []),  # positional
        ("pythonic", "[1, 2]", "[1, 2]", []),
        ("pythonic", "[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set: no JSON for it
        ("pythonic", "[Sure, I can help.]", "[Sure, I can help.]", []),
    ],
)  # fmt: skip
def test_mistral_and_pythonic_answers(parser: str, text: str, content: str | None, calls: list[Any]) -> None:
    found = extract(text, parser)
    assert found.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found.tool_calls] == calls
    if parser == "mistral":  # Mistral's templates take 9 letters and digits as a call id
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in found.tool_calls)


def test_a_mistral_v11_call_keeps_its_arguments_as_written() -> None:
    (call,) = extract("[TOOL_CALLS]f{'not': json}", "mistral").tool_calls
    assert call["function"] == {"name": "f", "arguments": "{'not': json}"}  # as vLLM keeps them


def streams_as_plain(parsed: Any, text: str, size: int) -> dict[str, Any]:
    """Assert that ``text`` streamed in pieces of ``size``, read by the openai client's accumulator, gives the
    plain body's calls, content and finish reason; returns the plain body's choice."""
    body = ResponseBuilder(parsed, TOK, model="m", request_id="c").body(fold_stream(chunks_of(text, size), 1))
    expected: dict[str, Any] = body["choices"][0]
    made = ResponseBuilder(parsed, TOK, model="m", request_id="c")
    state, finishes = accumulated(made, chunks_of(text, size))
    message = state.get_final_completion().choices[0].message
    got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in expected["message"]["tool_calls"]]
    assert got == want, (text, size)
    assert (message.content or None) == expected["message"]["content"], (text, size)
    assert [f for f in finishes if f] == [expected["finish_reason"]]
    return expected


@pytest.mark.parametrize("parser", ["mistral", "pythonic"])
@pytest.mark.parametrize("size", [1, 3, 11, 500])
def test_mistral_and_pythonic_stream_as_the_plain_body_reads(parser: str, size: int) -> None:
    texts = [MISTRAL_V03, MISTRAL_V11, "Plain [TOOL_CALLS prose."] if parser == "mistral" else [
        PYTHONIC, "  " + PYTHONIC, "[not, a call", "Plain prose [with brackets]."]  # fmt: skip
    for text in texts:
        streams_as_plain(parsed_chat(parser), text, size)


MISTRAL_STREAMS = [
    "Let me check. " + MISTRAL_V11,
    '[TOOL_CALLS]f{"a": 1}  \n [TOOL_CALLS] g [ARGS] {"b": [1, 2]}\n\n',  # whitespace around each part
    "[TOOL_CALLS]   [TOOL_CALLS]f{}",  # an empty first segment: v11
    "[TOOL_CALLS]no_arguments[TOOL_CALLS]f{'as': written} and more [TOOL_CA",  # a name alone is no call
    "Prose [TOOL_CALLS]only a name",
    "[TOOL_CALLS]  ",
    "[TOOL_CALLS] [{not json",
    '[TOOL_CALLS]{"no": "name"}',
    "x[TOOL_CALLS][ARGS]{}",
]


@pytest.mark.parametrize("size", [1, 2, 5, 13, 500])
def test_mistral_v11_streams_as_the_plain_body_reads(size: int) -> None:
    for text in MISTRAL_STREAMS:
        streams_as_plain(parsed_chat("mistral"), text, size)


def test_a_mistral_v11_call_goes_out_as_its_arguments_come() -> None:
    """Each call's name as soon as its arguments begin, then the arguments as they come (whitespace that may end
    them held back), not at the end of the answer."""
    stream = ToolCallStream("mistral")
    assert stream.push("Sure. [TOOL_") == Piece("Sure. ", [])
    assert stream.push("CALLS]get_weather[AR") == Piece("", [])
    first = stream.push('GS]{"city": ')
    (call,) = first.tool_calls
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    assert stream.push('"Nice"}  [TOOL') == Piece("", [{"index": 0, "function": {"arguments": ' "Nice"}'}}])
    second = stream.push("_CALLS]get_time{")
    assert [c["index"] for c in second.tool_calls] == [1]
    assert second.tool_calls[0]["function"] == {"name": "get_time", "arguments": "{"}
    assert stream.push("}\n") == Piece("", [{"index": 1, "function": {"arguments": "}"}}])
    assert stream.finish() == Piece("", []) and stream.calls == 2


def test_a_chunk_carries_one_entry_per_call() -> None:
    """The last chunk joins what the stream sent with what its end released: one entry per call there too."""
    made = ResponseBuilder(parsed_chat("mistral"), TOK, model="m", request_id="c")
    text = "[TOOL_CALLS]f{} [TOOL_C"
    payloads = [json.loads(event[6:]) for chunk in chunks_of(text, len(text)) for event in made.events(chunk)]
    sent = [c for payload in payloads for choice in payload["choices"] for c in choice["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in sent] == [(0, {"name": "f", "arguments": "{} [TOOL_C"})]


def test_a_mistral_v03_array_is_held_to_the_end() -> None:
    stream = ToolCallStream("mistral")
    head, tail = MISTRAL_V03[:60], MISTRAL_V03[60:]
    assert stream.push(head) == Piece("Sure.", []) and stream.push(tail) == Piece("", [])
    end = stream.finish()
    assert [c["function"]["name"] for c in end.tool_calls] == ["get_weather", "get_time"] and end.content == ""


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic", "deepseek_v3", "glm45", "kimi_k2"])
def test_a_runaway_or_unencodable_answer_falls_back_or_is_escaped(parser: str) -> None:
    """A model stuck writing brackets must not crash the answer (the JSON reader's recursion limit), and a call
    whose string holds a lone surrogate (an escape the model wrote) must still encode as UTF-8."""
    opener = {"hermes": "<tool_call>", "llama3_json": "", "mistral": "Sure.[TOOL_CALLS]", "pythonic": "",
              "deepseek_v3": DS_CALLS + DS_CALL, "glm45": "<tool_call>",
              "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>"}[parser]  # fmt: skip
    deep = opener + "[" * 1200 + "{" * 1200
    found = extract(deep, parser)
    assert found.content == deep and not found.tool_calls
    made = ResponseBuilder(parsed_chat(parser), TOK, model="m", request_id="c")
    body = made.body(fold_stream(chunks_of(deep, 64), 1))
    assert body["choices"][0]["message"]["content"] == deep
    lone = {
        "hermes": '<tool_call>{"name": "f", "arguments": {"city": "\\ud83d"}}</tool_call>',
        "llama3_json": '{"name": "f", "parameters": {"city": "\\ud83d"}}',
        "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"city": "\\ud83d"}}]',
        "pythonic": "[f(city='\\ud83d\\ude00')]",
        "deepseek_v3": DS_CALLS + DS_CALL + "f" + DS_SEP + '{"city": "\\ud83d"}' + DS_CALL_END,
        "glm45": '<tool_call>f\n<arg_key>city</arg_key><arg_value>"\\ud83d"</arg_value></tool_call>',
        "kimi_k2": '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"city": "\\ud83d"}<|tool_call_end|>',
    }[parser]
    (call,) = extract(lone, parser).tool_calls
    call["function"]["arguments"].encode("utf-8")  # no lone surrogate left in the text
    assert json.loads(call["function"]["arguments"])["city"] in ("\ud83d", "\U0001f600")  # a pair reads as one
    body = ResponseBuilder(parsed_chat(parser), TOK, model="m", request_id="c").body(fold_stream(chunks_of(lone, 7), 1))
    assert msgspec.json.encode(body)  # the answer encodes


# Qwen3-Coder's XML-like calls: values raw between tags, read by the type each parameter declares.
QWEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"}, "hourly": {"type": "boolean"},
    "tags": {"type": "array"}, "opts": {"type": "object"}, "note": {"description": "no type"},
    "maybe": {"type": ["integer", "null"]}}}}}, {"type": "function", "function": {"name": "get_time"}}]  # fmt: skip
QWEN_CALLS = (
    "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan\nFrancisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=temp>\n21.0\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n"
    '<parameter=tags>\n[\'a\', 1]\n</parameter>\n<parameter=opts>\n{"units": "C"}\n</parameter>\n'
    "<parameter=note>\n7\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n<parameter=extra>\n1.5\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
QWEN_WEATHER = {"city": "San\nFrancisco", "days": 3, "temp": 21, "hourly": True, "tags": ["a", 1],
                "opts": {"units": "C"}, "note": "7", "maybe": None, "extra": "1.5"}  # fmt: skip


def qwen_types() -> Any:
    return parsed_chat("qwen3_coder", tools=QWEN_TOOLS).tool_types


def test_qwen3_coder_reads_each_value_by_its_declared_type() -> None:
    types = qwen_types()
    assert types["get_weather"]["maybe"] == "integer" and types["get_time"] == {}
    found = extract(QWEN_CALLS, "qwen3_coder", types)
    assert found.content == "Let me look.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found.tool_calls] == [
        ("get_weather", QWEN_WEATHER), ("get_time", {})]  # fmt: skip
    assert all(c["id"].startswith("chatcmpl-tool-") for c in found.tool_calls)
    # read as vLLM reads them: bad numbers stay text, non-finite numbers too, a literal JSON cannot hold too
    odd = ("<tool_call><function=get_weather><parameter=days>many</parameter><parameter=temp>inf</parameter>"
           "<parameter=tags>{1, 2}</parameter><parameter=hourly>yes</parameter></function></tool_call>")  # fmt: skip
    (call,) = extract(odd, "qwen3_coder", types).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"days": "many", "temp": "inf", "tags": "{1, 2}",
                                                         "hourly": False}  # fmt: skip
    # several calls in one block; the last cut off by the end of the answer; no types: text
    cut = "<tool_call><function=get_time></function><function=get_weather><parameter=city>\nOslo"
    read = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in extract(cut, "qwen3_coder")[1]]
    assert read == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    for text in ["no calls", '<tool_call>{"name": "f"}</tool_call>', "<tool_call><function=>x</function></tool_call>",
                 "<tool_call><function=f</tool_call>", "<tool_call>prose</tool_call> and <function=f"]:  # fmt: skip
        assert extract(text, "qwen3_coder", types) == (text, [])  # any block without a call: all content


QWEN_PASSED_OVER = [QWEN_CALLS + "<tool_call>prose</tool_call>", "Hm <tool_call>prose</tool_call>" + QWEN_CALLS]
QWEN_BARE = [
    "Sure.\n<function=get_time>\n</function>",
    "<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function> then <function=get_time>",
    "Sure <function=get_time></function> and <tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
    "Sure <function=get_time</function>",  # a function with no name's end: all content
    "Almost <function",
]


def test_qwen3_coder_passes_over_a_block_without_a_function_and_reads_calls_without_blocks() -> None:
    """As vLLM: a ``<tool_call>`` block with no ``<function=`` adds no call and spoils none; an answer with no block
    at all has its bare ``<function=`` calls read, the text before the first as content."""
    types = qwen_types()
    for text, content in zip(QWEN_PASSED_OVER, ["Let me look.\n", "Hm "], strict=True):
        found = extract(text, "qwen3_coder", types)
        assert found.content == content and [c["function"]["name"] for c in found.tool_calls] == [
            "get_weather", "get_time"]  # fmt: skip
    read = [extract(text, "qwen3_coder", types) for text in QWEN_BARE]
    assert read[0].content == "Sure.\n" and [c["function"]["name"] for c in read[0].tool_calls] == ["get_time"]
    assert read[1].content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read[1].tool_calls] == [
        ("get_weather", {"days": 2}), ("get_time", {})]  # fmt: skip
    assert read[2].content == "Sure <function=get_time></function> and "  # a block: only blocks are read
    assert [c["function"]["name"] for c in read[2].tool_calls] == ["get_weather"]
    assert read[3] == (QWEN_BARE[3], []) and read[4] == (QWEN_BARE[4], [])


@pytest.mark.parametrize("size", [1, 4, 9, 500])
def test_qwen3_coder_passed_over_blocks_and_bare_calls_stream_as_the_plain_body_reads(size: int) -> None:
    for text in [*QWEN_PASSED_OVER, *QWEN_BARE, "x<tool_call>prose</tool_call> y <tool_call>more</tool_call>"]:
        streams_as_plain(parsed_chat("qwen3_coder", tools=QWEN_TOOLS), text, size)


@pytest.mark.parametrize("size", [1, 3, 11, 500])
def test_qwen3_coder_streams_as_the_plain_body_reads(size: int) -> None:
    cut_short = [QWEN_CALLS[:-24], QWEN_CALLS[: QWEN_CALLS.index("</parameter>")]]  # the answer ends in a call
    after = [QWEN_CALLS + "\nDone, anything else?", "x<tool_call>not a call</tool_call> y"]
    for text in [QWEN_CALLS, "Plain <tool_ prose.", *cut_short, *after]:
        last = streams_as_plain(parsed_chat("qwen3_coder", tools=QWEN_TOOLS), text, size)
    assert last["message"]["tool_calls"] == [] and last["finish_reason"] == "stop"  # the last text: no call
    first = ResponseBuilder(parsed_chat("qwen3_coder", tools=QWEN_TOOLS), TOK, model="m", request_id="c")
    message = ChatCompletion.model_validate(first.body(fold_stream(chunks_of(QWEN_CALLS, 9), 1))).choices[0]
    assert message.finish_reason == "tool_calls" and json.loads(
        (message.message.tool_calls or [])[0].function.arguments) == QWEN_WEATHER  # type: ignore[union-attr]  # fmt: skip


def test_qwen3_coder_survives_runaway_and_unencodable_values() -> None:
    types = qwen_types()
    deep = "<tool_call><function=get_weather><parameter=opts>" + "[" * 1200 + "{" * 1200
    (call,) = extract(deep, "qwen3_coder", types).tool_calls  # JSON and literal readers give up: the text
    assert json.loads(call["function"]["arguments"]) == {"opts": "[" * 1200 + "{" * 1200}
    lone = '<tool_call><function=get_weather><parameter=opts>{"k": "\\ud83d"}</parameter></function></tool_call>'
    (call,) = extract(lone, "qwen3_coder", types).tool_calls
    call["function"]["arguments"].encode("utf-8")  # escaped: no lone surrogate left in the text
    assert json.loads(call["function"]["arguments"]) == {"opts": {"k": "\ud83d"}}


def test_qwen3_coder_values_at_the_json_readers_depth_and_what_json_cannot_carry() -> None:
    """A value nested just deep enough to read but not to write back inside its call is no call (never an
    exception), at whatever depth the readers' limits fall; NaN and infinities stay text."""
    types = qwen_types()
    for depth in range(850, 1150, 3):
        text = "<tool_call><function=get_weather><parameter=opts>" + "[" * depth + "]" * depth + "</parameter>"
        found = extract(text, "qwen3_coder", types)
        assert found.tool_calls or found.content == text
        made = ResponseBuilder(parsed_chat("qwen3_coder", tools=QWEN_TOOLS), TOK, model="m", request_id="c")
        assert made.body(fold_stream(chunks_of(text, 64), 1))["choices"]
    for raw in ["NaN", "[1e999]", '{"t": Infinity}']:
        text = f"<tool_call><function=get_weather><parameter=opts>{raw}</parameter></function></tool_call>"
        (call,) = extract(text, "qwen3_coder", types).tool_calls
        assert json.loads(call["function"]["arguments"]) == {"opts": raw}


# DeepSeek: V3's typed, fenced calls and V3.1's name and arguments, after the calls' opening tag.
DS_V3 = (
    f'Let me check.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Zürich"}}\n```{DS_CALL_END}\n'
    f"{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}"
)
DS_V31 = f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Nice", "days": 2}}{DS_CALL_END}{DS_CALLS_END}'


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_calls_in_both_forms(parser: str) -> None:
    found = extract(DS_V3, parser)
    assert found.content == "Let me check."
    read = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found.tool_calls]
    assert read == [("get_weather", {"city": "Zürich"}), ("get_time", {})]
    found = extract(DS_V31, parser)
    assert found.content is None
    assert json.loads(found.tool_calls[0]["function"]["arguments"]) == {"city": "Nice", "days": 2}
    cut = DS_V3[: DS_V3.index("Zürich") + 3]  # the answer ends inside the first call: arguments kept as written
    assert extract(cut, parser) == (cut, [])  # would be cut short too, so a call needs its closing tag, as in vLLM
    cut_early = [f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather", f"{DS_CALL}function{DS_SEP}get_weather\n```"]
    for text in ["no calls", f"x{DS_CALLS}", f"{DS_CALLS}{DS_CALL}no separator{DS_CALL_END}", *cut_early,
                 f"{DS_CALL}function{DS_SEP}{DS_CALL_END}", DS_V31 + f"{DS_CALL}bad{DS_CALL_END}"]:  # fmt: skip
        assert extract(text, parser) == (text, [])  # any block without a call: all content


@pytest.mark.parametrize("size", [1, 3, 11, 500])
def test_deepseek_streams_as_the_plain_body_reads(size: int) -> None:
    cut = DS_V3[: DS_V3.index("Zürich") + 3]
    bad = f"x{DS_CALLS}{DS_CALL}no separator{DS_CALL_END} y"
    for text in [DS_V3, DS_V31, cut, "Plain <｜tool prose.", f"x{DS_CALLS}", f"x{DS_CALLS}\n", bad, DS_V3 + " Done.",
                 f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather", bad + DS_V31]:  # fmt: skip
        streams_as_plain(parsed_chat("deepseek_v3"), text, size)
    # a bad block after a call: the call went out already, and only the block follows as content
    after = f"a{DS_CALLS}b{DS_CALL}f{DS_SEP}{{}}{DS_CALL_END}c{DS_CALL}x{DS_CALL_END}"
    stream = ToolCallStream("deepseek_v3")
    pieces = [stream.push(after[i : i + size]) for i in range(0, len(after), size)] + [stream.finish()]
    assert "".join(p.content for p in pieces) == f"a{DS_CALL}x{DS_CALL_END}"
    assert [c["function"]["name"] for p in pieces for c in p.tool_calls] == ["f"]


@pytest.mark.parametrize("size", [1, 4, 500])
def test_a_bad_block_before_any_call_makes_the_stream_all_content_as_the_plain_answer(size: int) -> None:
    good = {"hermes": WEATHER, "qwen3_coder": QWEN_CALLS, "deepseek_v3": DS_V31}
    bad = {"hermes": "<tool_call>x</tool_call>", "qwen3_coder": "<tool_call><function=x</tool_call>",
           "deepseek_v3": f"{DS_CALL}x{DS_CALL_END}"}  # fmt: skip
    for parser, call in good.items():
        expected = streams_as_plain(parsed_chat(parser, tools=QWEN_TOOLS), "Hm. " + bad[parser] + call, size)
        assert expected["finish_reason"] == "stop" and expected["message"]["tool_calls"] == []
    for text in ['Sure: {"name": "get_time", "parameters": {}}', '{"name": "get_time", "parameters": {}}']:
        streams_as_plain(parsed_chat("llama3_json"), text, size)  # calls only when the answer starts as one


# GLM-4.5: the name on the block's first line, then key / value pairs, values read unless declared strings.
GLM_CALLS = (
    "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>1999</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>['a', 1]</arg_value>\n"
    "<arg_key>note</arg_key>\n<arg_value>7</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>not json</arg_value>\n"
    "</tool_call>\n<tool_call>get_time\n</tool_call>"
)
# Kimi K2: ids functions.NAME:INDEX, kept as the calls' ids.
KIMI = (
    "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
    "<|tool_call_end|><|tool_calls_section_end|>"
)


def test_glm45_and_kimi_k2_calls() -> None:
    types = parsed_chat("glm45", tools=QWEN_TOOLS).tool_types
    found = extract(GLM_CALLS, "glm45", types)
    assert found.content == "Checking.\n"
    read = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found.tool_calls]
    # city is a string (kept, digits and all); days, tags, note (no type) and the undeclared extra are read, or kept
    assert read == [("get_weather", {"city": "1999", "days": 3, "tags": ["a", 1], "note": 7,
                                     "extra": "not json"}), ("get_time", {})]  # fmt: skip
    spaced = "<tool_call>get_weather<arg_key>city</arg_key> <arg_value>\n  Paris\n</arg_value></tool_call>"
    (call,) = extract(spaced, "glm45", types).tool_calls  # no newline after the name; a string kept as written
    assert json.loads(call["function"]["arguments"]) == {"city": "\n  Paris\n"}
    cut = "<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC</arg_value>"  # a call needs its closing tag
    assert extract(cut, "glm45") == (cut, [])
    for text in ["<tool_call>\n<arg_key>a</arg_key></tool_call>", "<tool_call><arg_key>a</arg_key><arg_value>1"]:
        assert extract(text, "glm45") == (text, [])  # no name: no call, all content
    found = extract(KIMI, "kimi_k2")
    assert found.content == "Sure."
    read = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in found.tool_calls]
    assert read == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                    ("functions.get_time:1", "get_time", "{}")]  # fmt: skip
    call = extract(KIMI.replace("get_time", "get-time"), "kimi_k2").tool_calls[1]
    assert (call["id"], call["function"]["name"]) == ("functions.get-time:1", "get-time")  # MCP-style names
    bad_id = "<|tool_calls_section_begin|><|tool_call_begin|>get weather<|tool_call_argument_begin|>{}<|tool_call_end|>"
    no_name = "<|tool_call_begin|>functions.:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    for text in [bad_id, no_name, "x<|tool_calls_section_begin|>", "<|tool_call_begin|>functions.f:0<|tool_call_end|>"]:
        assert extract(text, "kimi_k2") == (text, [])


@pytest.mark.parametrize("size", [1, 3, 11, 500])
def test_glm45_and_kimi_k2_stream_as_the_plain_body_reads(size: int) -> None:
    for text in [GLM_CALLS, GLM_CALLS[:-30], GLM_CALLS + "\nDone.", "Plain <tool_ prose.", "<tool_call>\n</tool_call>"]:
        streams_as_plain(parsed_chat("glm45", tools=QWEN_TOOLS), text, size)
    cut = KIMI[: KIMI.index("Paris")]  # inside the first call: no call (its arguments would be cut short)
    for text in [KIMI, cut, "x<|tool_calls_section_begin|>", "Plain <|tool_calls prose.", KIMI + " Done."]:
        streams_as_plain(parsed_chat("kimi_k2"), text, size)


def test_a_required_call_at_the_json_readers_depth_is_no_call() -> None:
    """A forced call whose parameters nest just deep enough to read but not to write back is no call (never an
    exception), at whatever depth the readers' limits fall."""
    for depth in range(850, 1150, 3):
        text = '[{"name": "f", "parameters": {"a": ' + "[" * depth + "]" * depth + "}}]"
        calls, rest, _ = read_required(text)
        assert calls or rest == text
