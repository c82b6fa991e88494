"""A choice's place in its structured-output grammar (llguidance's matcher), and the mask it allows.

The grammar text comes compiled and checked from the front
(:mod:`kvstore.openai.structured`, which says what is served and why);
the worker builds one :class:`GrammarMatcher` per request on the
submitting thread and copies it per choice. The step loop asks each step
for the allowed next tokens as a bias to add to the logits (0 allowed, -inf
not) and advances it by the token drawn.
"""

from __future__ import annotations

import llguidance
import torch

from kvstore.openai.structured import StructuredOutputError

# Row b: the bias of the 8 tokens one bitmask byte of value b covers (bit i set: token i allowed, 0.0; else -inf).
_BYTE_BIAS = torch.tensor([[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)])


class GrammarMatcher:
    """One choice's place in its grammar. Built on the submitting thread; used by the step loop alone."""

    __slots__ = ("_matcher",)

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        """Raises StructuredOutputError if ``grammar`` does not compile."""
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise StructuredOutputError(self._matcher.get_error().strip())

    def copy(self) -> GrammarMatcher:
        """A matcher at the same place, for another choice of the same request."""
        clone = GrammarMatcher.__new__(GrammarMatcher)
        clone._matcher = self._matcher.deep_copy()
        return clone

    def bias(self, width: int) -> torch.Tensor:
        """0.0 for each next token the grammar allows and -inf for the others, ``width`` floats (ids past the
        tokenizer's: -inf), to add to a row of logits. Each byte of llguidance's bitmask (8 tokens, lowest bit
        first) is looked up in a 256-row table: about 40 us for a 150k vocabulary, where unpacking the bits
        and a boolean ``masked_fill`` took 400."""
        packed = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8).int()
        bias = _BYTE_BIAS.index_select(0, packed).view(-1)
        if bias.numel() >= width:
            return bias[:width]
        return torch.cat([bias, torch.full((width - bias.numel(),), float("-inf"))])

    def allowed(self, width: int) -> torch.Tensor:
        """A bool mask of the next tokens the grammar allows, ``width`` long (ids past the tokenizer's: never)."""
        return self.bias(width) == 0

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
