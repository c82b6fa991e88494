"""Chat templates and tokenizers against transformers: the rendered text and the token ids must be identical.

Each family (Llama-3, ChatML as Qwen2.5 writes it, Mistral) gets a small
byte-level BPE tokenizer trained here with that family's special tokens,
wrapped by transformers and saved as a model directory; kvstore's
:class:`HFTokenizer` loads the same directory. transformers'
``apply_chat_template`` is the oracle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvstore.openai.chat_template import ChatTemplate, ChatTemplateError
from kvstore.openai.detokenizer import IncrementalDetokenizer
from kvstore.openai.tokenizer import HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
CORPUS = [
    "The KV cache keeps computed attention keys and values so a repeated prefix is not recomputed.",
    "Blocks spill from the GPU to a CPU arena and on to disk files, and come back on a hit.",
    "Grüße aus Zürich: naïve café déjà vu — 東京 🙂",
] * 20


class Family(NamedTuple):
    template: str
    bos: str | None
    eos: str
    specials: tuple[str, ...]


FAMILIES = {
    "llama3": Family("llama3.jinja", "<|begin_of_text|>", "<|eot_id|>",
                     ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>")),
    "qwen2.5": Family("chatml_qwen25.jinja", None, "<|im_end|>", ("<|im_start|>", "<|im_end|>", "<|endoftext|>")),
    "mistral": Family("mistral.jinja", "<s>", "</s>", ("<s>", "</s>", "[INST]", "[/INST]")),
}  # fmt: skip

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is a KV cache?"}],
    [
        {"role": "system", "content": "  You answer in one sentence. "},
        {"role": "user", "content": "What spills to disk?"},
        {"role": "assistant", "content": "Blocks evicted from the CPU arena."},
        {"role": "user", "content": "Grüße — 東京 🙂?"},
    ],
]


def _model_dir(root: Path, family: Family) -> tuple[Path, Any]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(family.specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if family.bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", special_tokens=[(family.bos, tok.token_to_id(family.bos))]
        )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos)
    hf.chat_template = (TEMPLATES / family.template).read_text()
    hf.save_pretrained(root)
    return root, hf


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTokenizer, Any]:
    directory, hf = _model_dir(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])
    ours = load_tokenizer(str(directory))
    assert isinstance(ours, HFTokenizer)
    return ours, hf


def _ids(encoded: Any) -> list[int]:
    """transformers returns a list, or a BatchEncoding whose input_ids may be batched."""
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_text_and_ids_equal_transformers(
    family: tuple[HFTokenizer, Any], conversation: int, add_generation_prompt: bool
) -> None:
    ours, hf = family
    messages = CONVERSATIONS[conversation]
    if "[INST]" in hf.chat_template and messages[-1]["role"] != "user":
        pytest.skip("the Mistral template renders only conversations ending with the user")
    assert ours.chat_template is not None
    text = ours.chat_template.render(
        messages, add_generation_prompt=add_generation_prompt, special_tokens=ours.special_tokens
    )
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    oracle_ids = _ids(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt))
    assert ours.encode(text, add_special_tokens=False) == oracle_ids


def test_completions_tokenise_with_special_tokens_and_decode_as_transformers(family: tuple[HFTokenizer, Any]) -> None:
    ours, hf = family
    for text in ("The KV cache spills to disk.", "Grüße — 東京 🙂"):
        assert ours.encode(text, add_special_tokens=True) == _ids(hf(text))
        ids = _ids(hf(text))
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.eos_token_ids == (hf.convert_tokens_to_ids(hf.eos_token),)


def test_incremental_detokenizing_equals_decoding_the_whole(family: tuple[HFTokenizer, Any]) -> None:
    ours, _ = family
    ids = ours.encode("Blocks spill: Grüße — 東京 🙂 and come back on a hit.")
    detok = IncrementalDetokenizer(ours)
    shown = "".join(detok.push([i])[0] for i in ids) + detok.finish()
    assert shown == ours.decode(ids)
    assert "\ufffd" not in shown


# Final texts the template's own closing markup can repeat ("", "e", "im"), or whose spacing it trims.
FINALS = ["Hi, the cache", "", "e", "im", "{", " Hi", "Hello ", "\n"]


@pytest.mark.parametrize("final", FINALS)
def test_continue_final_message_equals_transformers(family: tuple[HFTokenizer, Any], final: str) -> None:
    """Cut where the final message ends, as transformers cuts it (a marker after the text), not at the text's
    last occurrence, which the template's closing markup can repeat (before: "e" cut inside "<|eot_id|>")."""
    ours, hf = family
    assert ours.chat_template is not None
    for content in (final, [{"type": "text", "text": "Sure."}, {"type": "text", "text": final}]):
        messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": content}]
        try:
            expected = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        except Exception:  # transformers refuses it (its template cannot render it, or drops the text): so must we
            with pytest.raises(ChatTemplateError):
                ours.chat_template.render(
                    messages, add_generation_prompt=False, continue_final_message=True,
                    special_tokens=ours.special_tokens,
                )  # fmt: skip
            continue
        text = ours.chat_template.render(
            messages, add_generation_prompt=False, continue_final_message=True, special_tokens=ours.special_tokens
        )
        assert text == expected, (final, content)


