"""Tool calls in a chat answer: the ``hermes`` format, parsed as vLLM's ``--tool-call-parser hermes`` parses it.

Models trained on the Hermes / Qwen2.5 tool format (their chat templates
tell them to) answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

With a parser configured (``router.tool_call_parser = "hermes"``), a chat
request with ``tools`` and ``tool_choice`` ``"auto"`` (the default when
tools are sent) has its answer turned into OpenAI ``tool_calls``:

- plain (:func:`extract`): every ``<tool_call>`` block -- the last one may
  be cut off by the end of the answer -- is one call, its ``arguments``
  re-serialised as JSON text (``ensure_ascii=False``); the message's
  ``content`` is the text before the first block (None when empty), and
  the choice ends with ``finish_reason: "tool_calls"``. If any block is not
  a JSON object with a string ``name`` and ``arguments``, nothing is a call: the whole answer
  is the content, as vLLM falls back.
- streamed (:class:`ToolCallStream`): text outside the blocks streams as
  content as it comes (a possible start of ``<tool_call>`` at the end of a
  delta is held back until the next delta tells); a block is held until
  its ``</tool_call>`` (or the end of the answer) and then goes out as one
  ``tool_calls`` delta with the call's index, id, name and whole
  arguments. Text outside the blocks after the first call is not content,
  as in the plain answer (vLLM's streams drop it too). OpenAI's clients
  accumulate tool-call deltas by index, so one delta per call reads the
  same as vLLM's argument-by-argument deltas. A
  block that is not a valid call goes out as content, and when no call
  went out before it, so does the rest of the answer (the plain answer is
  then all content).

``llama3_json`` (Llama 3.1+, vLLM's ``--tool-call-parser llama3_json``): the
model answers a call as a JSON object, ``{"name": ..., "parameters": ...}``
(or ``"arguments"``), several separated by ``; ``, after an optional
``<|python_tag|>``. Plain (:func:`extract`), an answer that starts with
``{`` or ``<|python_tag|>`` is calls (as vLLM reads it): every top-level
JSON object in it is a call and the content is None; any object that does not
parse or lacks a name leaves the whole answer as content, as vLLM falls
back. Streamed, an answer that starts with ``{`` or ``<|python_tag|>`` is
held whole and parsed at its end (calls, or the text as content if it is
none); any other answer streams as content as it comes.

Forced calls (no parser needed, as in vLLM): with a named ``tool_choice`` the
answer is held by its grammar to the function's arguments, and becomes one
call of that function (:func:`named_call`; streamed by :class:`NamedCallStream`,
the arguments as they come, the first delta naming the call); with
``"required"`` it is a JSON array of ``{"name", "parameters"}`` objects, each
one call (:func:`read_required`; streamed by :class:`RequiredCallStream`,
each call as soon as its object is whole).

``mistral`` (vLLM's ``--tool-call-parser mistral``): the answer's calls
follow a ``[TOOL_CALLS]`` token, the text before it being the content.
Mistral's older tokenizers (v0.3: Mistral-7B-Instruct) write one JSON
array of ``{"name", "arguments"}`` after it; v11 and later (Mistral Small
3.x) write ``[TOOL_CALLS]name{...}`` per call, sometimes with ``[ARGS]``
between the name and the arguments. The format is told by what follows the
token (an array or not), where vLLM reads the tokenizer's version; a v11
call's arguments are kept as written, well-formed or not, as vLLM keeps
them. Call ids are 9 letters and digits, as Mistral's templates require.
Streamed, text before the first ``[TOOL_CALLS]`` streams as content; a
v11 call goes out as soon as its arguments begin (the name in its first
delta, then its arguments as they come, as vLLM streams them), while a
v0.3 array is held and goes out at the end of the answer, one delta per
call: an array that never closes is all content in the plain answer, so
none of its elements may go out before it does.

``pythonic`` (Llama 3.2 and 4, vLLM's ``--tool-call-parser pythonic``): an
answer that is a Python list of calls, ``[get_weather(city="Paris"),
get_time()]`` (inside ``<|python_start|>`` / ``<|python_end|>`` for Llama
4), is calls, their keyword arguments Python literals turned into JSON;
any other answer is content. Streamed like ``llama3_json``: an answer that
starts as a list is held whole and parsed at its end.

``qwen3_coder`` (Qwen3-Coder, vLLM's ``--tool-call-parser qwen3_coder``):
each call is an XML-like block, a parameter's value written raw between its
tags::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value loses one newline at each end and is then read by the type its
parameter declares in the request's ``tools`` (``tool_types``), much as
vLLM reads it: ``null`` is null whatever the type; a string type (or a
parameter the schema does not name, or one without a type) keeps the text;
an integer type reads an int, a number type a float (an int when whole); a
boolean is ``true`` or not; any other type (object, array) reads JSON, then
a Python literal, else keeps the text. Where this differs from vLLM: a
boolean ignores surrounding whitespace, a list of types is read by its
first that is not ``"null"``, an unknown type tries JSON before a Python
literal, and what JSON cannot carry (NaN, infinities, a set) stays text.
A block may hold several ``<function=...>`` calls, and the last may be
cut off by the end of the answer. Blocks, content and fallback are as for
``hermes``: a block whose function does not read leaves the whole plain
answer as content, and streams as content; a block with no ``<function=``
in it is passed over, as vLLM passes it (its text is content only if no
call is read). Streamed, a block goes out whole at its ``</tool_call>``.
Calls written without their ``<tool_call>`` blocks are read when the answer
has no block at all (vLLM's back-off), the content being the text before
the first ``<function=``; streamed, such an answer is held from its first
``<function=`` and read at its end (or, if a block opens after all, the
held text goes out as content, as the plain answer's is then).

``deepseek_v3`` and ``deepseek_v31`` (DeepSeek-V3 / R1 and V3.1, vLLM's
parsers of those names; either reads both forms): the calls follow
``<｜tool▁calls▁begin｜>``, each between ``<｜tool▁call▁begin｜>`` and
``<｜tool▁call▁end｜>``. V3 writes the call's type, ``<｜tool▁sep｜>``, the
name and its arguments in a fenced JSON block (``function<｜tool▁sep｜>name``,
then ```` ```json ```` ... ```` ``` ````); V3.1 writes the name,
``<｜tool▁sep｜>`` and the arguments. The arguments are kept as written, as
vLLM keeps them, so a call needs its closing tag (one the end of the answer
cut off is no call). The content is the text before the calls; blocks and
fallbacks are as for ``hermes``, and streamed the same way (the calls'
opening tag is no content: a stream keeps it back until a call reads, and
sends it as content only if none does).

``glm45`` (GLM-4.5 / 4.6, vLLM's ``glm45``): ``<tool_call>`` blocks that
hold the function's name on their first line, then ``<arg_key>KEY</arg_key>``
``<arg_value>VALUE</arg_value>`` pairs. A value is kept as written where its
parameter's declared type is ``string``, and otherwise read as JSON, then as
a Python literal, else kept as text, as vLLM reads it; a call needs its
closing tag. Blocks, content and streaming are ``hermes``'s.

``kimi_k2`` (Kimi K2, vLLM's ``kimi_k2``): the calls follow
``<|tool_calls_section_begin|>``, each ``<|tool_call_begin|>`` id
``<|tool_call_argument_begin|>`` arguments ``<|tool_call_end|>``, where the
id is ``functions.NAME:INDEX``. The function is the id's ``NAME``, the
call keeps the model's id (Kimi's template reads tool results by it), and
the arguments are kept as written; a call needs its closing tag. Streamed
as DeepSeek's.

Call ids are ``chatcmpl-tool-`` and 32 hex digits, as vLLM makes them
(Mistral's and Kimi's aside).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string
import uuid
from typing import Any, Literal, NamedTuple, get_args

ToolCallParser = Literal[
    "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "deepseek_v31", "glm45", "kimi_k2"
]  # fmt: skip
PARSERS: tuple[str, ...] = get_args(ToolCallParser)
DEEPSEEK = ("deepseek_v3", "deepseek_v31")
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_FENCE = "\n```json\n"
GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
KIMI_CALLS = "<|tool_calls_section_begin|>"
KIMI_CALL, KIMI_CALL_END, KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
TYPED = ("qwen3_coder", "glm45")  # the parsers that read values by the parameter types the request declares
CLOSED_ONLY = ("deepseek_v3", "deepseek_v31", "glm45", "kimi_k2")  # a call needs its closing tag
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
START, END = "<tool_call>", "</tool_call>"
FUNCTION = "<function="  # qwen3_coder: a call's own opening
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()
# The parsers whose calls are blocks between tags: (a call's opening tag, its closing tag, a tag opening all the
# calls before the first call's own, or "").
BLOCK_TAGS = {
    "hermes": (START, END, ""), "qwen3_coder": (START, END, ""), "glm45": (START, END, ""),
    "deepseek_v3": (DS_CALL, DS_CALL_END, DS_CALLS), "deepseek_v31": (DS_CALL, DS_CALL_END, DS_CALLS),
    "kimi_k2": (KIMI_CALL, KIMI_CALL_END, KIMI_CALLS),
}  # fmt: skip
_KIMI_ID = re.compile(r"[^<]+:\d+")
_GLM_NAME = re.compile(r"[\w.:/-]+")  # a function's name (a runaway "[[[" or prose is no call)
_FUNCTIONS = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_PARAMETERS = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

ToolTypes = dict[str, dict[str, str]]
"""Per function name, per parameter name, the type its JSON schema declares (lowercased; "" for none)."""


class Extracted(NamedTuple):
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI's message.tool_calls entries; empty: no call was made


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments_text(arguments: Any) -> str:
    """Parsed arguments as JSON text: non-ASCII kept, as vLLM writes them -- but escaped where a string holds a
    lone surrogate (from an escape the model wrote), which UTF-8, and so the answer, cannot carry. Raises
    ValueError for arguments nested too deeply to write (read back at the edge of the reader's depth: writing
    them inside the call takes a level more)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except RecursionError:
        raise ValueError("the arguments nest too deeply to write as JSON") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(arguments)
    return text


