"""A chat answer's reasoning split from its content, as vLLM's ``--reasoning-parser`` splits it.

Reasoning models write their thinking first, between ``<think>`` and
``</think>``; many chat templates put the ``<think>`` into the prompt, so
the answer holds only the closing tag. With a reasoning parser configured
(``router.reasoning_parser``), a chat answer is split there:

- everything before ``</think>`` is ``reasoning`` (a ``<think>`` the model
  wrote itself is dropped), everything after it the ``content`` (None when
  empty);
- no ``</think>``: the answer is all reasoning (it was cut off while
  thinking; content None) -- both for ``deepseek_r1`` and ``qwen3``, except
  that a ``qwen3`` chat sent with ``chat_template_kwargs.enable_thinking:
  false`` is not split at all (its template closes the thinking in the
  prompt);
- streamed (:class:`ReasoningStream`), each delta's text goes to reasoning
  until the closing tag and to content after it; a possible tag cut across
  two deltas is held back one delta.

The message carries the reasoning as ``reasoning`` (vLLM's field now) and as
``reasoning_content`` (its earlier name, which many clients still read). A
tool-call parser, if one is configured too, reads the content only, as in
vLLM.
"""

from __future__ import annotations

from typing import Any, NamedTuple

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


NO_THINKING = "qwen3-no-thinking"  # a qwen3 chat with its thinking switched off


def parser_for(parser: str | None, chat_template_kwargs: dict[str, Any] | None) -> str | None:
    """The parser a chat request's answer goes through: None without one; :data:`NO_THINKING` for a ``qwen3``
    chat whose thinking is switched off (``enable_thinking: false``): streamed as content, and a plain answer
    with no ``</think>`` is all content (one with it is still split, as vLLM's parser does)."""
    if parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking", True) is False:
        return NO_THINKING
    return parser


def split(text: str, parser: str | None = None) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content) (see the module docstring)."""
    before, tag, after = text.partition(START)
    text = after if tag else before
    reasoning, tag, content = text.partition(END)
    if not tag:
        return (None, text) if parser == NO_THINKING else (text, None)
    return reasoning, content or None


class Piece(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream:
    """One choice's streamed text, split into reasoning and content (see the module docstring)."""

    def __init__(self) -> None:
        self._held = ""  # a possible tag's prefix at the end of the last delta
        self._started = False  # some reasoning text went out (a <think> after that is text, not the tag)
        self._ended = False  # </think> seen: the rest is content

    def push(self, text: str) -> Piece:
        if self._ended:
            return Piece("", text)
        buffer = self._held + text
        self._held = ""
        if not self._started:
            stripped = buffer.lstrip()
            if stripped.startswith(START):
                buffer = stripped[len(START) :]
            elif START.startswith(stripped):  # nothing but whitespace, or what may still become <think>
                self._held = buffer
                return Piece("", "")
        reasoning, tag, content = buffer.partition(END)
        if tag:
            self._ended = True
            self._started = True
            return Piece(reasoning, content)
        keep = _partial(buffer, END)
        out = buffer[: len(buffer) - keep]
        self._held = buffer[len(buffer) - keep :]
        self._started = self._started or bool(out)
        return Piece(out, "")

    def finish(self) -> Piece:
        """The answer ended: what was held back is reasoning (no closing tag came) or content (after it)."""
        held, self._held = self._held, ""
        return Piece("", held) if self._ended else Piece(held, "")


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