def test_a_template_that_refuses_raises_a_clear_error() -> None:
    template = ChatTemplate((TEMPLATES / "mistral.jinja").read_text())
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(bad, add_generation_prompt=True, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="both"):
        template.render([], add_generation_prompt=True, continue_final_message=True, special_tokens={})


def test_a_long_prompt_tokenised_in_a_thread_leaves_the_event_loop_running(
    family: tuple[HFTokenizer, Any],
) -> None:
    # The router tokenises long text prompts in a worker thread so that its loop keeps relaying other streams.
    # That helps only if the tokenizer lets go of the GIL: the library's single-text encode holds it (the loop
    # then stalls as long as the encode runs), its batch call releases it -- which HFTokenizer.encode uses.
    import asyncio
    import time

    ours, hf = family
    text = " ".join(CORPUS) * 60  # ~250k characters: about 0.1 s of BPE
    started = time.perf_counter()
    expected = ours.encode(text, add_special_tokens=True)
    alone_s = time.perf_counter() - started
    assert expected == _ids(hf(text))

    async def run() -> tuple[list[int], float]:
        gaps: list[float] = []
        task = asyncio.create_task(asyncio.to_thread(ours.encode, text, add_special_tokens=True))
        last = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        return await task, max(gaps)

    ids, longest_gap_s = asyncio.run(run())
    assert ids == expected
    assert alone_s > 0.02, "the text is too short to tell"
    assert longest_gap_s < alone_s / 2, (
        f"the loop stalled {longest_gap_s * 1e3:.1f} ms of a {alone_s * 1e3:.1f} ms encode"
    )


# A ChatML template with tools and tool calls, in the shape of Qwen2.5's: the tools listed in the system turn,
# an assistant's calls as <tool_call> JSON (arguments as an object), tool results in a user turn.
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    '{%- for call in message.tool_calls %}{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", '
    "\"arguments\": ' }}{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def _chat(ours: HFTokenizer, body: dict[str, Any]) -> Any:
    from kvstore.openai.protocol import ModelLimits, decode_chat, parse_chat

    return parse_chat(decode_chat(json.dumps(body).encode()), ours, ModelLimits(None, 4096), trust_template=True)


def test_tools_and_earlier_tool_calls_render_as_transformers_renders_them(family: tuple[HFTokenizer, Any]) -> None:
    ours, hf = family
    if "<|im_start|>" not in hf.chat_template:
        pytest.skip("the tool template is ChatML: one family's special tokens are enough")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    parsed = _chat(ours, {"messages": messages, "tools": TOOLS, "tool_choice": "none", "chat_template": TOOL_TEMPLATE})
    # The oracle gets the arguments as an object, as vLLM hands them to the template.
    oracle_messages = [*messages[:1], {**messages[1], "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]]  # fmt: skip
    rendered = hf.apply_chat_template(
        oracle_messages, tools=TOOLS, chat_template=TOOL_TEMPLATE, add_generation_prompt=True, tokenize=True
    )
    expected = _ids(rendered)
    assert parsed.token_ids == expected
    assert '"arguments": {"city": "Paris"}' in ours.decode(parsed.token_ids, skip_special_tokens=False)
    # The router in front of a vLLM fleet hashes the same tokens (it renders without checking the request).
    from kvstore.openai.routing import read_for_routing

    body = {"messages": messages, "tools": TOOLS, "tool_choice": "auto", "chat_template": TOOL_TEMPLATE}
    assert read_for_routing(json.dumps(body).encode(), "chat", ours, trust_template=True).token_ids == expected
    assert read_for_routing(json.dumps(body).encode(), "chat", ours).token_ids is None  # untrusted: by load


@pytest.mark.parametrize(
    ("extra", "param", "fragment"),
    [
        ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto" (the default with tools) needs a tool-call parser'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "needs a tool-call parser"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", 'must be "none", "auto", "required" or'),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
         "tool_choice.function.name", "'get_wether', which is not one of the request's tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0]", "tools[0] must be"),
        ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[0].tool_calls", "only assistant messages make tool calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "is not JSON"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls[0]",
         "must be"),
        ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 5}]},
         "messages[0].reasoning_content", "must be a string"),
    ],
)  # fmt: skip
def test_tool_requests_this_server_cannot_serve_are_refused_by_name(
    family: tuple[HFTokenizer, Any], extra: dict[str, Any], param: str, fragment: str
) -> None:
    from kvstore.openai.errors import ApiError

    ours, _ = family
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": TOOL_TEMPLATE, **extra}
    with pytest.raises(ApiError) as info:
        _chat(ours, body)
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message, info.value