def _call(text: str) -> dict[str, Any] | None:
    """One block's text as an OpenAI tool call, or None if it is not ``{"name": str, "arguments": ...}``."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: a model stuck writing "[" a thousand times
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or "arguments" not in parsed:
        return None  # vLLM's parser needs both keys too
    return _as_call(parsed["name"], parsed["arguments"])


def _as_call(name: str, arguments: Any) -> dict[str, Any] | None:
    """An OpenAI tool call; ``arguments`` re-serialised as JSON text (see :func:`arguments_text`). None when they
    nest too deeply to write back: no call (a value read at the edge of the JSON reader's depth)."""
    try:
        return named_call(name, arguments_text(arguments))
    except ValueError:
        return None


def extract(text: str, parser: str = "hermes", tool_types: ToolTypes | None = None) -> Extracted:
    """A whole answer's content and tool calls, by ``parser`` (see the module docstring); ``tool_types``: the
    request's parameter types, which ``qwen3_coder`` reads its values by."""
    if parser == "llama3_json":
        return _extract_json(text)
    if parser == "mistral":
        return _extract_mistral(text)
    if parser == "pythonic":
        return _extract_pythonic(text)
    start, end, opener = BLOCK_TAGS.get(parser, BLOCK_TAGS["hermes"])
    if start not in text:
        if parser == "qwen3_coder" and FUNCTION in text:  # calls the model wrote without their <tool_call> blocks
            bare = _xml_calls(text, tool_types or {})
            if bare:
                return Extracted(text[: text.find(FUNCTION)] or None, bare)
        return Extracted(text, [])
    calls: list[dict[str, Any]] = []
    for body, closed in _bodies(text, start, end):
        found = _block_calls(body, parser, tool_types, closed=closed)
        if found is None:
            return Extracted(text, [])
        calls += found
    if not calls:
        return Extracted(text, [])
    first = text.find(start)
    opened = text.find(opener) if opener else -1
    content = text[: opened if 0 <= opened < first else first]
    return Extracted(content or None, calls)


def _bodies(text: str, start: str, end: str) -> list[tuple[str, bool]]:
    """The text of every ``start`` ... ``end`` block in ``text`` and whether it was closed (the last one may run
    to the end of the text)."""
    bodies = []
    at = text.find(start)
    while at >= 0:
        at += len(start)
        close = text.find(end, at)
        if close < 0:
            bodies.append((text[at:], False))
            break
        bodies.append((text[at:close], True))
        at = text.find(start, close + len(end))
    return bodies


def _block_calls(
    body: str, parser: str, tool_types: ToolTypes | None, *, closed: bool = True
) -> list[dict[str, Any]] | None:
    """The calls in one block's text (between a parser's call tags), or None when it holds none that reads. A
    block the end of the answer cut off is read only where what it holds shows whether it is whole (``hermes``'s
    JSON; ``qwen3_coder``'s, as vLLM reads it): the formats whose arguments are kept as written or come in pairs
    (DeepSeek's, GLM's, Kimi's) need their closing tag, as vLLM's parsers do."""
    if not closed and parser in CLOSED_ONLY:
        return None
    if parser == "qwen3_coder":  # a block with no function in it is passed over, as vLLM passes it
        return _xml_calls(body, tool_types or {}) if FUNCTION in body else []
    if parser == "glm45":
        call = _glm_call(body, tool_types or {})
    elif parser == "kimi_k2":
        call = _kimi_call(body)
    else:
        call = _deepseek_call(body) if parser in DEEPSEEK else _call(body)
    return None if call is None else [call]


def _glm_call(body: str, tool_types: ToolTypes) -> dict[str, Any] | None:
    """One GLM-4.5 call: the name, then ``<arg_key>`` / ``<arg_value>`` pairs, each value read unless its parameter
    is declared a string."""
    cut = min((at for at in (body.find("\n"), body.find(GLM_KEY)) if at >= 0), default=len(body))
    name = body[:cut].strip()
    if not _GLM_NAME.fullmatch(name):
        return None
    types = tool_types.get(name, {})
    arguments: dict[str, Any] = {}
    for key, value in _glm_pairs(body[cut:]):
        key = key.strip()  # a string is kept as written (a file's text keeps its last newline); the rest is read
        arguments[key] = value if types.get(key) == "string" else _decoded(value.strip())
    return _as_call(name, arguments)


def _glm_pairs(text: str) -> list[tuple[str, str]]:
    """``<arg_key>K</arg_key>`` ``<arg_value>V</arg_value>`` pairs in order, whitespace between the two tags;
    read up to the first that is not whole (one pass: a runaway answer costs its length, not its square)."""
    pairs = []
    at = text.find(GLM_KEY)
    while at >= 0:
        key_end = text.find(GLM_KEY_END, at)
        if key_end < 0:
            break
        value_at = key_end + len(GLM_KEY_END)
        while value_at < len(text) and text[value_at].isspace():
            value_at += 1
        if not text.startswith(GLM_VALUE, value_at):
            break
        value_end = text.find(GLM_VALUE_END, value_at)
        if value_end < 0:
            break
        pairs.append((text[at + len(GLM_KEY) : key_end], text[value_at + len(GLM_VALUE) : value_end]))
        at = text.find(GLM_KEY, value_end)
    return pairs


def _kimi_call(body: str) -> dict[str, Any] | None:
    """One Kimi K2 call: ``functions.NAME:INDEX``, the argument tag, the arguments (kept as written); the call keeps
    the model's id."""
    ident, sep, arguments = body.partition(KIMI_ARGS)
    ident, arguments = ident.strip(), arguments.strip()
    if not sep or not arguments or not _KIMI_ID.fullmatch(ident):
        return None
    name = ident.rsplit(":", 1)[0].split(".")[-1].strip()
    return named_call(name, arguments, ident) if name else None


def _deepseek_call(body: str) -> dict[str, Any] | None:
    """One DeepSeek call: V3's ``type<｜tool▁sep｜>name`` and fenced JSON, or V3.1's ``name<｜tool▁sep｜>arguments``
    (the arguments kept as written)."""
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    name, fence, arguments = rest.partition(DS_FENCE)
    if fence:  # V3: the type before the separator, the name and the fenced arguments after it
        arguments = arguments.rstrip().removesuffix("```").rstrip()
    elif head.strip() == "function" and not rest.lstrip().startswith(("{", "[")):
        return None  # V3 cut off before its fenced arguments (not V3.1's call of a function named "function")
    else:
        name, arguments = head, rest.strip()
    name = name.strip()
    if not name or "\n" in name or not arguments:  # a call writes its arguments, "{}" for none
        return None
    return named_call(name, arguments)


def _xml_calls(body: str, tool_types: ToolTypes) -> list[dict[str, Any]] | None:
    """qwen3_coder: every ``<function=NAME>`` in a block, with its ``<parameter=NAME>`` values read by type."""
    calls = []
    for closed, open_ in _FUNCTIONS.findall(body):
        function = closed or open_
        name, bracket, rest = function.partition(">")
        name = name.strip()
        if not bracket or not name:
            return None
        types = tool_types.get(name, {})
        arguments: dict[str, Any] = {}
        for parameter in _PARAMETERS.findall(rest):
            key, bracket, value = parameter.partition(">")
            if not bracket:
                return None
            key = key.strip()
            arguments[key] = _typed(value.removeprefix("\n").removesuffix("\n"), types.get(key, "string"))
        call = _as_call(name, arguments)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _typed(value: str, kind: str) -> Any:
    """A qwen3_coder parameter's raw text read as its declared type (see the module docstring)."""
    if value.lower() == "null":
        return None
    if kind in ("", "string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):  # JSON has no inf or nan
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    return _decoded(value)


def _decoded(value: str) -> Any:
    """A raw value read as JSON, else as a Python literal, else kept as text (what JSON cannot carry -- NaN, a set,
    bytes -- stays text too)."""
    for read in (json.loads, ast.literal_eval):
        try:
            parsed = read(value)
            json.dumps(parsed, allow_nan=False)  # what JSON cannot carry (NaN, a set, bytes) stays text
            return parsed
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
    return value


def _extract_json(text: str) -> Extracted:
    """llama3_json: an answer that starts with ``{`` or ``<|python_tag|>`` (as vLLM reads it, and as a stream
    decides) is calls: every top-level JSON object in it is one, and any that is not leaves it all content."""
    if not text.startswith(("{", PYTHON_TAG)):
        return Extracted(text, [])
    calls: list[dict[str, Any]] = []
    end = -1
    for start in range(len(text)):
        if text[start] != "{" or start <= end:
            continue
        try:
            parsed, length = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            return Extracted(text, [])
        end = length - 1
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return Extracted(text, [])
        if "arguments" not in parsed and "parameters" not in parsed:  # vLLM's parser needs one of them
            return Extracted(text, [])
        call = _as_call(parsed["name"], parsed.get("arguments", parsed.get("parameters")))
        if call is None:
            return Extracted(text, [])
        calls.append(call)
    return Extracted(None, calls) if calls else Extracted(text, [])


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Mistral's templates accept a call id of 9 letters and digits only."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def _extract_mistral(text: str) -> Extracted:
    """mistral: the calls after ``[TOOL_CALLS]`` (one JSON array, or ``name{...}`` per token), the text before it
    the content; an array that does not parse leaves it all content."""
    if MISTRAL_CALLS not in text:
        return Extracted(text, [])
    content, *raw = text.split(MISTRAL_CALLS)
    calls: list[dict[str, Any]] = []
    first = raw[0].strip()
    if first.startswith("["):  # v0.3: one array of {"name", "arguments"}
        try:
            parsed, _ = _DECODER.raw_decode(first)
        except (ValueError, RecursionError):
            return Extracted(text, [])
        if not isinstance(parsed, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                   for c in parsed):  # fmt: skip
            return Extracted(text, [])
        try:
            calls = [named_call(c["name"], arguments_text(c.get("arguments", {})), mistral_call_id()) for c in parsed]
        except ValueError:  # arguments JSON cannot carry (see arguments_text)
            return Extracted(text, [])
    else:  # v11+: [TOOL_CALLS]name{...} per call, the arguments kept as written
        for segment in raw:
            brace = segment.find("{")
            if brace < 0:
                continue
            name = segment[:brace].replace(MISTRAL_ARGS, "").strip()
            calls.append(named_call(name, segment[brace:].strip(), mistral_call_id()))
    return Extracted(content or None, calls) if calls else Extracted(text, [])


def _extract_pythonic(text: str) -> Extracted:
    """pythonic: an answer that is a Python list of calls with literal keyword arguments is calls; else content."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :]
        body = body[: -len(PYTHON_END)] if body.endswith(PYTHON_END) else body
        body = body.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return Extracted(text, [])
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Extracted(text, [])
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return Extracted(text, [])
    calls = []
    for element in tree.body.elts:
        if not (isinstance(element, ast.Call) and isinstance(element.func, ast.Name) and not element.args):
            return Extracted(text, [])
        arguments = {}
        for keyword in element.keywords:
            if keyword.arg is None:  # **kwargs
                return Extracted(text, [])
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return Extracted(text, [])
        try:
            call = _as_call(element.func.id, arguments)
        except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
            return Extracted(text, [])
        if call is None:
            return Extracted(text, [])
        calls.append(call)
    return Extracted(None, calls)


class Piece(NamedTuple):
    content: str  # text to stream as content ("" for none)
    tool_calls: list[dict[str, Any]]  # complete calls to stream, each with its "index"


class ToolCallStream:
    """One choice's streamed text, split into content and whole tool calls (see the module docstring)."""

    def __init__(self, parser: str = "hermes", tool_types: ToolTypes | None = None) -> None:
        self._parser = parser
        self._tool_types = tool_types
        self._held = ""  # text not yet sent: a possible start tag's prefix, or an open block (a JSON answer)
        self._in_block = False
        # a call's tags, and a tag opening all the calls before the first call's own ("" for none)
        self._start, self._end, self._opener = BLOCK_TAGS.get(parser, BLOCK_TAGS["hermes"])
        self._opened = False  # the opener was seen
        # the opener and what followed it, kept until a call reads (content if none does); pieces, joined when read
        self._section: list[str] = []
        self._as_text = False  # a block before any call was not one: the rest of the answer is content
        self._bare: str | None = None  # qwen3_coder: the answer from a <function=> written outside any block
        self._bare_ok = parser == "qwen3_coder"  # no <tool_call> yet: such calls are still read
        self._mistral_mode = ""  # mistral, after its first [TOOL_CALLS]: "array" (v0.3) or "v11" ("": not told yet)
        self._call_open = False  # mistral v11: the last call sent may get more of its arguments
        # llama3_json and pythonic: whether the answer is calls is told by its start
        self._decided = parser not in ("llama3_json", "pythonic")
        self.calls = 0  # tool calls sent so far (the next one's index)

    def push(self, text: str) -> Piece:
        """The next delta's text; returns what can go out now."""
        if not self._decided:
            return self._push_json(text)
        if self._parser in ("llama3_json", "pythonic"):  # decided: prose, streamed as it comes
            return Piece(text, [])
        if self._parser == "mistral":
            return self._push_mistral(text)
        buffer = self._held + text
        scanned = len(self._held) if self._in_block else 0  # a held block's text was searched for its end already
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self._bare is not None:  # calls outside blocks, read at the end -- unless a block opens after all
            bare = self._bare + buffer  # a tag may straddle the two: search from where it could begin
            at = bare.find(self._start, max(0, len(self._bare) - len(self._start) + 1))
            if at < 0:
                self._bare, self._held = bare, ""
                return Piece("", [])
            self._bare = None  # the plain answer then reads the blocks only, the text before the first as content
            self._out(content, bare[:at])
            buffer = bare[at:]
        opener = self._opener
        while buffer:
            if self._as_text:
                content.append(buffer)
                buffer = ""
                break
            if self._in_block:
                end = buffer.find(self._end, max(0, scanned - len(self._end) + 1))  # linear in a long block
                scanned = 0
                if end < 0:
                    break
                self._finish_block(buffer[:end], content, calls)
                buffer = buffer[end + len(self._end) :]
                continue
            start = buffer.find(self._start)
            if opener and not self._opened:
                at = buffer.find(opener)
                if at >= 0 and (start < 0 or at < start):
                    self._out(content, buffer[:at])
                    self._opened, self._section = True, [opener]
                    buffer = buffer[at + len(opener) :]
                    continue
            if start >= 0:
                self._out(content, buffer[:start])
                buffer = buffer[start + len(self._start) :]
                self._in_block, self._bare_ok = True, False
                continue
            keep = _partial_tag(buffer, self._start)
            if opener and not self._opened:
                keep = max(keep, _partial_tag(buffer, opener))
            if self._bare_ok and not self.calls and not self._opened:
                at = buffer.find(FUNCTION)
                if at >= 0:  # held from here: calls if no block opens before the end (vLLM's back-off)
                    self._out(content, buffer[:at])
                    self._bare, buffer = buffer[at:], ""
                    break
                keep = max(keep, _partial_tag(buffer, FUNCTION))
            self._out(content, buffer[: len(buffer) - keep])
            buffer = buffer[len(buffer) - keep :]
            break
        self._held = buffer
        return Piece("".join(content), calls)

    def _push_json(self, text: str) -> Piece:
        """llama3_json / pythonic: hold the answer while its start may be a call's (``{`` or ``<|python_tag|>``;
        ``[`` or ``<|python_start|>``); stream it once it cannot be."""
        held = self._held + text
        starts = ("[", PYTHON_START) if self._parser == "pythonic" else ("{", PYTHON_TAG)
        tag = starts[1]
        stripped = held.lstrip() if self._parser == "pythonic" else held
        if stripped.startswith(starts):
            self._held, self._in_block = held, True  # calls, most likely: parsed whole at the end
            return Piece("", [])
        if (stripped and tag.startswith(stripped)) or (held and not stripped):
            self._held = held  # may still become the tag (or only whitespace so far)
            return Piece("", [])
        self._held, self._decided = "", bool(held)
        return Piece(held, [])

    def _push_mistral(self, text: str) -> Piece:
        """mistral: content until ``[TOOL_CALLS]`` (a possible start of it at the end held back one delta); after
        it, v11+ calls as they come (:meth:`_mistral_calls`), a v0.3 array held and parsed at the end."""
        if self._in_block:
            return self._mistral_calls(text)
        held = self._held + text
        at = held.find(MISTRAL_CALLS)
        if at < 0:
            keep = _partial_tag(held, MISTRAL_CALLS)
            self._held = held[len(held) - keep :]
            return Piece(held[: len(held) - keep], [])
        self._held, self._in_block, self._section = "", True, [MISTRAL_CALLS]
        return Piece(held[:at], self._mistral_calls(held[at + len(MISTRAL_CALLS) :]).tool_calls)

    def _mistral_calls(self, text: str) -> Piece:
        """Text after the first ``[TOOL_CALLS]``. What follows that tag tells the format, as the plain answer
        reads it: an array (v0.3) is held whole (one that does not close is all content, so no element can go
        out early); otherwise (v11+) each ``name{...}`` call goes out once its ``{`` arrives, the name first and
        then its arguments as they come -- trailing whitespace and a possible next tag held back, since the plain
        answer's arguments end where the next ``[TOOL_CALLS]`` begins, stripped. Until a call goes out the text
        is kept (``_section``): the plain answer is all content if none does."""
        if not self.calls:
            self._section.append(text)
        buffer = self._held + text
        if not self._mistral_mode:
            start = buffer.lstrip()
            if not start.startswith(MISTRAL_CALLS) and MISTRAL_CALLS.startswith(start):
                self._held = buffer  # only whitespace, or what may become the next tag: not told yet
                return Piece("", [])
            self._mistral_mode = "array" if start.startswith("[") and not start.startswith(MISTRAL_CALLS) else "v11"
        if self._mistral_mode == "array":
            self._held = ""  # all of it is in _section, read at the end
            return Piece("", [])
        calls: list[dict[str, Any]] = []
        scanned = 0 if self._call_open else len(self._held)  # a held name was searched for its end already
        while True:
            tag = buffer.find(MISTRAL_CALLS, max(0, scanned - len(MISTRAL_CALLS) + 1))
            segment = buffer if tag < 0 else buffer[:tag]
            if not self._call_open:
                brace = segment.find("{", scanned)
                scanned = 0
                if brace >= 0:  # the name is whole: the call goes out, its arguments follow
                    name = segment[:brace].replace(MISTRAL_ARGS, "").strip()
                    calls.append({"index": self.calls, **named_call(name, "", mistral_call_id())})
                    self.calls += 1
                    self._section, self._call_open, buffer = [], True, buffer[brace:]
                    continue
                if tag < 0:
                    self._held = buffer  # a name, not yet followed by its arguments
                    break
                buffer = buffer[tag + len(MISTRAL_CALLS) :]  # a segment with no arguments is no call
                continue
            if tag >= 0:  # the call ends where the next tag begins
                _add_arguments(calls, self.calls - 1, segment.rstrip())
                self._call_open, buffer = False, buffer[tag + len(MISTRAL_CALLS) :]
                continue
            ready = buffer[: len(buffer) - _partial_tag(buffer, MISTRAL_CALLS)].rstrip()
            _add_arguments(calls, self.calls - 1, ready)
            self._held = buffer[len(ready) :]
            break
        return Piece("", calls)

    def finish(self) -> Piece:
        """The answer ended: what is still held (an unclosed block is a call if it parses, else content)."""
        if self._parser == "mistral" and self._mistral_mode == "v11":
            return self._finish_mistral()
        if self._parser == "mistral" and self._in_block:  # an array, or not told: read whole, as the plain answer
            self._held, self._in_block = "".join(self._section), False
            self._section = []
        if self._parser in ("llama3_json", "mistral", "pythonic"):
            held, self._held, self._in_block = self._held, "", False
            return self._read_whole(held) if held else Piece("", [])
        held, self._held = self._held, ""
        if self._bare is not None:  # bare calls: the answer from the first <function=, read as the plain answer is
            held, self._bare = self._bare + held, None
            return self._read_whole(held)
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        if self._as_text:
            content.append(held)
        elif self._in_block:
            self._in_block = False
            self._finish_block(held, content, calls, closed=False)
        else:
            self._out(content, held)
        if not self.calls and self._section:  # calls opened but none read: their text is content after all
            content.insert(0, "".join(self._section))
        self._section = []
        return Piece("".join(content), calls)

    def _read_whole(self, text: str) -> Piece:
        """The held rest of an answer read as the plain answer reads it: its calls, or the text as content."""
        found = extract(text, self._parser, self._tool_types)
        return Piece(found.content or "", self._numbered(found.tool_calls))

    def _numbered(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``calls`` as deltas to send, each with its index among the answer's calls."""
        numbered = [{"index": index, **call} for index, call in enumerate(calls, self.calls)]
        self.calls += len(numbered)
        return numbered

    def _finish_mistral(self) -> Piece:
        """mistral v11 at the end: the rest of the open call's arguments, or all the text after the first tag as
        content if no call went out."""
        held, self._held, self._in_block = self._held, "", False
        calls: list[dict[str, Any]] = []
        if self._call_open:  # the last call's arguments run to the end of the answer
            self._call_open = False
            _add_arguments(calls, self.calls - 1, held.rstrip())
        section, self._section = "".join(self._section), []
        return Piece("" if self.calls else section, calls)

    def _out(self, content: list[str], text: str) -> None:
        """Text outside the blocks: content until the first call, and nothing after it, as the plain answer's
        content is its text before the first call (a block that is not a call still goes out as content). After
        an opener (DeepSeek's) and before a call, kept back in case no call reads."""
        if self.calls:
            return
        if self._opened:
            self._section.append(text)
        else:
            content.append(text)

    def _finish_block(self, body: str, content: list[str], calls: list[dict[str, Any]], *, closed: bool = True) -> None:
        self._in_block = False
        found = _block_calls(body, self._parser, self._tool_types, closed=closed)
        if found == [] and not self.calls:  # a block passed over: content only if no call follows
            self._opened = True
            self._section.append(self._start + body + (self._end if closed else ""))
            return
        if found is None:  # not a call: the text as the model wrote it (after what was kept back before it)
            content.append("".join(self._section) + self._start + body + (self._end if closed else ""))
            self._section = []
            # Before any call, a block that is not one makes the plain answer all content, whatever follows.
            self._as_text = not self.calls
            return
        self._section = []
        calls += self._numbered(found)


def _add_arguments(calls: list[dict[str, Any]], index: int, text: str) -> None:
    """Add ``text`` to the arguments of call ``index`` among the deltas ``calls`` to send: into its last entry when
    that is the call's (one entry per call in a chunk, as vLLM sends them), else as a delta of its own."""
    if not text:
        return
    if calls and calls[-1]["index"] == index:
        calls[-1]["function"]["arguments"] += text
    else:
        calls.append({"index": index, "function": {"arguments": text}})


def merged_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call deltas for one chunk with each call's entries made one (a later entry of the same index only adds
    arguments): a choice's last chunk joins what its stream sent with what its end released."""
    merged: list[dict[str, Any]] = []
    for call in calls:
        if merged and merged[-1]["index"] == call["index"]:
            _add_arguments(merged, call["index"], call["function"]["arguments"])
        else:
            merged.append({**call, "function": dict(call["function"])})
    return merged


def _partial_tag(text: str, tag: str = START) -> int:
    """How many characters at the end of ``text`` could begin ``tag`` (held until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def named_call(name: str, arguments: str, ident: str | None = None) -> dict[str, Any]:
    """An OpenAI tool call of ``name`` with ``arguments`` as they are (JSON text): a named ``tool_choice``'s, whose
    answer is the arguments as the model wrote them, and every parser's. ``ident``: the call's id (default
    :func:`call_id`'s)."""
    return {"id": ident or call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _is_required_item(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item


class NamedCallStream:
    """A named ``tool_choice``'s answer streamed as one call's arguments: the first delta with text carries the
    call's index, id, type and name, each later one more of the arguments (OpenAI's clients concatenate them)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls = 0

    def push(self, text: str) -> Piece:
        if not text:
            return Piece("", [])
        if self.calls == 0:
            self.calls = 1
            return Piece("", [{"index": 0, **named_call(self._name, text)}])
        return Piece("", [{"index": 0, "function": {"arguments": text}}])

    def finish(self) -> Piece:
        return Piece("", [])


class RequiredCallStream:
    """A ``"required"`` answer read call by call, streamed or whole: the array's text is held, and each element
    goes out as one whole call once its object closes. :attr:`complete` once the array has closed. What never
    became a call (an answer cut short) goes out as content at the end: all of the text if no call did, else
    what follows the last call. A plain answer is read the same way, so both show the same calls and text."""

    def __init__(self) -> None:
        self._text = ""
        self._at = 0  # where the next element (or the array's opening) starts in _text
        self._opened = False
        self._stuck = False  # the element at _at did not read: text is kept aside until a "}" could close it
        self._aside: list[str] = []
        self.complete = False
        self.calls = 0

    def push(self, text: str) -> Piece:
        if self._stuck and "}" not in text:  # an object ends at a "}": with none, it reads no better (linear)
            self._aside.append(text)
            return Piece("", [])
        self._text += "".join(self._aside) + text
        self._aside, self._stuck = [], False
        calls: list[dict[str, Any]] = []
        while not self.complete:
            rest = self._text[self._at :]
            stripped = rest.lstrip()
            skipped = len(rest) - len(stripped)
            if not self._opened:
                if not stripped.startswith("["):
                    break
                self._opened, self._at = True, self._at + skipped + 1
                continue
            if stripped.startswith(","):
                self._at += skipped + 1
                continue
            if stripped.startswith("]") and self.calls:
                self.complete, self._at = True, self._at + skipped + 1
                break
            if not stripped.startswith("{"):
                break
            try:
                item, end = _DECODER.raw_decode(stripped)
            except (ValueError, RecursionError):
                self._stuck = True
                break  # the element is not whole yet (or nests past what can be read)
            call = _as_call(item["name"], item["parameters"]) if _is_required_item(item) else None
            if call is None:
                self._stuck = True
                break  # not a call (or one whose arguments nest too deeply to write back)
            calls.append({"index": self.calls, **call})
            self.calls += 1
            self._at += skipped + end
        return Piece("", calls)

    def finish(self) -> Piece:
        """What is left once the answer ended: nothing after a closed array (but trailing text), else the text no
        call was made of."""
        self._text += "".join(self._aside)
        self._aside = []
        if not self.calls:
            return Piece(self._text, [])
        rest = self._text[self._at :]
        return Piece(rest.strip() if self.complete else rest.lstrip(", \n\r\t"), [])


def read_required(text: str) -> tuple[list[dict[str, Any]], str, bool]:
    """A whole ``"required"`` answer as (its calls, the text no call was made of, whether the array closed)."""
    stream = RequiredCallStream()
    calls = stream.push(text).tool_calls
    rest = stream.finish().content
    return [{k: v for k, v in call.items() if k != "index"} for call in calls], rest, stream.complete
