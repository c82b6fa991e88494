"""The OpenAI request bodies (completions and chat), checked and turned into what a worker runs.

Bodies are decoded with msgspec rather than pydantic so every rejection
names the offending field. Every field vLLM's server takes for text
generation is declared; those we serve are checked against vLLM's ranges
and become a :class:`~kvstore.worker_api.SamplingParams` (structured output
compiled to a grammar on the way, :mod:`kvstore.openai.structured`), and
those we do not (images, beam search, xgrammar's structural tag ``format``, ...) are refused
with a 400 that names them. OpenAI's fields that change nothing about the
tokens generated (``store``, ``metadata``, ``service_tier``,
``prompt_cache_key``, ``safety_identifier``, ``prediction``, ``verbosity``,
``user``; ``response_format`` of type ``text``, ``modalities`` of just
``text``) are declared and accepted, since the official client and SDKs
built on it send them. Any other field is refused (a misspelt
``temperture`` must not silently sample at the default: vLLM ignores it
with a log line, which the client never sees).

:func:`parse_completion` and :func:`parse_chat` return a
:class:`ParsedRequest`: the prompt tokenised exactly as the replica will
tokenise it (completions with ``add_special_tokens`` true, chat prompts
through the model's chat template with it false, as vLLM does), so the
router's block hashes match the replica's. The router's faithful path for
external replicas reads bodies with :mod:`kvstore.openai.routing` instead
and never rewrites them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from kvstore.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    as_vllm_tool,
    request_template,
    with_parsed_arguments,
)
from kvstore.openai.errors import ApiError, model_not_found
from kvstore.openai.reasoning import END as THINK_END
from kvstore.openai.reasoning import NO_THINKING, parser_for
from kvstore.openai.reasoning import START as THINK_START
from kvstore.openai.structured import (
    MAX_GRAMMAR_CHARS,
    StructuredOutputError,
    Tag,
    check_grammar,
    check_json_size,
    grammar_tokenizer,
    json_schema_grammar,
    read_json_text,
    regex_grammar,
    special_token_ids,
    structural_tag_grammar,
    text_grammar,
)
from kvstore.openai.tokenizer import Tokenizer
from kvstore.openai.tool_calls import TYPED
from kvstore.worker_api import SamplingParams

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_N = 16
MAX_BATCH_CHOICES = 256  # prompts x n in one completions request
_INT64 = 2**63
# Names and stop strings are bounded while decoding: a 4 MiB cache_salt is no name, and would be hashed.
MAX_NAME_CHARS = 1024
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64  # words; each gives one or two token sequences (see _bad_words)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = True
    continuous_usage_stats: bool = False


class _GenerationFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields completions and chat share (OpenAI's, then vLLM's extensions)."""

    model: Name | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: Name | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool | None = None  # token ids are always returned
    request_id: Name | None = None
    cache_salt: Name | None = None
    lora_name: Name | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None
    allowed_token_ids: Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[StopString], Meta(max_length=MAX_BAD_WORDS)] | None = None
    prompt_logprobs: int | None = None  # vLLM's: score each prompt token, with this many alternatives
    # OpenAI's fields about the account, storage, billing or caching of a request: nothing to do here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Name | None = None
    prompt_cache_key: Name | None = None
    safety_identifier: Name | None = None
    # Structured output (checked where it is read, _constraint): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* names.
    response_format: Any = None
    structured_outputs: Any = None
    guided_choice: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None  # one backend here (llguidance): any name is taken
    # vLLM fields this server does not implement: refused by name when set.
    use_beam_search: bool = False
    length_penalty: float | None = None
    logits_processors: Any = None
    priority: int = 0
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


