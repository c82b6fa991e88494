"""Chat templates rendered as Hugging Face renders them, so a prompt hashes as the replica will see it.

A model's chat template is Jinja. transformers' ``apply_chat_template``
renders it in a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}``
block (which only marks assistant text), a ``tojson`` filter that keeps
non-ASCII text, and two globals: ``raise_exception`` (a template's way to
refuse a conversation) and ``strftime_now``. Its variables are the
messages, ``add_generation_prompt``, the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) and any extra keyword arguments. Any
difference here would change the rendered text, the tokens, and so every
block hash the router computes: tests compare our rendering with
transformers' on real templates.

Errors: a template that does not compile, or that calls ``raise_exception``,
raises :class:`ChatTemplateError`, which the HTTP layer turns into a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvstore.errors import KVStoreError


class ChatTemplateError(KVStoreError, ValueError):
    """The template is broken, or it refused these messages (its ``raise_exception``)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers uses it to mark assistant text)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """One compiled template. Thread-safe: rendering keeps no state between calls."""

    def __init__(self, source: str) -> None:
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        special_tokens: Mapping[str, str],
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``, as transformers' ``apply_chat_template(tokenize=False)`` gives it.

        ``continue_final_message`` leaves the last message open (the model
        continues it): the rendering is cut right after that message's text.
        ``extra`` (a request's ``chat_template_kwargs``) wins over the other
        arguments, ``messages`` aside, as vLLM lays a request's kwargs over its own.
        Whatever ``extra`` holds, a failure is a ChatTemplateError (a 400), never
        another exception: ``tools`` or ``documents`` in it that are not lists
        (null aside) are refused naming the field.
        """
        overrides = {name: value for name, value in (extra or {}).items() if name not in ("messages", "chat_template")}
        add_generation_prompt = bool(overrides.pop("add_generation_prompt", add_generation_prompt))
        continue_final_message = bool(overrides.pop("continue_final_message", continue_final_message))
        tools = overrides.pop("tools", tools)
        documents = overrides.pop("documents", documents)
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        variables: dict[str, Any] = {**special_tokens, **overrides}
        try:
            variables.update(
                messages=_tagged_final(messages) if continue_final_message else [dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=_list_or_none("chat_template_kwargs.tools" if "tools" in (extra or {}) else "tools", tools),
                documents=_list_or_none(
                    "chat_template_kwargs.documents" if "documents" in (extra or {}) else "documents", documents
                ),
            )
            rendered = self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render these messages: {exc}") from None
        except Exception as exc:  # whatever a template does (1/0, unbounded recursion, a huge range): a 400
            problem = f"{type(exc).__name__}: {exc}"
            raise ChatTemplateError(f"the chat template failed on these messages: {problem}") from None
        if continue_final_message:
            rendered = _cut_at_tag(rendered)
        return rendered


def _list_or_none(name: str, value: Any) -> list[Any] | None:
    """``value`` (a chat's ``tools`` or ``documents``, perhaps from its ``chat_template_kwargs``) as a list."""
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise ChatTemplateError(f"{name} must be a list, not {type(value).__name__}")
    return list(value)


def with_parsed_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier tool call of a conversation as vLLM hands it to a chat template: its function's ``arguments``
    JSON text parsed into an object (templates render it with ``tojson``), and none (missing, null, "") as
    ``{}``. ``call["function"]`` must be a mapping; raises ValueError when the arguments are text that is not
    JSON."""
    function = call["function"]
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        arguments = json.loads(arguments)
    return {**call, "function": {**function, "arguments": arguments}}


def as_vllm_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A request's tool as vLLM hands it to a chat template (its pydantic model dumped): ``type`` first, the
    function's ``name``, ``description`` and ``parameters`` (null when not sent) before anything else it has.
    A template that renders ``tool | tojson`` then gives vLLM's prompt. ``tool["function"]`` must be a mapping."""
    function = tool["function"]
    shaped = {"name": function.get("name"), "description": function.get("description"),
              "parameters": function.get("parameters")}  # fmt: skip
    return {"type": tool.get("type", "function"), "function": {**shaped, **function}} | {
        key: value for key, value in tool.items() if key not in ("type", "function")
    }


def request_template(fields: Mapping[str, Any]) -> Any:
    """The template a chat request brings, if any: its ``chat_template``, else one inside its
    ``chat_template_kwargs`` (vLLM takes either, and trusts neither by default)."""
    template = fields.get("chat_template")
    kwargs = fields.get("chat_template_kwargs")
    if template is None and isinstance(kwargs, Mapping):
        template = kwargs.get("chat_template")
    return template


# continue_final_message, as transformers' apply_chat_template does it (and so vLLM): the final message's text
# (its last text part) is rendered with this marker after it, and the prompt is cut where the marker lands -- not
# where the text itself last occurs, which the template's own closing markup can repeat ("e", "", "{").
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_final(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages``, the final one's text marked with ``_CONTINUE_TAG``."""
    if not messages:
        raise ChatTemplateError("continue_final_message needs at least one message")
    copied = [dict(m) for m in messages]
    final = copied[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return copied
    if isinstance(content, list):
        for position in range(len(content) - 1, -1, -1):
            part = content[position]
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts = list(content)
                parts[position] = {**part, "text": part["text"] + _CONTINUE_TAG}
                final["content"] = parts
                return copied
    raise ChatTemplateError("continue_final_message needs the last message to have text content")


def _cut_at_tag(rendered: str) -> str:
    """The rendering cut where the final message's marker landed (see ``_CONTINUE_TAG``)."""
    tag = _CONTINUE_TAG.strip()
    where = rendered.rfind(tag)
    if where < 0:
        raise ChatTemplateError("continue_final_message: the template does not render the final message's text")
    if rendered.startswith(_CONTINUE_TAG, where):
        return rendered[:where]
    return rendered[:where].rstrip()  # the template trimmed the text's trailing space: trim what came before too


# The built-in model reads UTF-8 bytes; its conversations use ChatML markers, written out as text.
BYTE_MODEL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
