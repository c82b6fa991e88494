"""Structured output: a JSON schema, regex or grammar as an llguidance grammar, and its per-choice matcher.

What a request asks for (``response_format`` of type ``json_object``,
``json_schema`` or ``structural_tag``; vLLM's ``structured_outputs``
``json`` / ``regex`` / ``grammar`` / ``json_object`` / ``structural_tag``,
or their older ``guided_*`` names) becomes one llguidance grammar text on
the front (:func:`json_schema_grammar`, :func:`regex_grammar`,
:func:`text_grammar`, :func:`structural_tag_grammar`), checked there against the
model's tokenizer (:func:`check_grammar`), so a bad schema is a 400 that
quotes the compiler. The text travels in ``SamplingParams.grammar``; the
worker builds a matcher per choice (``kvstore.workers.grammar``) when the
request is submitted (off the step loop: building one can take
milliseconds for a large schema) and, on every step, masks the tokens the
grammar does not allow next, then advances the matcher by the token drawn.

Why llguidance: it is one of vLLM's structured-output backends (``guidance``),
computes a mask over a 150k vocabulary in tens of microseconds, needs no
GPU, and takes JSON schema, regular expressions, Lark and GBNF grammars.

Invariants and failure modes:

- A choice's tokens are always a prefix of a string of the grammar: the
  mask allows nothing else, and when other constraints leave no allowed
  token the sampler falls back to the grammar's own (see ``usable`` in the
  sampler). A matcher that fails anyway (a token it refuses, or a limit of
  its parser met mid-answer) fails the request, as one the worker cannot
  serve, rather than end it on text outside the grammar.
- Once the matcher is *stopped* (the grammar can take nothing more), the
  choice ends with ``stop`` at once; while it is *accepting* but could go
  on (a number, trailing whitespace), EOS is one of the allowed tokens.
- The grammar's EOS is the tokenizer's EOS plus the model's other end
  tokens (``generation_config``): any of them may end an accepted output.
- A tokenizer that cannot be described to llguidance (the built-in byte
  model's, which has no EOS) refuses structured output with a clear error.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import llguidance

from kvstore.openai.tokenizer import HFTokenizer, Tokenizer

MAX_GRAMMAR_CHARS = 1 << 20
"""A schema, regex or grammar longer than this (as text) is refused before it is compiled."""


class StructuredOutputError(ValueError):
    """A constraint that cannot be served: its message says why (the compiler's own words where it has them)."""


_cache_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int | None, eos_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """``tokenizer`` as llguidance sees it, for logits ``vocab_size`` wide, ending on ``eos_ids``: built once per
    tokenizer, width and EOS set (about a second for a 150k vocabulary), then shared (it is thread-safe)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise StructuredOutputError(
            "structured output needs a model with a Hugging Face tokenizer (tokenizer.json); "
            "this model's byte tokenizer has no EOS token to end an output on"
        )
    ends = tuple(dict.fromkeys(eos_ids)) or tokenizer.eos_token_ids
    if not ends:
        raise StructuredOutputError("structured output needs an EOS token, and this model's tokenizer has none")
    width = max(vocab_size or 0, tokenizer.vocab_size)
    key = (width, ends)
    with _cache_lock:
        built = _tokenizers.setdefault(tokenizer, {})
        found = built.get(key)
        if found is None:
            try:
                found = llguidance.LLTokenizer(tokenizer.json_text(), n_vocab=width, eos_token=list(ends))
            except Exception as exc:  # the library's own error types: a tokenizer it cannot describe
                raise StructuredOutputError(
                    f"this model's tokenizer cannot be used for structured output: {exc}"
                ) from None
            built[key] = found
        return found


def json_schema_grammar(
    schema: Any, *, any_whitespace: bool = True, whitespace_pattern: str | None = None, closed_objects: bool = False
) -> str:
    """A JSON schema (a dict, or ``true``: any JSON value) as a grammar. ``any_whitespace`` False: compact JSON
    only (vLLM's ``disable_any_whitespace``); ``closed_objects``: objects that list properties and do not say
    otherwise take no others (vLLM's ``disable_additional_properties``)."""
    if schema is True:
        schema = {}
    if schema is False:
        raise StructuredOutputError("the schema false admits no value")
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    if closed_objects:
        schema = _closed(schema)
    options: dict[str, Any] = {"whitespace_flexible": any_whitespace}
    if whitespace_pattern is not None:
        options["whitespace_pattern"] = whitespace_pattern
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise StructuredOutputError(f"invalid JSON schema: {exc}") from None


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def text_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect) or a GBNF / EBNF one (llama.cpp's, as vLLM's ``grammar`` takes)."""
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise StructuredOutputError(str(exc)) from None


def read_json_text(text: str, what: str) -> Any:
    """JSON a request sent as text (vLLM takes a schema, and a structural tag, that way), read; StructuredOutputError
    naming ``what`` when it is longer than MAX_GRAMMAR_CHARS, or is not JSON."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(f"{what} is longer than {MAX_GRAMMAR_CHARS:,} characters")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise StructuredOutputError(f"{what} is not JSON (or nests too deeply)") from None


def check_json_size(value: Any, what: str) -> None:
    """StructuredOutputError naming ``what`` unless ``value`` written as JSON is at most MAX_GRAMMAR_CHARS."""
    try:
        size = len(json.dumps(value))
    except (ValueError, RecursionError):
        raise StructuredOutputError(f"{what} cannot be written as JSON (it nests too deeply)") from None
    if size > MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(f"{what} is longer than {MAX_GRAMMAR_CHARS:,} characters")


class Tag(NamedTuple):
    """One structure of a structural tag: free text may open it with ``begin`` (which starts with ``trigger``);
    then JSON following ``schema`` (a JSON schema) and ``end`` are forced."""

    trigger: str
    begin: str
    schema: dict[str, Any]
    end: str


def structural_tag_grammar(tags: Sequence[Tag], special_ids: Mapping[str, int]) -> str:
    """vLLM's structural tag as a grammar: any text, in which each tag's trigger must go on as one of the tags
    that start with it (the rest of its ``begin``, JSON of its schema, its ``end``), and then any text again.

    As llguidance's ``StructTag`` builds it, but with every string escaped as a Lark literal: a trigger is a
    lazy lexeme (text matched as soon as it appears), or, when it is one of the tokenizer's special tokens
    (``special_ids``: ``<|python_tag|>``), that token by id -- a model writes a special token as its id, which
    no text lexeme matches."""
    if not tags:
        raise StructuredOutputError("a structural tag needs at least one structure")
    lines = [
        "%llguidance {}",
        f"start: ({' | '.join(f'tag_{index}' for index in range(len(tags)))})* TAG_TEXT",
        "TAG_TEXT: /(.|\\n)*/",
    ]
    for index, tag in enumerate(tags):
        rest = tag.begin[len(tag.trigger) :]
        body = " ".join(part for part in (_literal(rest), "%json " + json.dumps(tag.schema), _literal(tag.end)) if part)
        token = special_ids.get(tag.trigger)
        if token is not None:
            lines.append(f"tag_{index}: TAG_TEXT <[{token}]> {body}")
        else:
            lines.append(f"tag_{index}_trigger[lazy]: TAG_TEXT {_literal(tag.trigger)}")
            lines.append(f"tag_{index}: tag_{index}_trigger {body}")
    try:
        return llguidance.grammar_from("lark", "\n".join(lines))
    except (ValueError, TypeError) as exc:  # UnicodeEncodeError (a lone surrogate) is a ValueError
        raise StructuredOutputError(str(exc)) from None


def _literal(text: str) -> str:
    """``text`` as a Lark string literal ("" for none: an empty literal matches nothing to write)."""
    return json.dumps(text, ensure_ascii=False) if text else ""


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """A tokenizer's special tokens, text -> id (none for the built-in byte tokenizer)."""
    return tokenizer.special_token_ids() if isinstance(tokenizer, HFTokenizer) else {}


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Raise StructuredOutputError unless ``grammar`` compiles for ``tokenizer``."""
    if len(grammar) > 4 * MAX_GRAMMAR_CHARS:
        raise StructuredOutputError(f"the compiled grammar is {len(grammar):,} characters; the limit is "
                                    f"{4 * MAX_GRAMMAR_CHARS:,}")  # fmt: skip
    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if message:
        raise StructuredOutputError(message.strip())


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema in it that lists ``properties`` or
    ``patternProperties`` and does not set it. Only subschemas are visited (``const`` and ``enum`` values,
    ``default`` and examples are left as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = [_closed(sub) for sub in out[key]] if isinstance(out[key], list) else _closed(out[key])
    # As vLLM closes them: an object schema that lists properties (a bare {"type": "object"} stays open).
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