class CompletionRequest(_GenerationFields, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None


class ChatCompletionRequest(_GenerationFields, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    prediction: Any = None  # OpenAI's predicted output: a speed hint, the output is the same without it
    verbosity: Name | None = None  # OpenAI's hint to reasoning models; vLLM ignores it too
    modalities: list[str] | None = None  # ["text"] only
    audio: Any = None
    web_search_options: Any = None


# Set to anything but their default, these are refused (the value names why).
_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": None,
    "logits_processors": None,
    "priority": 0,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "suffix": None,
    "prompt_embeds": None,
    "functions": None,
    "function_call": None,
    "reasoning_effort": None,
    "mm_processor_kwargs": None,
    "media_io_kwargs": None,
    "audio": None,
    "web_search_options": None,
}


class ModelLimits(NamedTuple):
    vocab_size: int | None  # None: unknown here, the replica checks
    max_context: int | None
    max_new_tokens: int | None = None  # a checkpoint's generation_config cap on max_tokens, as vLLM applies it


class ParsedRequest(NamedTuple):
    """A checked request, ready to route and to run."""

    kind: Literal["completion", "chat"]
    token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    model: str | None
    cache_salt: str | None
    lora_name: str | None
    stream: bool
    include_usage: bool  # a final chunk with the usage (stream only)
    continuous_usage: bool  # usage in every chunk (stream only, with include_usage)
    echo_text: str | None  # text to put before each choice's output (completions' or chat's echo)
    logprobs: int | None  # top alternatives per token, when logprobs are asked for
    role: str = "assistant"  # chat: the answer's role (vLLM: the last message's when no generation prompt)
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)
    echo_only: bool = False  # completions' echo with max_tokens 0: one token is generated, only the prompt shown
    tool_parser: str | None = None  # chat: the answer's tool calls are parsed out of its text by this parser
    reasoning_parser: str | None = None  # chat: the answer's reasoning is split from its content by this parser
    named_tool: str | None = None  # chat: tool_choice names this function; the answer is its arguments
    tools_required: bool = False  # chat: tool_choice "required"; the answer is a JSON array of calls
    tool_types: dict[str, dict[str, str]] | None = None  # chat, qwen3_coder / glm45: each function's parameter types


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(body, _completion_decoder, CompletionRequest)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return _decode(body, _chat_decoder, ChatCompletionRequest)


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def _decode(body: bytes, decoder: msgspec.json.Decoder[Any], kind: type[msgspec.Struct]) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text, sep, where = str(exc).rpartition(" - at `")
        if not sep:
            text, where = str(exc), ""
        param = where.rstrip("`").removeprefix("$").lstrip(".") or None
        if text.startswith("Object contains unknown field"):
            field = text.split("`")[1] if text.count("`") >= 2 else None
            param = ".".join(p for p in (param, field) if p) or None
            served = [f for f in kind.__struct_fields__ if f not in _UNSUPPORTED]
            raise ApiError(400, f"{text}; this server accepts: {', '.join(served)}", param=param) from None
        if param is None and text.startswith("Expected `object`"):
            text = f"request body must be a JSON object: {text}"
        raise ApiError(400, text, param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec raises it, not DecodeError, for bad UTF-8 inside a string
        raise ApiError(400, f"request body is not valid JSON: invalid UTF-8 in a string ({exc.reason})") from None
    except RecursionError:  # arrays/objects nested deeper than msgspec's decoder allows
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None


# ------------------------------------------------------------------ completions


def parse_completion(req: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits) -> ParsedRequest:
    """Check ``req`` and tokenise its prompt; ApiError(400) naming the field for anything wrong."""
    _refuse_unsupported(req)
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of is not supported (vLLM's V1 engine dropped it); use n", param="best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", param="logprobs")
    token_ids, text = _completion_prompt(req.prompt, tokenizer, req.add_special_tokens)
    kept = truncated(token_ids, req.truncate_prompt_tokens, limits.max_context)
    if len(kept) < len(token_ids):
        if text is not None and req.add_special_tokens:  # a text prompt keeps its BOS, as vLLM tokenises it
            kept = keep_special_tokens(token_ids, tokenizer.encode(text, add_special_tokens=False), len(kept))
        token_ids, text = kept, None  # echo shows what the model read
    max_tokens = _capped(16 if req.max_tokens is None else req.max_tokens, limits)
    echo_only = req.echo and max_tokens == 0  # as vLLM (and OpenAI): the prompt alone, one token generated
    if echo_only:
        max_tokens = 1
    sampling = _sampling(req, req.logprobs, limits, tokenizer, prompt_logprobs=_prompt_logprobs(req, req.logprobs))
    _check_lengths(token_ids, max_tokens, sampling, limits)
    echo = None
    if req.echo:
        echo = text if text is not None else tokenizer.decode(token_ids, skip_special_tokens=req.skip_special_tokens)
    return _parsed("completion", req, token_ids, max_tokens, sampling, echo, req.logprobs)._replace(echo_only=echo_only)


def parse_completions(req: CompletionRequest, tokenizer: Tokenizer, limits: ModelLimits) -> list[ParsedRequest]:
    """:func:`parse_completion` for each prompt of a batch (``prompt`` a list of strings or of token-id lists,
    as vLLM takes it), or of the one prompt; each checked alone, the error naming ``prompt[i]``."""
    prompt = req.prompt
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)):
        return [parse_completion(req, tokenizer, limits)]  # one prompt: a string or token ids (or not a prompt)
    for index, one in enumerate(prompt):  # a batch, by its first element; one that is neither: name it
        if not isinstance(one, str | list):
            raise ApiError(
                400,
                f"prompt[{index}]: each prompt of a batch must be a string or a list of integer token ids, "
                f"got {type(one).__name__}",
                param=f"prompt[{index}]",
            )
    if not 1 <= req.n <= MAX_N:  # before the batch's size, which n multiplies
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if len(prompt) * req.n > MAX_BATCH_CHOICES:
        raise ApiError(
            400, f"{len(prompt)} prompts of n={req.n} choices is more than {MAX_BATCH_CHOICES} choices", param="prompt"
        )
    parsed = []
    for index, one in enumerate(prompt):
        try:
            parsed.append(parse_completion(msgspec.structs.replace(req, prompt=one), tokenizer, limits))
        except ApiError as exc:
            if exc.param not in ("prompt", "max_tokens"):  # not about this prompt: the same for every one
                raise
            param = f"prompt[{index}]" if exc.param == "prompt" else exc.param
            raise ApiError(exc.status, f"prompt[{index}]: {exc.message}", param=param, kind=exc.kind) from None
    return parsed


def _completion_prompt(prompt: Any, tokenizer: Tokenizer, add_special_tokens: bool) -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(type(p) is int for p in prompt):
        return list(prompt), None
    if all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "a batch of prompts inside a batch is not a prompt", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of integer token ids", param="prompt")


