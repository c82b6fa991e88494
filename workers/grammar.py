"""A choice's place in its structured-output grammar (llguidance's matcher), and the mask it allows.

The grammar text comes compiled and checked from the front
(:mod:`kvstore.openai.structured`, which says what is served and why);
the worker builds one :class:`GrammarMatcher` per request on the
submitting thread and copies it per choice. The step loop asks each step
for the mask of allowed next tokens (a bool tensor as wide as the logits)
and advances it by the token drawn.
"""

from __future__ import annotations

from typing import Any

import llguidance
import torch

from kvstore.openai.structured import StructuredOutputError


class GrammarMatcher:
    """One choice's place in its grammar. Built on the submitting thread; used by the step loop alone."""

    __slots__ = ("_matcher", "_shifts", "_width")

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, *, matcher: Any = None) -> None:
        """Raises StructuredOutputError if ``grammar`` does not compile."""
        self._width = tokenizer.vocab_size
        self._shifts = torch.arange(8, dtype=torch.uint8)
        if matcher is None:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise StructuredOutputError(matcher.get_error().strip())
        self._matcher = matcher

    def copy(self) -> GrammarMatcher:
        """A matcher at the same place, for another choice of the same request."""
        clone = GrammarMatcher.__new__(GrammarMatcher)
        clone._width, clone._shifts, clone._matcher = self._width, self._shifts, self._matcher.deep_copy()
        return clone

    def allowed(self, width: int) -> torch.Tensor:
        """A bool mask of the next tokens the grammar allows, ``width`` long (ids past the tokenizer's: never)."""
        bits = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        mask = ((bits.unsqueeze(1) >> self._shifts) & 1).flatten().bool()
        if mask.numel() >= width:
            return mask[:width]
        return torch.cat([mask, torch.zeros(width - mask.numel(), dtype=torch.bool)])

    def consume(self, token: int) -> bool:
        """Advance by a drawn token; False if the grammar refused it (the matcher is then stopped for good)."""
        return bool(self._matcher.consume_token(token))

    @property
    def stopped(self) -> bool:
        """The grammar can take no more tokens (it is complete, or the matcher failed)."""
        return bool(self._matcher.is_stopped())

    @property
    def failed(self) -> bool:
        return bool(self._matcher.is_error())

    @property
    def error(self) -> str:
        """Why the matcher failed ("" while it has not): a token it refused, or a limit of its parser."""
        return str(self._matcher.get_error()).strip()