def test_request_chat_template_kwargs_win_over_the_request_fields(family: tuple[HFTokenizer, Any]) -> None:
    ours, hf = family
    messages = [{"role": "user", "content": "What spills to disk?"}]
    parsed = _chat(ours, {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert parsed.token_ids == _ids(hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))


def test_a_choice_that_ends_inside_a_character_shows_its_whole_characters_only() -> None:
    """As vLLM: the bytes of an unfinished character at the end of a choice are never shown as U+FFFD."""
    from kvstore.openai.tokenizer import ByteTokenizer

    ids = list("ok 東京".encode())
    detok = IncrementalDetokenizer(ByteTokenizer())
    shown = "".join(detok.push([i])[0] for i in ids[:-1]) + detok.finish()  # ends one byte short of 京
    assert shown == "ok 東"
    detok = IncrementalDetokenizer(ByteTokenizer())
    shown = "".join(detok.push([i])[0] for i in ids) + detok.finish()
    assert shown == "ok 東京"


@pytest.mark.parametrize("include", [False, True])
def test_text_is_held_back_for_a_stop_string_only_when_the_stop_string_is_hidden(include: bool) -> None:
    """vLLM holds back ``longest stop - 1`` characters only while a stop string may have to be cut out."""
    from kvstore.openai.tokenizer import ByteTokenizer

    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["XYZ"], include_stop_str_in_output=include)
    steps = [detok.push([b])[0] for b in b"abXYZc"]
    if include:
        assert steps == ["a", "b", "X", "Y", "Z", ""] and detok.text == "abXYZ"
    else:
        assert steps == ["", "", "a", "b", "", ""] and detok.text == "ab"
    assert detok.stopped


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1/0 }}",
        "{% for x in range(10000000000) %}x{% endfor %}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "{{ messages[5].content }}",
    ],
)
def test_a_request_template_is_refused_unless_trusted_and_any_failure_is_a_400(
    family: tuple[HFTokenizer, Any], template: str
) -> None:
    """As vLLM without --trust-request-chat-template: a request's template is refused before it runs. Trusted,
    whatever it raises (a division by zero, a range too big, unbounded recursion) is a 400 naming messages."""
    from kvstore.openai.errors import ApiError
    from kvstore.openai.protocol import ModelLimits, decode_chat, parse_chat

    ours, _ = family
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template": template}).encode()
    with pytest.raises(ApiError) as refused:
        parse_chat(decode_chat(body), ours, ModelLimits(None, 4096))
    assert refused.value.param == "chat_template" and "trust_request_chat_template" in refused.value.message
    with pytest.raises(ApiError) as failed:
        parse_chat(decode_chat(body), ours, ModelLimits(None, 4096), trust_template=True)
    assert failed.value.status == 400 and failed.value.param == "messages", failed.value


