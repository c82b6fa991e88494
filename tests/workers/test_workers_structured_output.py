"""Structured output (``response_format`` json_object / json_schema / structural_tag, vLLM's ``structured_outputs``
json, regex, grammar, json_object and structural_tag, and the older ``guided_*`` names): whatever a random model
samples, the output is a string of the grammar -- JSON that validates against its schema (``jsonschema`` is the
oracle), text the regex matches whole, a sentence of the grammar, free text whose every structure is whole --
through the worker and through its HTTP front with the official ``openai`` client, whose
``chat.completions.parse`` reads the answer into a pydantic model."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pydantic
import pytest
import torch
from workers_testlib import make_config

from kvstore.errors import InvalidRequestError
from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import ModelLimits, decode_chat, decode_completion, parse_chat, parse_completion
from kvstore.openai.structured import grammar_tokenizer, json_schema_grammar, regex_grammar
from kvstore.openai.tokenizer import HFTokenizer, load_tokenizer
from kvstore.worker_api import FinishReason, GenerateRequest, SamplingParams
from kvstore.workers.grammar import GrammarMatcher
from kvstore.workers.http import create_worker_app
from kvstore.workers.sampler import GREEDY as GREEDY_DEFAULTS
from kvstore.workers.worker import KVWorker
from tests import openai_conformance as check
from tests.checkpoints import VOCAB, TinyCheckpoint
from tests.http_servers import ServerThread

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tier": {"enum": ["gpu", "cpu", "disk"]},
        "hits": {"type": "integer", "minimum": 0, "maximum": 999},
        "pinned": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "tier", "hits", "pinned"],
    "additionalProperties": False,
}
LIMITS = ModelLimits(vocab_size=VOCAB, max_context=512)
# vLLM's structural tag: free text, in which "@" opens a call: "call " and JSON of its schema, then ";" are forced.
CALL = {"type": "object", "properties": {"tier": {"enum": ["cpu", "disk"]}, "n": {"type": "integer", "minimum": 0,
        "maximum": 99}}, "required": ["tier", "n"], "additionalProperties": False}  # fmt: skip
TAG = {"begin": "@call ", "schema": CALL, "end": ";"}
STRUCTURAL_TAG = {"type": "structural_tag", "structures": [TAG], "triggers": ["@"]}


@pytest.fixture(scope="module")
def worker(qwen2_checkpoint: TinyCheckpoint) -> Iterator[KVWorker]:
    w = KVWorker("structured", make_config(num_blocks=96, model=str(qwen2_checkpoint.path)))
    yield w
    w.shutdown()


def _compact(schema: Any) -> str:
    return json_schema_grammar(schema, any_whitespace=False)


def test_sampled_json_always_validates_against_its_schema(worker: KVWorker) -> None:
    sampling = SamplingParams(temperature=1.2, seed=5, n=3, grammar=_compact(SCHEMA))
    seen_tiers = set()
    for prompt in ([11, 12, 13], [40, 41], [7] * 9):
        result = worker.generate(GenerateRequest(prompt, 160, sampling=sampling))
        for choice in result.choices:
            value = json.loads(choice.text)
            jsonschema.validate(value, SCHEMA)
            assert choice.finish_reason is FinishReason.STOP, choice
            seen_tiers.add(value["tier"])
    assert len(seen_tiers) >= 2  # the draw still chooses, within the grammar
    worker.check_invariants()


def test_greedy_json_object_and_flexible_whitespace_parse(worker: KVWorker) -> None:
    """``json_object`` (any object), with JSON's whitespace allowed between tokens as vLLM allows by default:
    whatever the model puts there, a finished answer parses."""
    any_object = json_schema_grammar({"type": "object", "maxProperties": 2})
    for seed in range(3):
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar=any_object)
        choice = worker.generate(GenerateRequest([5, 6, 7], 256, sampling=sampling)).choices[0]
        if choice.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(choice.text), dict), choice.text
        else:  # cut short: still a prefix the grammar allows
            assert choice.finish_reason is FinishReason.LENGTH and choice.text.lstrip().startswith("{")


def test_a_regex_is_matched_whole_and_ends_the_choice(worker: KVWorker) -> None:
    pattern = r"[0-9]{3}-(cpu|gpu)-[a-f]{2}"
    sampling = SamplingParams(temperature=1.0, seed=1, n=4, grammar=regex_grammar(pattern))
    result = worker.generate(GenerateRequest([30, 31, 32], 40, sampling=sampling))
    for choice in result.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
        assert choice.finish_reason is FinishReason.STOP


def test_min_tokens_cannot_push_the_output_past_its_grammar(worker: KVWorker) -> None:
    """``min_tokens`` masks EOS, but a finished grammar allows nothing else: the grammar wins, and the choice ends
    where it is complete."""
    sampling = SamplingParams(temperature=0.0, min_tokens=30, grammar=regex_grammar("ok|no"))
    choice = worker.generate(GenerateRequest([3, 4], 40, sampling=sampling)).choices[0]
    assert choice.text in ("ok", "no") and choice.finish_reason is FinishReason.STOP


def test_max_tokens_cuts_a_grammar_short_with_length(worker: KVWorker) -> None:
    sampling = SamplingParams(temperature=0.0, grammar=regex_grammar("[a-z]{40}"))
    choice = worker.generate(GenerateRequest([3, 4], 5, sampling=sampling)).choices[0]
    assert choice.finish_reason is FinishReason.LENGTH and re.fullmatch("[a-z]+", choice.text), choice.text


def test_a_grammar_that_does_not_compile_is_refused_by_the_worker(worker: KVWorker) -> None:
    before = worker._counters.rejected
    for bad in ["not a grammar", regex_grammar("[a-"), ""]:
        with pytest.raises(InvalidRequestError, match="grammar"):
            worker.submit(GenerateRequest([1, 2], 4, sampling=SamplingParams(grammar=bad)))
    with pytest.raises(InvalidRequestError, match="one kind"):
        worker.submit(
            GenerateRequest([1, 2], 4, sampling=SamplingParams(grammar=regex_grammar("a"), choice_token_ids=((5,),)))
        )
    assert worker._counters.rejected == before + 4
    worker.check_invariants()


def test_the_byte_model_refuses_a_grammar_it_has_no_eos_to_end() -> None:
    toy = KVWorker("structured-toy", make_config(num_blocks=32))
    try:
        with pytest.raises(InvalidRequestError, match="Hugging Face tokenizer"):
            toy.submit(GenerateRequest([1, 2], 4, sampling=SamplingParams(grammar=regex_grammar("a+"))))
        with pytest.raises(ApiError, match="Hugging Face tokenizer") as refused:
            parse_completion(
                decode_completion(json.dumps({"prompt": "x", "response_format": {"type": "json_object"}}).encode()),
                load_tokenizer(None), ModelLimits(vocab_size=256, max_context=64),
            )  # fmt: skip
        assert refused.value.param == "response_format"
    finally:
        toy.shutdown()


def test_the_mask_is_what_the_grammar_allows(qwen2_checkpoint: TinyCheckpoint) -> None:
    tokenizer = load_tokenizer(str(qwen2_checkpoint.path))
    assert isinstance(tokenizer, HFTokenizer)
    matcher = GrammarMatcher(grammar_tokenizer(tokenizer, VOCAB, tokenizer.eos_token_ids), regex_grammar("ab|ac"))
    allowed = matcher.allowed(VOCAB)
    assert allowed.shape == (VOCAB,) and not allowed[tokenizer.vocab_size :].any()  # the model's extra rows: never
    first = {tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert first and all(text in ("a", "ab", "ac") for text in first), first
    (a,) = tokenizer.encode("a")
    copy = matcher.copy()
    assert matcher.consume(a) and not matcher.stopped
    assert {tokenizer.decode([t]) for t in matcher.allowed(VOCAB).nonzero().flatten().tolist()} == {"b", "c"}
    assert copy.allowed(VOCAB).equal(allowed)  # a copy moves on its own
    (z,) = tokenizer.encode("z")
    assert not matcher.consume(z) and matcher.stopped and matcher.failed


# ---------------------------------------------------------------------------------------------- the front


def _completion(tokenizer: Any, **body: Any) -> SamplingParams:
    request = decode_completion(json.dumps({"prompt": "Answer:", **body}).encode())
    return parse_completion(request, tokenizer, LIMITS).sampling


@pytest.fixture(scope="module")
def hf(qwen2_checkpoint: TinyCheckpoint) -> Any:
    return load_tokenizer(str(qwen2_checkpoint.path))


def test_every_way_of_asking_compiles_to_a_grammar(hf: Any) -> None:
    asks = [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},  # vLLM takes the schema as JSON text too
        {"structured_outputs": {"json_object": True}},
        {"structured_outputs": {"regex": "[0-9]+"}},
        {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},  # GBNF
        {"structured_outputs": {"grammar": 'start: "yes" | "no"'}},  # Lark
        {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?", "guided_decoding_backend": "xgrammar"},
        {"guided_regex": "a+"},
        {"guided_grammar": 'root ::= "a"'},
        # options alone beside response_format: vLLM's knobs for OpenAI's field
        {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_additional_properties": True}},
        {"response_format": STRUCTURAL_TAG},
        {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}},  # vLLM's field: the object as JSON
    ]
    for ask in asks:
        sampling = _completion(hf, **ask)
        assert sampling.grammar and sampling.choice_token_ids is None, ask
    assert _completion(hf, response_format={"type": "text"}).grammar is None
    assert _completion(hf, structured_outputs={"choice": ["yes", "no"]}).choice_token_ids


def test_closed_objects_and_compact_whitespace_change_what_is_allowed(hf: Any) -> None:
    llm = grammar_tokenizer(hf, VOCAB, hf.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}

    def accepts(grammar: str, text: str) -> bool:
        matcher = GrammarMatcher(llm, grammar)
        return all(matcher.consume(t) for t in hf.encode(text))

    assert accepts(json_schema_grammar(schema), '{ "a": true, "b": 1}')
    assert not accepts(json_schema_grammar(schema, closed_objects=True), '{"a":true,"b":1}')
    # as vLLM closes them: only objects that list properties; a bare object (json_object's) stays open
    assert accepts(json_schema_grammar({"type": "object"}, closed_objects=True), '{"k":1}')
    holder = {"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]}
    assert accepts(json_schema_grammar(holder, closed_objects=True), '{"meta":{"k":1}}')
    assert not accepts(json_schema_grammar(holder, closed_objects=True), '{"meta":{},"x":1}')
    patterned = {"patternProperties": {"^a": {"type": "integer"}}}
    assert not accepts(json_schema_grammar(patterned, closed_objects=True), '{"b":1}')
    assert accepts(json_schema_grammar(True, any_whitespace=False), "[1,{}]")  # true: any JSON value
    assert not accepts(json_schema_grammar(schema, any_whitespace=False), '{ "a": true}')
    assert accepts(json_schema_grammar(schema, any_whitespace=False), '{"a":true}')
    # const and enum values are data, not schemas: left alone
    nested = {"const": {"type": "object", "x": 1}}
    assert accepts(json_schema_grammar(nested, any_whitespace=False, closed_objects=True), '{"type":"object","x":1}')


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"structured_outputs": {"json": {"type": "strang"}}}, "structured_outputs.json", "strang"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
        ({"structured_outputs": {"json": 7}}, "structured_outputs.json", "object or a boolean"),
        ({"structured_outputs": {"json": 0}}, "structured_outputs.json", "object or a boolean"),  # 0 is no "unset"
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "boolean"),
        ({"guided_json": '{"type":"array","items":' * 1200 + "{}" + "}" * 1200}, "guided_json", "nests too deeply"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", ""),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.regex", "one kind"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "no field"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not JSON"),
        ({"structured_outputs": {"structural_tag": "[]"}}, "structured_outputs.structural_tag", "structures"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
         "response_format.format", "not supported"),
        ({"response_format": {**STRUCTURAL_TAG, "trigers": []}}, "response_format.trigers", "no field"),
        ({"response_format": {**STRUCTURAL_TAG, "triggers": []}}, "response_format.triggers", "1 to 64"),
        ({"response_format": {**STRUCTURAL_TAG, "triggers": [""]}}, "response_format.triggers[0]", "non-empty"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": []}}, "response_format.structures", "1 to 64"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": ["@"]}}, "response_format.structures[0]", "begin"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "begin": "#call "}]}},
         "response_format.structures[0].begin", "none of the triggers"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "begin": ""}]}},
         "response_format.structures[0].begin", "non-empty"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "end": 3}]}},
         "response_format.structures[0].end", "string"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "args": {}}]}},
         "response_format.structures[0].args", "no field"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "schema": [1]}]}},
         "response_format.structures[0].schema", "JSON schema"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "schema": {"enum": ["x" * (1 << 20)]}}]}},
         "response_format.structures[0].schema", "longer than"),
        ({"structured_outputs": {"json": {"enum": ["x" * (1 << 20)]}}}, "structured_outputs.json", "longer than"),
        ({"response_format": {**STRUCTURAL_TAG, "structures": [{**TAG, "schema": {"type": "strang"}}]}},
         "response_format", "strang"),
        ({"response_format": STRUCTURAL_TAG, "structured_outputs": {"disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace", "not to a structural tag"),
        ({"response_format": STRUCTURAL_TAG, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex",
         "one kind"),
        ({"structured_outputs": "json"}, "structured_outputs", "object"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
         "structured_outputs.disable_any_whitespace", "boolean"),
        ({"guided_json": {}, "structured_outputs": {"json": {}}}, "guided_json", "not both"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one kind"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}},
         "response_format.json_schema.schema", "required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": 3}}}},
         "response_format.json_schema.schema", ""),
        ({"guided_decoding_backend": 3, "guided_regex": "a"}, "guided_decoding_backend", "string"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(hf: Any, body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        _completion(hf, **body)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
    assert words in refused.value.message, refused.value.message


def _calls(text: str, finished: bool) -> list[Any]:
    """The JSON of every "@call {...};" in ``text``, checked against ``CALL``; asserts that every "@" opens one (a
    choice cut short by ``max_tokens`` may end inside its last)."""
    found, position = [], text.find("@")
    while position >= 0:
        rest = text[position:]
        if not finished and "@call ".startswith(rest):
            break
        assert rest.startswith("@call "), text
        try:
            value, used = json.JSONDecoder().raw_decode(rest, len("@call "))
        except json.JSONDecodeError:
            assert not finished, text  # cut short inside the JSON
            break
        jsonschema.validate(value, CALL)
        found.append(value)
        if not finished and used == len(rest):
            break
        assert rest[used] == ";", text
        position = text.find("@", position + used)
    return found


def test_a_structural_tag_leaves_text_free_and_forces_each_structure(hf: Any) -> None:
    """Whatever text a choice writes, each "@" goes on as "@call", JSON of the schema and ";" -- text before and
    after is free."""
    llm = grammar_tokenizer(hf, VOCAB, hf.eos_token_ids)
    grammar = _completion(hf, response_format=STRUCTURAL_TAG).grammar
    assert grammar is not None

    def accepts(text: str) -> bool:
        matcher = GrammarMatcher(llm, grammar)
        return all(matcher.consume(t) for t in hf.encode(text))

    assert accepts("no call at all, just words")
    assert accepts('see @call {"tier": "cpu", "n": 7}; and @call {"tier":"disk","n":0}; then more')
    assert not accepts('@call {"tier": "gpu", "n": 7};')  # not in the enum
    assert not accepts('@call {"tier": "cpu", "n": 7} and')  # not closed by ";"
    assert not accepts("mail me @ home")  # "@" must open a call
    # structured_outputs.structural_tag (JSON text) asks for the same grammar
    assert _completion(hf, structured_outputs={"structural_tag": json.dumps(STRUCTURAL_TAG)}).grammar == grammar


def test_structural_tag_triggers_that_nest_look_like_tags_or_are_special_tokens(hf: Any) -> None:
    """A trigger another one starts with (each structure opened by the shortest trigger its begin starts with,
    so none is unreachable); a ``<...>`` trigger that is only text here (escaped as text, never grammar); and a
    special token (matched as its id, the way a model writes it)."""
    llm = grammar_tokenizer(hf, VOCAB, hf.eos_token_ids)

    def grammar(structures: list[Any], triggers: list[str]) -> str:
        spec = {"type": "structural_tag", "structures": structures, "triggers": triggers}
        found = _completion(hf, response_format=spec).grammar
        assert found is not None
        return found

    def accepts(compiled: str, ids: list[int]) -> bool:
        matcher = GrammarMatcher(llm, compiled)
        return all(matcher.consume(t) for t in ids)

    nested = [
        {"begin": "<function=a>", "schema": {}, "end": "</function>"},
        {"begin": "<fx>", "schema": {}, "end": ";"},
    ]
    for triggers in (["<f", "<function="], ["<function=", "<f"]):
        compiled = grammar(nested, triggers)
        assert accepts(compiled, hf.encode("hi <function=a>{}</function> and <fx>1; bye"))
        assert not accepts(compiled, hf.encode("hi <fz"))  # "<f" opens a structure: "z" begins none
    as_text = grammar([{"begin": "<tool_call>", "schema": CALL, "end": "</tool_call>"}], ["<tool_call>"])
    assert accepts(as_text, hf.encode('a <tool_call>{"tier": "cpu", "n": 1}</tool_call> b'))
    assert not accepts(as_text, hf.encode("a <tool_call>prose"))
    quoted = grammar([{"begin": '"} | x', "schema": {}, "end": ""}], ['"}'])  # an escaped literal, not grammar
    assert accepts(quoted, hf.encode('say "} | x7 ok')) and not accepts(quoted, hf.encode('say "} y'))
    start = hf.encode("<|im_start|>")
    assert len(start) == 1 and "<|im_start|>" in hf.special_token_ids()
    special = grammar([{"begin": "<|im_start|>call ", "schema": CALL, "end": ";"}], ["<|im_start|>"])
    assert accepts(special, hf.encode("x ") + start + hf.encode('call {"tier": "disk", "n": 2}; y'))
    assert not accepts(special, hf.encode("x ") + start + hf.encode("hello"))


def test_sampled_structures_follow_their_schema(worker: KVWorker, hf: Any) -> None:
    """A random model pushed towards "@" (logit_bias) opens many calls: each one it opens is completed by the
    grammar, JSON that validates, closed by ";"."""
    grammar = _completion(hf, response_format=STRUCTURAL_TAG).grammar
    (at,) = hf.encode("@")
    calls = 0
    for seed in range(3):
        sampling = SamplingParams(temperature=1.0, seed=seed, n=3, grammar=grammar, logit_bias={at: 10.0})
        result = worker.generate(GenerateRequest([11, 12, 13], 200, sampling=sampling))
        for choice in result.choices:
            calls += len(_calls(choice.text, choice.finish_reason is FinishReason.STOP))
    assert calls >= 10, calls
    worker.check_invariants()


def test_a_structural_tag_through_the_http_front_with_the_openai_client(worker: KVWorker, hf: Any) -> None:
    """The same ask as a client sends it, plain and streamed: every call the answer opens is whole and valid."""
    server = ServerThread(create_worker_app(worker)).start()
    try:
        client = check.client(server.url)
        model = worker.info().model_name
        (at,) = hf.encode("@")
        ask: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Call a tier."}],
                               "max_tokens": 200, "temperature": 1.0, "logit_bias": {str(at): 10}}  # fmt: skip
        plain = client.chat.completions.create(**ask, seed=3, response_format=STRUCTURAL_TAG)  # type: ignore[arg-type]
        choice = plain.choices[0]
        calls = _calls(choice.message.content or "", choice.finish_reason == "stop")
        as_text = {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}}
        streamed = client.chat.completions.create(**ask, seed=4, stream=True, extra_body=as_text)
        chunks = [chunk for chunk in streamed if chunk.choices]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        calls += _calls(text, chunks[-1].choices[0].finish_reason == "stop")
        assert len(calls) >= 2, (choice.message.content, text)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json={**ask, "response_format": {
            **STRUCTURAL_TAG, "structures": [{**TAG, "begin": "#call "}]}})  # fmt: skip
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "response_format.structures[0].begin"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def thinking(qwen2_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The Qwen2 checkpoint with ``<think>`` and ``</think>`` as added tokens that are not special (kept in the
    text), as Qwen3's tokenizer has them."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("tiny-thinking") / "model"
    shutil.copytree(qwen2_checkpoint.path, path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_a_reasoning_model_thinks_first_and_is_constrained_after(hf: Any, thinking: Any) -> None:
    """As vLLM: with a reasoning parser, the grammar (or choice) holds what follows the end of thinking, which is
    recognised by its token. A tokenizer without one such token keeps the constraint from the first token, unsplit;
    a qwen3 chat with thinking switched off is constrained from the first token too."""
    thinker = load_tokenizer(str(thinking))
    (end,) = thinker.encode("</think>")
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}
    for parser in ("deepseek_r1", "qwen3"):
        parsed = parse_chat(decode_chat(json.dumps(body).encode()), thinker, LIMITS, reasoning_parser=parser)
        assert parsed.sampling.grammar and parsed.sampling.constraint_after == (end,) and parsed.reasoning_parser
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    parsed = parse_chat(decode_chat(json.dumps(off).encode()), thinker, LIMITS, reasoning_parser="qwen3")
    assert parsed.sampling.constraint_after is None and parsed.reasoning_parser == "qwen3-no-thinking"
    choice = {**body, "response_format": None, "guided_choice": ["yes", "no"]}
    parsed = parse_chat(decode_chat(json.dumps(choice).encode()), thinker, LIMITS, reasoning_parser="qwen3")
    assert parsed.sampling.choice_token_ids and parsed.sampling.constraint_after == (end,)
    parsed = parse_chat(decode_chat(json.dumps(body).encode()), hf, LIMITS, reasoning_parser="deepseek_r1")
    assert parsed.sampling.grammar and parsed.sampling.constraint_after is None and parsed.reasoning_parser is None
    # A prompt that ends the thinking itself (an assistant prefill; a template with thinking off): the answer is
    # constrained from its first token, as vLLM reads the prompt -- whichever parser is on.
    for prefill, waits in [("<think>done</think>", False), ("<think>still going", True), ("no tags", True)]:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": prefill}]
        prefilled = {**body, "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
        for parser in ("deepseek_r1", "qwen3"):
            parsed = parse_chat(decode_chat(json.dumps(prefilled).encode()), thinker, LIMITS, reasoning_parser=parser)
            assert (parsed.sampling.constraint_after == (end,)) is waits, (prefill, parser)


def test_the_constraint_waits_for_the_end_of_thinking(thinking: Any) -> None:
    from kvstore.workers.sampler import ChoiceSampling

    thinker = load_tokenizer(str(thinking))
    (end,) = thinker.encode("</think>")
    llm = grammar_tokenizer(thinker, VOCAB, thinker.eos_token_ids)
    params = SamplingParams(grammar=regex_grammar("ok"), constraint_after=(end,))
    choice = ChoiceSampling(params, GREEDY_DEFAULTS, index=0, prompt_ids=[1], eos_token_ids=thinker.eos_token_ids,
                            grammar=GrammarMatcher(llm, params.grammar or ""))  # fmt: skip
    free = thinker.encode("The KV cache")
    for token in free:  # thinking: nothing masked, nothing fed to the grammar (which these tokens would break)
        row = torch.zeros(VOCAB)
        choice.process(row)
        assert bool(torch.isfinite(row).all()) and not choice.constraint_done()
        choice.record(token)
    choice.record(end)
    row = torch.zeros(VOCAB)
    choice.process(row)
    allowed = {thinker.decode([t]) for t in torch.isfinite(row).nonzero().flatten().tolist()}
    assert allowed and allowed <= {"o", "ok"}, allowed
    for token in thinker.encode("ok"):
        choice.record(token)
    assert choice.constraint_done() and choice.grammar_error is None


def test_thinking_then_json_through_the_http_front(thinking: Any) -> None:
    worker = KVWorker("thinking", make_config(num_blocks=96, model=str(thinking)))
    server = ServerThread(create_worker_app(worker, reasoning_parser="qwen3")).start()
    try:
        thinker = load_tokenizer(str(thinking))
        (end,) = thinker.encode("</think>")
        client = check.client(server.url)
        answer = client.chat.completions.create(
            model=worker.info().model_name, messages=[{"role": "user", "content": "Describe a block."}],
            max_tokens=160, temperature=1.0, seed=1, logit_bias={str(end): 4.0},  # it ends its thinking soon
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMA}},
                        "structured_outputs": {"disable_any_whitespace": True}},
        )  # fmt: skip
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "stop", answer
        assert end in (answer.choices[0].token_ids or [])  # type: ignore[attr-defined]
        jsonschema.validate(json.loads(message.content or ""), SCHEMA)
        assert message.reasoning_content is not None  # type: ignore[attr-defined]
    finally:
        server.stop()
        worker.shutdown()


# ---------------------------------------------------------------------------------- over HTTP, the client


class Block(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    tier: Literal["gpu", "cpu", "disk"]
    hits: int = pydantic.Field(ge=0, le=999)


def test_the_openai_client_parses_the_answer_into_its_model(worker: KVWorker) -> None:
    server = ServerThread(create_worker_app(worker)).start()
    try:
        client = check.client(server.url)
        model = worker.info().model_name
        compact = {"structured_outputs": {"disable_any_whitespace": True}}
        for seed in range(3):
            parsed = client.chat.completions.parse(
                model=model, messages=[{"role": "user", "content": "Describe a block."}], response_format=Block,
                max_tokens=120, temperature=1.0, seed=seed, extra_body=compact,
            )  # fmt: skip
            message = parsed.choices[0].message
            assert isinstance(message.parsed, Block) and parsed.choices[0].finish_reason == "stop", message
        streamed = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a block."}], max_tokens=120, seed=9,
            temperature=1.0, stream=True, extra_body={**compact, "response_format": {"type": "json_schema",
            "json_schema": {"name": "block", "schema": SCHEMA}}},
        )  # fmt: skip
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        jsonschema.validate(json.loads(text), SCHEMA)
        plain = client.completions.create(
            model=model, prompt="Port:", max_tokens=12, temperature=1.0, seed=2,
            extra_body={"structured_outputs": {"regex": "[1-9][0-9]{3}"}},
        )  # fmt: skip
        assert re.fullmatch("[1-9][0-9]{3}", plain.choices[0].text), plain.choices[0].text
        bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "strang"}}}
        refused = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "x"}], "response_format": bad},
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "response_format.json_schema.schema"
    finally:
        server.stop()


def test_a_grammar_its_parser_cannot_follow_fails_the_request_instead_of_ending_it(worker: KVWorker) -> None:
    """llguidance bounds the work per token (2,000 parser items in a row): a grammar of 3,000 alternatives passes
    its check but fails on the first token. The answer would not be one of the grammar's, so the request fails
    with the parser's reason (a 400 over HTTP), rather than ending with ``stop`` on a non-conforming answer."""
    from kvstore.openai.structured import text_grammar

    wide = text_grammar("start: " + " | ".join(f'"t{i}"' for i in range(3000)))
    with pytest.raises(InvalidRequestError, match="structured output failed mid-answer"):
        worker.generate(GenerateRequest([5, 6], 20, sampling=SamplingParams(temperature=0.0, n=2, grammar=wide)))
    worker.check_invariants()
    ok = worker.generate(GenerateRequest([5, 6], 20, sampling=SamplingParams(grammar=regex_grammar("ok"))))
    assert ok.choices[0].text == "ok"  # the worker goes on serving
    server = ServerThread(create_worker_app(worker)).start()
    try:
        body = {
            "prompt": "x",
            "max_tokens": 20,
            "guided_grammar": "start: " + " | ".join(f'"t{i}"' for i in range(3000)),
        }
        refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and "mid-answer" in refused.json()["error"]["message"], refused.text
    finally:
        server.stop()