def parse_request(
    body: bytes,
    chat: bool,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    model_name: str,
    *,
    trust_template: bool = False,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> list[ParsedRequest]:
    """A completions or chat body as our fronts serve it: its prompts, each checked (one, unless a completions
    request sent a batch), and vLLM's 404s for another model or an adapter (:func:`check_served`).
    ``tool_parser``: the front's tool-call parser (:mod:`kvstore.openai.tool_calls`), None for none."""
    if chat:
        batch = [
            parse_chat(
                decode_chat(body), tokenizer, limits, trust_template=trust_template, tool_parser=tool_parser,
                reasoning_parser=reasoning_parser,
            )
        ]  # fmt: skip
    else:
        batch = parse_completions(decode_completion(body), tokenizer, limits)
    check_served(batch[0], model_name)
    return batch


_GRAMMAR_FIELDS = (b'"response_format"', b'"structured_outputs"', b'"guided_', b'"tool_choice"')


def may_compile_grammar(body: bytes) -> bool:
    """Whether parsing ``body`` may compile a grammar (structured output or a forced tool call), which can take
    milliseconds for a large schema -- and about a second the first time, for a large vocabulary: a front parses
    such a body off its event loop. A cheap look at the raw bytes; a false positive only costs a thread hop."""
    return any(field in body for field in _GRAMMAR_FIELDS)


async def parse_request_async(body: bytes, *args: Any, **kwargs: Any) -> list[ParsedRequest]:
    """:func:`parse_request` on the event loop, or on a worker thread when the body may compile a grammar."""
    if may_compile_grammar(body):
        return await asyncio.to_thread(parse_request, body, *args, **kwargs)
    return parse_request(body, *args, **kwargs)


def check_served(parsed: ParsedRequest, model_name: str) -> None:
    """vLLM's 404s, before anything is routed or hashed: another model, or a LoRA adapter (our workers serve none)."""
    if parsed.model is not None and parsed.model != model_name:
        raise model_not_found(parsed.model)
    if parsed.lora_name is not None:
        raise ApiError(404, f"The lora adapter `{parsed.lora_name}` does not exist.", param="lora_name")


# ------------------------------------------------------------------------- chat


UNTRUSTED_TEMPLATE = (
    "a chat_template in the request is refused: this server renders only its model's own template unless it "
    "is started with router.trust_request_chat_template = true (vLLM's --trust-request-chat-template)"
)


def parse_chat(
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    *,
    trust_template: bool = False,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> ParsedRequest:
    """Check ``req``, render its messages through the chat template and tokenise them. ``trust_template``:
    render a ``chat_template`` the request sends (else a 400, as vLLM refuses one by default). ``tool_parser``
    (vLLM's ``--tool-call-parser``): with it, ``tool_choice`` ``"auto"`` is served and the answer's tool calls
    are parsed out of its text. ``reasoning_parser`` (vLLM's ``--reasoning-parser``): the answer's reasoning is
    split from its content (:mod:`kvstore.openai.reasoning`)."""
    _refuse_unsupported(req)
    own = _own_template(req.chat_template, req.chat_template_kwargs, trust_template)
    tools = _tools(req.tools, req.tool_choice, tool_parser)
    calls_parsed = tool_parser if req.tools and req.tool_choice in (None, "auto") else None
    if calls_parsed is not None:  # as vLLM's hermes parser: tool-call tags may be special tokens, keep them
        req = msgspec.structs.replace(req, skip_special_tokens=False)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    messages, token_ids = _render_chat(
        req.messages, tokenizer, own, tools=tools, documents=req.documents, extra=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
        add_special_tokens=req.add_special_tokens,
    )  # fmt: skip
    token_ids = truncated(token_ids, req.truncate_prompt_tokens, limits.max_context)
    top = (req.top_logprobs or 0) if req.logprobs else None
    # As vLLM: a chat's echo scores the prompt with top_logprobs alternatives (vLLM's default 0) even without logprobs
    named = _named_tool(req.tool_choice, req.tools) if req.tools else None  # checked by _tools already
    required = bool(req.tools) and req.tool_choice == "required"
    forced = _forced_tools_schema(req.tools or [], named, required, req.parallel_tool_calls)
    sampling = _sampling(
        req, top, limits, tokenizer, prompt_logprobs=_prompt_logprobs(req, req.top_logprobs or 0), forced=forced
    )
    explicit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if explicit is None and limits.max_context is not None:
        explicit = limits.max_context - len(token_ids)
        if explicit < 1:
            raise ApiError(
                400, f"the conversation ({len(token_ids)} tokens) fills the model's context", param="messages"
            )
    max_tokens = _capped(explicit if explicit is not None else 16, limits)
    _check_lengths(token_ids, max_tokens, sampling, limits, param="max_completion_tokens")
    # As vLLM: the answer continues the assistant's turn the generation prompt opens, or without one the
    # last message's; echo repeats that message when it has the answer's role.
    last = messages[-1]
    role = "assistant" if req.add_generation_prompt else last["role"]
    echo = last["content"] if req.echo and last["role"] == role else None
    reasoning = parser_for(reasoning_parser, req.chat_template_kwargs)
    if (sampling.choice_token_ids or sampling.grammar) and reasoning not in (None, NO_THINKING):
        # As vLLM: a reasoning model thinks freely first, and the guided choice or grammar holds what follows its
        # end of thinking. That end is recognised by its token, so it must be one (it is in Qwen3 and DeepSeek-R1);
        # where it is not, the constraint holds from the first token and the answer is all content, unsplit.
        end = tuple(tokenizer.encode(THINK_END))
        if len(end) != 1:
            reasoning = None
        elif not _thinking_closed(token_ids, end[0], tuple(tokenizer.encode(THINK_START))):
            sampling = msgspec.structs.replace(sampling, constraint_after=end)
        # else the prompt itself ended the thinking (a template with thinking off, an assistant prefill): the
        # constraint holds from the first token, as vLLM reads the prompt
    tool_types = _tool_types(req.tools or []) if calls_parsed in TYPED else None
    return _parsed("chat", req, token_ids, max_tokens, sampling, echo, top)._replace(
        role=role, tool_parser=calls_parsed, reasoning_parser=reasoning,
        named_tool=named, tools_required=required, tool_types=tool_types,
    )  # fmt: skip


def _thinking_closed(token_ids: Sequence[int], end: int, start: tuple[int, ...]) -> bool:
    """Whether the prompt's last thinking tag is the closing one (``</think>``'s token ``end``; ``start``, the
    tokens of ``<think>``, counts only as one token), so that the answer begins after the thinking."""
    opening = start[0] if len(start) == 1 else None
    for token in reversed(token_ids):
        if token == end:
            return True
        if token == opening:
            return False
    return False


def _own_template(chat_template: Any, kwargs: Any, trust_template: bool) -> str | None:
    """The template a request brings, if any, when this front may run it (400 otherwise, as vLLM refuses one)."""
    own = request_template({"chat_template": chat_template, "chat_template_kwargs": kwargs})
    if own is not None and not trust_template:
        raise ApiError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    if own is not None and not isinstance(own, str):
        raise ApiError(400, "chat_template must be a string", param="chat_template")
    return own


def _render_chat(
    raw: list[Any],
    tokenizer: Tokenizer,
    own: str | None,
    *,
    tools: list[Any] | None,
    documents: list[Any] | None,
    extra: dict[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    add_special_tokens: bool,
) -> tuple[list[dict[str, Any]], list[int]]:
    """A conversation's messages, checked, and the token ids of its rendering through the chat template."""
    messages = [_message(m, i) for i, m in enumerate(raw)]
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    template = _template(own, tokenizer)
    try:
        text = template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=tokenizer.special_tokens,
            tools=tools,
            documents=documents,
            extra=extra,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not token_ids:
        raise ApiError(400, "the rendered conversation is empty", param="messages")
    return messages, token_ids


# ------------------------------------------------------------------- tokenize


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /tokenize``, as vLLM takes it: a ``prompt``, or chat ``messages`` rendered as a chat request's."""

    model: Name | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    documents: list[Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /detokenize``: token ids back to text (special tokens kept, as vLLM decodes them)."""

    model: Name | None = None
    tokens: list[int]


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def tokenize(
    body: bytes, tokenizer: Tokenizer, limits: ModelLimits, model_name: str, *, trust_template: bool = False
) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer for ``body``: ``count``, ``max_model_len``, ``tokens`` and ``token_strs`` (the
    tokens as the vocabulary spells them, when ``return_token_strs``). ApiError(400/404) for a bad body."""
    req: TokenizeRequest = _decode(body, _tokenize_decoder, TokenizeRequest)
    if req.model is not None and req.model != model_name:
        raise model_not_found(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send either prompt or messages", param="prompt" if req.prompt is None else "messages")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        token_ids = tokenizer.encode(req.prompt, add_special_tokens=special)
    else:
        assert req.messages is not None
        own = _own_template(req.chat_template, req.chat_template_kwargs, trust_template)
        _, token_ids = _render_chat(
            req.messages, tokenizer, own, tools=_tools(req.tools, "none"), documents=req.documents,
            extra=req.chat_template_kwargs, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, add_special_tokens=bool(req.add_special_tokens),
        )  # fmt: skip
    return {
        "count": len(token_ids),
        "max_model_len": limits.max_context,
        "tokens": token_ids,
        "token_strs": tokenizer.token_strings(token_ids) if req.return_token_strs else None,
    }


def detokenize(body: bytes, tokenizer: Tokenizer, limits: ModelLimits, model_name: str) -> dict[str, Any]:
    """vLLM's ``/detokenize`` answer for ``body``: ``{"prompt": text}``. ApiError(400/404) for a bad body."""
    req: DetokenizeRequest = _decode(body, _detokenize_decoder, DetokenizeRequest)
    if req.model is not None and req.model != model_name:
        raise model_not_found(req.model)
    vocab = limits.vocab_size
    bad = next((t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range [0, {vocab if vocab is not None else '...'})",
                       param="tokens")  # fmt: skip
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def truncated(token_ids: list[int], keep: int | None, max_context: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as the context holds;
    None: all of it). ApiError for a value below -1 or above the context."""
    if keep is None:
        return token_ids
    if keep < -1 or keep == 0:
        raise ApiError(400, f"truncate_prompt_tokens must be -1 or >= 1, got {keep}", param="truncate_prompt_tokens")
    if keep == -1:
        if max_context is None:
            return token_ids  # the replica knows its context
        keep = max_context
    elif max_context is not None and keep > max_context:
        raise ApiError(
            400,
            f"truncate_prompt_tokens ({keep}) is larger than the model's context ({max_context} tokens)",
            param="truncate_prompt_tokens",
        )
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def keep_special_tokens(full: list[int], plain: list[int], keep: int) -> list[int]:
    """``keep`` tokens of a text prompt tokenised with special tokens (``full``) and without (``plain``): the
    special tokens the tokenizer adds (a BOS) and the text's last tokens -- what transformers gives for
    ``truncation=True, max_length=keep`` from the left, which vLLM asks for. ``full[-keep:]`` when the
    special tokens cannot be told apart or leave no room."""
    added = len(full) - len(plain)
    room = keep - added
    start = next((p for p in range(added + 1) if full[p : p + len(plain)] == plain), None)
    if start is None or added < 0 or room < 1:
        return full[-keep:]
    return full[:start] + plain[len(plain) - room :] + full[start + len(plain) :]


def _capped(max_tokens: int, limits: ModelLimits) -> int:
    """``max_tokens`` under the checkpoint's ``max_new_tokens``, as vLLM takes the least of the two (a bad value
    is left for the checks to name)."""
    cap = limits.max_new_tokens
    return min(max_tokens, cap) if cap is not None and max_tokens >= 1 else max_tokens


def _message(raw: Any, index: int) -> dict[str, Any]:
    """A message as the template sees it: content flattened to text (vLLM's "string" content format)."""
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where} must be an object with role and content", param=where)
    role = raw.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError(400, f"{where}.role must be a non-empty string", param=f"{where}.role")
    for field in ("function_call", "audio"):
        if raw.get(field):
            raise ApiError(400, f"{where}.{field} is not supported", param=f"{where}.{field}")
    message = {k: v for k, v in raw.items() if k in MESSAGE_FIELDS}
    for field in MESSAGE_FIELDS:  # role, checked above, passes again
        if message.get(field) is not None and not isinstance(message[field], str):
            raise ApiError(400, f"{where}.{field} must be a string", param=f"{where}.{field}")
    if raw.get("tool_calls"):
        if role != "assistant":
            raise ApiError(
                400, f"{where}.tool_calls: only assistant messages make tool calls", param=f"{where}.tool_calls"
            )
        message["tool_calls"] = _tool_calls(raw["tool_calls"], f"{where}.tool_calls")
    content = raw.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = kind if isinstance(kind, str) else type(part).__name__
                raise ApiError(400, f"{part_where}: only text content is supported, got {shown!r}", param=part_where)
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{part_where}.text must be a string", param=f"{part_where}.text")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:  # an assistant's turn of tool calls has none; vLLM renders a missing one as ""
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    message["content"] = content
    return message


MESSAGE_FIELDS = ("role", "name", "tool_call_id", "reasoning", "reasoning_content")  # passed to the template as sent


def _tools(tools: list[Any] | None, choice: Any, parser: str | None = None) -> list[Any] | None:
    """The tools to render into the prompt, or None. As vLLM: with ``tool_choice: "none"`` the tools go into the
    prompt (the template decides how) and the answer is plain text; ``"auto"`` (the default when tools are
    sent) needs a tool-call ``parser`` to turn the output into ``tool_calls`` (refused without one), and a
    named or ``"required"`` choice needs structured output, which is not here (refused)."""
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None if tools is None else []  # vLLM hands a template an empty list as sent
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]):  # fmt: skip
            raise ApiError(
                400, f'tools[{index}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                param=f"tools[{index}]",
            )  # fmt: skip
    if (choice is None or choice == "auto") and parser is None:
        raise ApiError(
            400,
            'tool_choice "auto" (the default with tools) needs a tool-call parser, which this server does not have; '
            'send tool_choice "none" to have the tools rendered into the prompt and the answer as text',
            param="tool_choice",
        )
    if choice not in (None, "auto", "none", "required"):
        _named_tool(choice, tools)
    return [as_vllm_tool(tool) for tool in tools]


def _tool_types(tools: list[Any]) -> dict[str, dict[str, str]]:
    """For the parsers whose models write values as raw text (``qwen3_coder``, ``glm45``): each function's
    parameters and the type its schema declares, lowercased (a list of types: its first that is not "null"; ""
    where there is none). ``tools`` were checked by :func:`_tools`."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found: dict[str, str] = {}
        for name, schema in properties.items() if isinstance(properties, dict) else ():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(kind, list):
                kind = next((k for k in kind if isinstance(k, str) and k != "null"), None)
            found[str(name)] = kind.strip().lower() if isinstance(kind, str) else ""
        types[function["name"]] = found
    return types


def _named_tool(choice: Any, tools: list[Any] | None) -> str | None:
    """The function a named ``tool_choice`` (``{"type": "function", "function": {"name": ...}}``) names, or None
    for the other choices; 400 unless it is one of ``tools``."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}', param="tool_choice")  # fmt: skip
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):  # fmt: skip
        raise ApiError(400, 'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                       param="tool_choice")  # fmt: skip
    name = function["name"]
    if name not in {tool["function"]["name"] for tool in tools or ()}:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the request's tools",
                       param="tool_choice.function.name")  # fmt: skip
    return str(name)


def _forced_tools_schema(tools: list[Any], name: str | None, required: bool, parallel: bool | None = None) -> Any:
    """The JSON schema the answer follows when ``tool_choice`` forces a call, as vLLM builds it: the ``name``d
    function's ``parameters`` (an empty object's schema when it has none); when ``required``, a non-empty array of
    ``{"name": <one of the tools>, "parameters": <its parameters>}`` (no other keys), each tool's ``$defs`` hoisted
    to the top, and of one call only with ``parallel_tool_calls`` false (OpenAI's meaning). None when the choice
    forces nothing."""
    no_parameters: dict[str, Any] = {"type": "object", "properties": {}}
    if name is not None:
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return no_parameters if function.get("parameters") is None else function["parameters"]
    if not required:
        return None
    variants: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        parameters: Any = tool["function"].get("parameters")
        parameters = no_parameters if parameters is None else parameters
        if isinstance(parameters, dict) and isinstance(parameters.get("$defs"), dict):
            parameters = dict(parameters)
            hoisted: dict[str, Any] = parameters.pop("$defs")
            for key, value in hoisted.items():
                if key in defs and defs[key] != value:
                    raise ApiError(400, f"tools[{index}]: $defs {key!r} differs from another tool's",
                                   param=f"tools[{index}].function.parameters")  # fmt: skip
                defs[key] = value
        variants.append({
            "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,  # unlike vLLM's: other keys would be dropped, and a model could wander
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, as a template renders them: each call's ``arguments`` JSON
    text parsed into an object first, as vLLM does before it applies the template."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", param=where)
    parsed = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise ApiError(400, f'{at} must be {{"function": {{"name": ..., "arguments": ...}}, ...}}', param=at)
        try:
            parsed.append(with_parsed_arguments(call))
        except ValueError:
            raise ApiError(400, f"{at}.function.arguments is not JSON", param=f"{at}.function.arguments") from None
    return parsed


def _template(override: str | None, tokenizer: Tokenizer) -> ChatTemplate:
    if override is not None:
        try:
            return ChatTemplate(override)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="chat_template") from None
    if tokenizer.chat_template is None:
        raise ApiError(
            400, "the model has no chat template; send chat_template, or use /v1/completions", param="chat_template"
        )
    return tokenizer.chat_template


# ---------------------------------------------------------------------- shared


def _refuse_unsupported(req: msgspec.Struct) -> None:
    for field, default in _UNSUPPORTED.items():
        value = getattr(req, field, default)
        if value != default:
            raise ApiError(400, f"{field} is not supported by this server", param=field)
    modalities = getattr(req, "modalities", None)
    if modalities is not None and set(modalities) - {"text"}:
        raise ApiError(400, f"only text output is supported, modalities asked for {modalities}", param="modalities")
    if not getattr(req, "spaces_between_special_tokens", True):
        raise ApiError(
            400, "spaces_between_special_tokens=false is not supported", param="spaces_between_special_tokens"
        )
    options = getattr(req, "stream_options", None)
    if options is not None and not getattr(req, "stream", False):
        raise ApiError(400, "stream_options can only be set with stream=true", param="stream_options")


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest, logprobs: int | None) -> int | None:
    """vLLM's ``prompt_logprobs``: asked for by name, or with ``echo`` the output's ``logprobs`` count (the echoed
    prompt's tokens are scored too). A stream cannot carry them (asking for alternatives there is refused)."""
    asked = req.prompt_logprobs
    if asked is None:
        return logprobs if req.echo else None
    if not 0 <= asked <= MAX_LOGPROBS:
        raise ApiError(
            400, f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {asked}", param="prompt_logprobs"
        )
    if req.stream and asked > 0:
        raise ApiError(400, "prompt_logprobs are not available when stream=True", param="prompt_logprobs")
    return asked


MAX_CHOICES = 256


_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")
_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class Constraint(NamedTuple):
    """A request's structured output: a guided choice as token sequences, or a grammar (llguidance's text)."""

    choices: tuple[tuple[int, ...], ...] | None = None
    grammar: str | None = None


def _constraint(req: _GenerationFields, tokenizer: Tokenizer, vocab: int | None, forced: Any = None) -> Constraint:
    """What constrains the output, from ``response_format`` (``json_object``, ``json_schema``), vLLM's
    ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` and its options) or the
    older ``guided_*`` fields: at most one kind per request, as in vLLM. A schema, regex or grammar is compiled and
    checked against the model's tokenizer here, so what the worker gets is known to compile."""
    found: dict[str, tuple[Any, str]] = {}  # kind -> (value, the field it came from)
    options: dict[str, Any] = {}
    structured = req.structured_outputs
    if structured is not None:
        if not isinstance(structured, dict):
            raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(set(structured) - {*_KINDS, *_OPTIONS})
        if unknown:
            raise ApiError(
                400, f"structured_outputs has no field {unknown[0]!r}", param=f"structured_outputs.{unknown[0]}"
            )
        if not isinstance(structured.get("json_object", False), bool | None):
            raise ApiError(400, "structured_outputs.json_object must be a boolean",
                           param="structured_outputs.json_object")  # fmt: skip
        for key in _KINDS:
            if structured.get(key) is not None and structured[key] is not False:
                found[key] = (structured[key], f"structured_outputs.{key}")
        options = {key: structured[key] for key in _OPTIONS if structured.get(key) is not None}
    for field, kind in _LEGACY.items():
        value = getattr(req, field)
        if value is not None:
            if kind in found:
                raise ApiError(400, f"send {field} or {found[kind][1]}, not both", param=field)
            found[kind] = (value, field)
    if req.guided_whitespace_pattern is not None:
        options.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    if req.guided_decoding_backend is not None and not isinstance(req.guided_decoding_backend, str):
        raise ApiError(400, "guided_decoding_backend must be a string", param="guided_decoding_backend")
    _response_format(req.response_format, found)
    if forced is not None:
        if found:
            where = next(iter(found.values()))[1]
            raise ApiError(400, f"a named or required tool_choice fixes the answer's schema; {where} cannot be set "
                           "beside it", param=where)  # fmt: skip
        found["json"] = (forced, "tool_choice")
    if len(found) > 1:
        fields = ", ".join(where for _, where in found.values())
        raise ApiError(400, f"only one kind of structured output per request, got {fields}",
                       param=next(iter(found.values()))[1])  # fmt: skip
    if not found:
        return Constraint()
    ((kind, (value, where)),) = found.items()
    if kind == "choice":
        return Constraint(choices=_choices(value, where, tokenizer, vocab))
    if kind == "structural_tag":
        return Constraint(grammar=_structural_tag(value, where, options, tokenizer, vocab))
    return Constraint(grammar=_grammar(kind, value, where, options, tokenizer, vocab))


def _response_format(value: Any, found: dict[str, tuple[Any, str]]) -> None:
    """OpenAI's ``response_format``: ``text`` (what is generated anyway: SDKs send it by default), ``json_object``
    (any JSON object) or ``json_schema`` (``{"json_schema": {"name": ..., "schema": {...}}}``)."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        found["json_object"] = (True, "response_format")
    elif kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ApiError(400, 'response_format.json_schema must be {"name": ..., "schema": {...}}',
                           param="response_format.json_schema")  # fmt: skip
        if spec.get("schema") is None:
            raise ApiError(400, "response_format.json_schema.schema is required here (the JSON schema the answer "
                           "follows)", param="response_format.json_schema.schema")  # fmt: skip
        found["json"] = (spec["schema"], "response_format.json_schema.schema")
    elif kind == "structural_tag":
        found["structural_tag"] = (value, "response_format")
    else:
        raise ApiError(400, 'response_format.type must be "text", "json_object", "json_schema" or "structural_tag"',
                       param="response_format")  # fmt: skip


def _grammar(
    kind: str, value: Any, where: str, options: dict[str, Any], tokenizer: Tokenizer, vocab: int | None
) -> str:
    """A JSON schema, regex or grammar as llguidance grammar text, checked against the model's tokenizer."""
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(options.get(flag, False), bool):
            raise ApiError(400, f"structured_outputs.{flag} must be a boolean", param=f"structured_outputs.{flag}")
    pattern = options.get("whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or len(pattern) > MAX_NAME_CHARS):
        raise ApiError(400, f"whitespace_pattern must be a string of at most {MAX_NAME_CHARS} characters",
                       param="structured_outputs.whitespace_pattern")  # fmt: skip
    try:
        llm = grammar_tokenizer(tokenizer, vocab, tokenizer.eos_token_ids)
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else value
            if isinstance(schema, str):  # vLLM takes the schema as JSON text too
                schema = read_json_text(schema, "the schema")
            else:
                check_json_size(schema, "the schema")
            grammar = json_schema_grammar(
                schema,
                any_whitespace=not options.get("disable_any_whitespace", False),
                whitespace_pattern=pattern,
                closed_objects=options.get("disable_additional_properties", False),
            )
        else:
            if not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS:
                raise StructuredOutputError(f"must be a non-empty string of at most {MAX_GRAMMAR_CHARS:,} characters")
            grammar = regex_grammar(value) if kind == "regex" else text_grammar(value)
        check_grammar(grammar, llm)
    except StructuredOutputError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from None
    return grammar


MAX_TAGS = 64  # structures, and triggers, in one structural tag


def _structural_tag(value: Any, where: str, options: dict[str, Any], tokenizer: Tokenizer, vocab: int | None) -> str:
    """vLLM's structural tag (``response_format`` of type ``structural_tag``, or ``structured_outputs.structural_tag``
    as its JSON text): ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``. The output is free
    text in which a trigger opens the structure whose ``begin`` starts with it: the rest of its ``begin``, JSON
    following its ``schema``, then its ``end`` are forced, and free text goes on after. xgrammar's newer ``format``
    form is refused by name."""
    if options:
        option = next(iter(options))
        raise ApiError(400, f"structured_outputs.{option} applies to JSON schemas, not to a structural tag",
                       param=f"structured_outputs.{option}")  # fmt: skip
    if isinstance(value, str):  # structured_outputs.structural_tag: the object as JSON text, as vLLM takes it
        try:
            value = read_json_text(value, "the structural tag")
        except StructuredOutputError as exc:
            raise ApiError(400, f"{where}: {exc}", param=where) from None
    if not isinstance(value, dict):
        raise ApiError(400, f'{where} must be an object with "structures" and "triggers"', param=where)
    if "format" in value:
        raise ApiError(400, f"{where}: the structural tag's \"format\" form is not supported here; send "
                       '"structures" and "triggers"', param=f"{where}.format")  # fmt: skip
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown:
        raise ApiError(400, f"{where} has no field {unknown[0]!r}", param=f"{where}.{unknown[0]}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ApiError(400, f'{where}.type must be "structural_tag"', param=f"{where}.type")
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not 1 <= len(triggers) <= MAX_TAGS:
        raise ApiError(400, f"{where}.triggers must be a list of 1 to {MAX_TAGS} strings", param=f"{where}.triggers")
    for index, trigger in enumerate(triggers):
        if not isinstance(trigger, str) or not trigger or len(trigger) > MAX_NAME_CHARS:
            raise ApiError(400, f"{where}.triggers[{index}] must be a non-empty string of at most {MAX_NAME_CHARS} "
                           "characters", param=f"{where}.triggers[{index}]")  # fmt: skip
    if not isinstance(structures, list) or not 1 <= len(structures) <= MAX_TAGS:
        raise ApiError(400, f"{where}.structures must be a list of 1 to {MAX_TAGS} objects",
                       param=f"{where}.structures")  # fmt: skip
    tags: list[Tag] = []
    for index, structure in enumerate(structures):
        at = f"{where}.structures[{index}]"
        if not isinstance(structure, dict):
            raise ApiError(400, f'{at} must be an object with "begin", "schema" and "end"', param=at)
        extra = sorted(set(structure) - {"begin", "schema", "end"})
        if extra:
            raise ApiError(400, f"{at} has no field {extra[0]!r}", param=f"{at}.{extra[0]}")
        begin, end, schema = structure.get("begin"), structure.get("end", ""), structure.get("schema")
        for name, text in (("begin", begin), ("end", end)):
            if not isinstance(text, str) or (name == "begin" and not text) or len(text) > MAX_NAME_CHARS:
                raise ApiError(400, f"{at}.{name} must be a{' non-empty' if name == 'begin' else ''} string of at "
                               f"most {MAX_NAME_CHARS} characters", param=f"{at}.{name}")  # fmt: skip
        assert isinstance(begin, str) and isinstance(end, str)
        opened_by = [trigger for trigger in triggers if begin.startswith(trigger)]
        if not opened_by:
            raise ApiError(400, f"{at}.begin {begin!r} starts with none of the triggers", param=f"{at}.begin")
        if schema is None or schema is True:
            schema = {}  # any JSON value
        if not isinstance(schema, dict):
            raise ApiError(400, f"{at}.schema must be a JSON schema (an object)", param=f"{at}.schema")
        try:
            check_json_size(schema, "the schema")
        except StructuredOutputError as exc:
            raise ApiError(400, f"{at}.schema: {exc}", param=f"{at}.schema") from None
        # The shortest: a trigger fires as soon as its text appears, so one that a longer trigger starts with
        # would fire first and leave this structure unreachable.
        tags.append(Tag(min(opened_by, key=len), begin, schema, end))
    try:
        grammar = structural_tag_grammar(tags, special_token_ids(tokenizer))
        check_grammar(grammar, grammar_tokenizer(tokenizer, vocab, tokenizer.eos_token_ids))
    except StructuredOutputError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from None
    return grammar


def _choices(choices_asked: Any, where: str, tokenizer: Tokenizer, vocab: int | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's guided choice as token sequences, each choice tokenised alone, as the output will read it."""
    if not isinstance(choices_asked, list) or not choices_asked or len(choices_asked) > MAX_CHOICES:
        raise ApiError(400, f"{where} must be a list of 1 to {MAX_CHOICES} strings", param=where)
    sequences: list[tuple[int, ...]] = []
    context = tokenizer.encode("x")  # a choice's tokens must read as the choice after other text, as output does
    before = tokenizer.decode(context, skip_special_tokens=False)
    for index, choice in enumerate(choices_asked):
        if not isinstance(choice, str) or not choice or len(choice) > MAX_NAME_CHARS:
            raise ApiError(400, f"{where}[{index}] must be a non-empty string of at most {MAX_NAME_CHARS} characters",
                           param=f"{where}[{index}]")  # fmt: skip
        ids = tuple(tokenizer.encode(choice))
        if not ids or any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise ApiError(400, f"{where}[{index}] does not tokenise into this model's vocabulary",
                           param=f"{where}[{index}]")  # fmt: skip
        after = tokenizer.decode([*context, *ids], skip_special_tokens=False)
        if not after.startswith(before) or after[len(before) :] != choice:
            # A SentencePiece-style tokenizer marks a word's start (``▁negative``): its tokens read " negative"
            # after other text, not the choice. Choices are constrained by their own tokens here, so refuse.
            raise ApiError(400, f"{where}[{index}]: {choice!r} reads as {after[len(before):]!r} from this model's "
                           "tokens after other text; this server constrains a choice to its own tokenization",
                           param=f"{where}[{index}]")  # fmt: skip
        sequences.append(ids)
    return tuple(dict.fromkeys(sequences))


def _sampling(
    req: _GenerationFields,
    logprobs: int | None,
    limits: ModelLimits,
    tokenizer: Tokenizer,
    *,
    prompt_logprobs: int | None = None,
    forced: Any = None,
) -> SamplingParams:
    """``forced``: the JSON schema a named or required ``tool_choice`` holds the answer to (None: none)."""

    def bounded(field: str, value: float | None, low: float, high: float, *, low_open: bool = False) -> None:
        if value is None:
            return
        if value != value or value < low or value > high or (low_open and value == low):
            shown = f"({low}" if low_open else f"[{low}"
            raise ApiError(400, f"{field} must be in {shown}, {high}], got {value}", param=field)

    bounded("temperature", req.temperature, 0.0, float("inf"))
    bounded("top_p", req.top_p, 0.0, 1.0, low_open=True)
    bounded("min_p", req.min_p, 0.0, 1.0)
    bounded("repetition_penalty", req.repetition_penalty, 0.0, float("inf"), low_open=True)
    bounded("presence_penalty", req.presence_penalty, -2.0, 2.0)
    bounded("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(400, f"top_k must be -1 (no limit), 0 (no limit) or positive, got {req.top_k}", param="top_k")
    if not 1 <= req.n <= MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if req.seed is not None and not -_INT64 <= req.seed < _INT64:
        raise ApiError(400, "seed must fit in a signed 64-bit integer", param="seed")
    if req.min_tokens < 0:
        raise ApiError(400, f"min_tokens must be >= 0, got {req.min_tokens}", param="min_tokens")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    vocab = limits.vocab_size
    stop_ids = tuple(req.stop_token_ids or ())
    for token in stop_ids:
        if token < 0 or (vocab is not None and token >= vocab):
            raise ApiError(400, f"stop_token_ids: {token} is not a token id of this model", param="stop_token_ids")
    constraint = _constraint(req, tokenizer, vocab, forced)
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        n=req.n,
        stop=stop,
        stop_token_ids=stop_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(req.logit_bias, vocab),
        skip_special_tokens=req.skip_special_tokens,
        allowed_token_ids=_allowed(req.allowed_token_ids, vocab),
        bad_words_token_ids=_bad_words(req.bad_words, tokenizer, vocab),
        choice_token_ids=constraint.choices,
        grammar=constraint.grammar,
    )


def _bad_words(words: list[str] | None, tokenizer: Tokenizer, vocab: int | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences the output may not complete, tokenised as vLLM does: each
    word (leading spaces stripped) as it reads at the start of a text and, where a leading space makes a
    different first token in as many tokens, as it reads after a space -- so the word is refused both at the
    start and in the middle of a text."""
    sequences: list[tuple[int, ...]] = []
    for word in words or ():
        bare = tuple(tokenizer.encode(word.lstrip()))
        if not bare:
            raise ApiError(400, f"bad_words: {word!r} has no tokens", param="bad_words")
        sequences.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    bad = next((t for seq in sequences for t in seq if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ApiError(400, f"bad_words: token {bad} is outside this model's vocabulary", param="bad_words")
    return tuple(sequences)


def _allowed(ids: list[int] | None, vocab: int | None) -> tuple[int, ...] | None:
    """vLLM's ``allowed_token_ids``: only these may be sampled (EOS too only if listed)."""
    if ids is None:
        return None
    if not ids:
        raise ApiError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise ApiError(400, f"allowed_token_ids: {bad} is not a token id of this model", param="allowed_token_ids")
    return tuple(sorted(set(ids)))


def _logit_bias(bias: Mapping[str, float] | None, vocab: int | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if token < 0 or (vocab is not None and token >= vocab):
            raise ApiError(400, f"logit_bias: {token} is not a token id of this model", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        out[token] = float(value)
    return out


def _check_lengths(
    token_ids: Sequence[int],
    max_tokens: int,
    sampling: SamplingParams,
    limits: ModelLimits,
    *,
    param: str = "max_tokens",
) -> None:
    if max_tokens <= 0:
        raise ApiError(400, f"{param} must be >= 1, got {max_tokens}", param=param)
    if sampling.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({sampling.min_tokens}) exceeds {param} ({max_tokens})", param="min_tokens")
    upper = limits.vocab_size
    bad = next((t for t in token_ids if t < 0 or (upper is not None and t >= upper)), None)
    if bad is not None:
        bound = "..." if upper is None else str(upper)
        raise ApiError(400, f"token id {bad} is out of range [0, {bound})", param="prompt")
    total = len(token_ids) + max_tokens
    if limits.max_context is not None and total > limits.max_context:
        raise ApiError(
            400,
            f"prompt ({len(token_ids)} tokens) + {param} ({max_tokens}) = {total} exceeds the model's "
            f"context of {limits.max_context} tokens",
            param=param,
        )


def _parsed(
    kind: Literal["completion", "chat"],
    req: CompletionRequest | ChatCompletionRequest,
    token_ids: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    echo: str | None,
    logprobs: int | None,
) -> ParsedRequest:
    options = req.stream_options
    return ParsedRequest(
        kind=kind,
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        model=req.model,
        cache_salt=req.cache_salt,
        lora_name=req.lora_name,
        stream=req.stream,
        include_usage=bool(req.stream and options is not None and options.include_usage),
        # As vLLM: usage in every chunk only when the stream carries usage at all.
        continuous_usage=bool(
            req.stream and options is not None and options.include_usage and options.continuous_usage_stats
        ),
        echo_text=echo,
        logprobs=logprobs,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
    )
