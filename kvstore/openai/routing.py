"""What a router reads from a client's body to route it to an external replica (vLLM, SGLang), touching nothing.

In front of replicas it does not run, the router forwards the client's bytes
unchanged: every field and value, vendor extensions included, a text prompt
still as text. It only needs the prompt's tokens, tokenised exactly as the
replica will tokenise them, to look up which replica holds the longest
prefix: completions with ``add_special_tokens`` (default true), chat through
the model's chat template (with the body's ``tools``, ``documents`` and
``chat_template_kwargs``, tools and earlier tool calls shaped as vLLM hands
them to a template) with ``add_special_tokens`` false -- vLLM's defaults;
``truncate_prompt_tokens`` as vLLM applies it. A template the body brings
itself (``chat_template``, or one in ``chat_template_kwargs``) is a program:
the router runs it only when told to trust request templates.

A body the router cannot tokenise exactly (no prompt, a field of the wrong
type, images in a message, a template that refuses the conversation, a
request template it does not trust) is
still forwarded, and routed on load alone (``token_ids`` None): the replica
answers it, errors included, as it would without a router. What the router
refuses itself: a body that is not a JSON object, and any text when no
tokenizer is configured -- byte ids would be garbage to a real model, and
routing on them would be routing on noise.

Bounds: the body has already passed :mod:`kvstore.openai.bounds` (the
router reads it with :func:`kvstore.openai.http.read_body`), so decoding it
here, generically, builds a bounded number of values. A ``cache_salt`` longer
than any name (:data:`~kvstore.openai.protocol.Name`) is not hashed: the body
is routed on load alone and the replica judges it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from kvstore.openai.chat_template import (
    ChatTemplate,
    as_vllm_tool,
    request_template,
    with_parsed_arguments,
)
from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import MAX_NAME_CHARS, MESSAGE_FIELDS, keep_special_tokens
from kvstore.openai.tokenizer import Tokenizer

NO_TOKENIZER = (
    "this router has no tokenizer for the replicas' model, so it cannot read a text prompt: set router.tokenizer "
    "to the model directory (or its tokenizer.json), or send the prompt as token ids"
)


class RoutingView(NamedTuple):
    token_ids: list[int] | None  # None: routed on load alone (see the module docstring)
    model: str | None
    cache_salt: str | None
    stream: bool


class _TokenIdsBody(msgspec.Struct):
    """A completion whose prompt is one list of token ids, the common case decoded in one typed pass.

    Any other body fails this type and is read by the general path, which gives the same view.
    """

    prompt: list[int]
    model: str | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)] | None = None  # longer: the general path
    stream: Any = None
    truncate_prompt_tokens: Any = None


_TOKEN_IDS_BODY = msgspec.json.Decoder(_TokenIdsBody)


def read_for_routing(
    body: bytes, kind: Literal["completion", "chat"], tokenizer: Tokenizer | None, *, trust_template: bool = False
) -> RoutingView:
    """The routing view of ``body``; ApiError(400) only for what no replica could serve (module docstring).

    ``trust_template``: render a ``chat_template`` the body sends (else such a chat is routed by load alone:
    a request's template is a program this process does not run unless told to)."""
    if kind == "completion":
        view = read_token_ids(body)
        if view is not None:
            return view
    return _read_any(body, kind, tokenizer, trust_template)


def read_token_ids(body: bytes) -> RoutingView | None:
    """The routing view of a completion whose prompt is one list of token ids; None for any other body.

    What :func:`read_for_routing` answers for such a body, in a fifth of the time for a 1k-token prompt
    (one typed pass): it is on every request's TTFT. Never tokenises, never raises.
    """
    try:
        ids = _TOKEN_IDS_BODY.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    return RoutingView(_kept(ids.prompt, ids.truncate_prompt_tokens), ids.model, ids.cache_salt or None,
                       ids.stream is True)  # fmt: skip


def _read_any(
    body: bytes, kind: Literal["completion", "chat"], tokenizer: Tokenizer | None, trust_template: bool = False
) -> RoutingView:
    """The general path of :func:`read_for_routing`, for every body."""
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = data.get("model") if isinstance(data.get("model"), str) else None
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) and data.get("cache_salt") else None
    stream = data.get("stream") is True
    if salt is not None and len(salt) > MAX_NAME_CHARS:
        return RoutingView(None, model, None, stream)
    if kind == "completion":
        tokens = _completion_tokens(data, tokenizer)
    else:
        tokens = _chat_tokens(data, tokenizer, trust_template)
    if tokens is not None:
        tokens = _kept(tokens, data.get("truncate_prompt_tokens"))
    return RoutingView(tokens, model, salt, stream)