def test_a_grammar_request_is_submitted_and_parsed_off_the_event_loop(worker: KVWorker, monkeypatch: Any) -> None:
    """Compiling a matcher (or the tokenizer's view, the first time) can take a while: an event loop hands it to a
    thread, and a caller that gives up meanwhile still gets its request cancelled once it is queued."""
    import asyncio
    import threading

    from kvstore.openai import protocol

    threads: list[int] = []
    release = threading.Event()
    left = 0
    submit = worker.submit

    def slow_submit(request: GenerateRequest) -> Any:
        threads.append(threading.get_ident())
        release.wait(10)
        return submit(request)

    monkeypatch.setattr(worker, "submit", slow_submit)
    grammar = regex_grammar("[a-z]{30}")

    async def scenario() -> None:
        nonlocal left
        loop_thread = threading.get_ident()
        release.set()
        stream = await worker.asubmit(GenerateRequest([5], 4, sampling=SamplingParams(grammar=grammar)))
        assert (await stream.aresult()).choices[0].finish_reason is FinishReason.LENGTH
        plain = await worker.asubmit(GenerateRequest([5], 2))  # no grammar: submitted right here
        await plain.aresult()
        assert threads[0] != loop_thread and threads[1] == loop_thread
        release.clear()
        before = worker._counters.aborted
        long = GenerateRequest([5], 400, sampling=SamplingParams(grammar=regex_grammar("[a-z]{300}")))
        task = asyncio.ensure_future(worker.asubmit(long))
        await asyncio.sleep(0.05)
        task.cancel()  # the caller goes away while the matcher is being built
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):  # the request, queued after all, is cancelled
            await asyncio.sleep(0.02)
            if not worker._requests.groups:
                break
        assert not worker._requests.groups and worker._counters.aborted == before + 1
        left = worker._counters.aborted
        release.clear()
        threading.Timer(0.3, release.set).start()  # still submitting when the loop closes
        pending = asyncio.ensure_future(worker.asubmit(long))  # its loop closes while the matcher is built
        parsed_on: list[int] = []
        real_parse = protocol.parse_request
        monkeypatch.setattr(
            protocol, "parse_request", lambda *a, **k: parsed_on.append(threading.get_ident()) or real_parse(*a, **k)
        )
        body = json.dumps({"prompt": "x", "structured_outputs": {"regex": "a+"}}).encode()
        (parsed,) = await protocol.parse_request_async(body, False, worker.tokenizer, LIMITS, "m")
        assert parsed.sampling.grammar and parsed_on[-1] != loop_thread
        await protocol.parse_request_async(b'{"prompt": "x"}', False, worker.tokenizer, LIMITS, "m")
        assert parsed_on[-1] == loop_thread
        assert not pending.done()  # left to the loop's close, which cancels it

    asyncio.run(scenario())  # closing, the loop cancels the last submission's task: the request is cancelled
    for _ in range(200):
        if not worker._requests.groups:
            break
        time.sleep(0.02)
    assert not worker._requests.groups and worker._counters.aborted == left + 1, "a request ran for nobody"
    worker.check_invariants()