def test_the_router_and_the_worker_render_the_same_conversation_in_vllms_shapes(
    family: tuple[HFTokenizer, Any],
) -> None:
    """Tools dumped as vLLM's model does (type first, null description and parameters), earlier calls with no
    arguments as {}, tool_calls null or empty dropped, an empty tool list kept: the worker's tokens and the
    fleet router's are the same, and equal transformers' for the same shapes."""
    from kvstore.openai.routing import read_for_routing

    ours, hf = family
    if "<|im_start|>" not in hf.chat_template:
        pytest.skip("the tool template is ChatML: one family's special tokens are enough")
    template = TOOL_TEMPLATE + "{% if tools is not none %}[tools: {{ tools | length }}]{% endif %}"
    template += "{% for m in messages %}{% if m.tool_calls is defined %}({{ m.role }} calls){% endif %}{% endfor %}"
    bare_call = {"id": "c1", "type": "function", "function": {"name": "now"}}  # no arguments at all
    messages = [
        {"role": "user", "content": "What time is it?", "tool_calls": None},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [bare_call, {**bare_call, "function": {"name": "now", "arguments": ""}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon", "tool_calls": []},
    ]
    tool = {"function": {"name": "now"}, "type": "function"}  # no description, keys in the client's order
    for tools, shaped in (([tool], [{"type": "function", "function": {"name": "now", "description": None,
                                                                     "parameters": None}}]), ([], [])):  # fmt: skip
        body = {"messages": messages, "tools": tools, "tool_choice": "none", "chat_template": template}
        worker = _chat(ours, body).token_ids
        router = read_for_routing(json.dumps(body).encode(), "chat", ours, trust_template=True).token_ids
        oracle_messages = [
            {"role": "user", "content": "What time is it?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{**bare_call, "function": {"name": "now", "arguments": {}}}] * 2,
            },
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ]
        oracle = _ids(hf.apply_chat_template(oracle_messages, tools=shaped, chat_template=template,
                                             add_generation_prompt=True, tokenize=True))  # fmt: skip
        assert worker == router == oracle, tools


def test_a_template_in_chat_template_kwargs_is_a_request_template(family: tuple[HFTokenizer, Any]) -> None:
    """vLLM takes a template from chat_template_kwargs too, and trusts it no more than a chat_template."""
    from kvstore.openai.errors import ApiError
    from kvstore.openai.protocol import ModelLimits, decode_chat, parse_chat
    from kvstore.openai.routing import read_for_routing

    ours, hf = family
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "chat_template_kwargs": {"chat_template": "X{{ messages[0].content }}"}}
    raw = json.dumps(body).encode()
    with pytest.raises(ApiError) as refused:
        parse_chat(decode_chat(raw), ours, ModelLimits(None, 4096))
    assert refused.value.param == "chat_template"
    trusted = parse_chat(decode_chat(raw), ours, ModelLimits(None, 4096), trust_template=True).token_ids
    assert trusted == ours.encode("Xhi", add_special_tokens=False)
    assert read_for_routing(raw, "chat", ours, trust_template=True).token_ids == trusted
    assert read_for_routing(raw, "chat", ours).token_ids is None
    # A null chat_template is no template: both render the model's own, and the router hashes it.
    plain = {"messages": messages, "chat_template": None}
    expected = _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert _chat(ours, plain).token_ids == expected
    assert read_for_routing(json.dumps(plain).encode(), "chat", ours).token_ids == expected


def test_a_truncated_text_prompt_keeps_its_bos_as_vllm_tokenises_it(family: tuple[HFTokenizer, Any]) -> None:
    from kvstore.openai.protocol import ModelLimits, decode_completion, parse_completion
    from kvstore.openai.routing import read_for_routing

    ours, hf = family
    hf.truncation_side = "left"
    text = "The KV cache keeps computed attention keys and values"
    body = json.dumps({"prompt": text, "truncate_prompt_tokens": 4}).encode()
    expected = hf(text, truncation=True, max_length=4)["input_ids"]
    assert parse_completion(decode_completion(body), ours, ModelLimits(None, 4096)).token_ids == expected
    assert read_for_routing(body, "completion", ours).token_ids == expected


@pytest.mark.parametrize("field", ["tools", "documents"])
@pytest.mark.parametrize("value", [5, "a string", {"type": "function"}, True])
def test_chat_template_kwargs_tools_or_documents_that_are_no_list_are_a_400_naming_the_field(
    family: tuple[HFTokenizer, Any], field: str, value: Any
) -> None:
    """A request's ``chat_template_kwargs`` may hold anything: ``tools`` or ``documents`` that are not lists are
    refused as the request's fault (a 400 naming the field), never a 500 with a traceback; the router, which
    only reads a chat to route it, forwards such a body unread and routes it by load."""
    from kvstore.openai.errors import ApiError
    from kvstore.openai.routing import read_for_routing

    ours, _ = family
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {field: value}}
    with pytest.raises(ApiError) as refused:
        _chat(ours, body)
    assert refused.value.status == 400 and f"chat_template_kwargs.{field} must be a list" in refused.value.message
    assert read_for_routing(json.dumps(body).encode(), "chat", ours).token_ids is None
    listed = {**body, "chat_template_kwargs": {field: []}}  # a list (empty) renders as before
    assert read_for_routing(json.dumps(listed).encode(), "chat", ours).token_ids == _chat(ours, listed).token_ids