def _kept(tokens: list[int], keep: Any) -> list[int]:
    """With ``truncate_prompt_tokens`` the replica reads only the prompt's last tokens, and so routing hashes
    them (-1, the replica's context, is not known here: the whole prompt)."""
    return tokens[-keep:] if type(keep) is int and 0 < keep < len(tokens) else tokens


def _completion_tokens(data: dict[str, Any], tokenizer: Tokenizer | None) -> list[int] | None:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt):
        prompt = prompt[0]  # a batch: route on its first prompt (the replica serves them all)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    if not isinstance(prompt, str) or not prompt:
        return None
    if tokenizer is None:
        raise ApiError(400, NO_TOKENIZER, param="prompt")
    add_special = data.get("add_special_tokens", True) is not False
    ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    keep = data.get("truncate_prompt_tokens")
    if add_special and type(keep) is int and 0 < keep < len(ids):  # the replica keeps the BOS (vLLM)
        return keep_special_tokens(ids, tokenizer.encode(prompt, add_special_tokens=False), keep)
    return ids


def _chat_tokens(data: dict[str, Any], tokenizer: Tokenizer | None, trust_template: bool) -> list[int] | None:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    if tokenizer is None:
        raise ApiError(400, NO_TOKENIZER, param="messages")
    own = request_template(data)
    if own is not None and not (trust_template and isinstance(own, str)):
        return None  # a template this process does not run (or that is no template): routed by load
    flat = []
    for raw in messages:
        if not isinstance(raw, dict):
            return None
        content = raw.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                return None  # images, audio: the replica's processor expands them; we cannot
            content = "\n".join(p["text"] for p in content)
        # The fields the worker's parse keeps, so a template sees the same message from both.
        message = {k: v for k, v in raw.items() if k in MESSAGE_FIELDS} | {"content": content or ""}
        calls = raw.get("tool_calls")
        if calls:  # rendered as the replica renders them: arguments parsed (vLLM)
            if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                    for c in calls)):  # fmt: skip
                return None
            try:
                message["tool_calls"] = [with_parsed_arguments(c) for c in calls]
            except ValueError:
                return None  # the replica refuses it
        flat.append(message)
    tools = data.get("tools")
    if isinstance(tools, list) and tools:
        if not all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools):
            return None
        tools = [as_vllm_tool(t) for t in tools]
    try:
        template = ChatTemplate(own) if own is not None else tokenizer.chat_template
        if template is None:
            return None
        extra = data.get("chat_template_kwargs") if isinstance(data.get("chat_template_kwargs"), dict) else None
        text = template.render(
            flat,
            add_generation_prompt=data.get("add_generation_prompt", True) is not False,
            continue_final_message=data.get("continue_final_message") is True,
            special_tokens=tokenizer.special_tokens,
            tools=tools if isinstance(tools, list) else None,
            documents=data.get("documents") if isinstance(data.get("documents"), list) else None,
            extra=extra,
        )
    except Exception:  # any rendering failure, a ChatTemplateError or not: the replica judges the body
        return None
    return tokenizer.encode(text, add_special_tokens=data.get("add_special_tokens") is True)
