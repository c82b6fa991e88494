"""Picking each choice's next token from the model's logits, with vLLM's sampling semantics.

Per row (one choice that reached the end of its sequence this step), in
vLLM's order: tokens outside ``allowed_token_ids`` are masked, and those a
guided choice or a grammar (structured output) does not allow next; so is the last token of each ``bad_words``
sequence whose other tokens the output ends with (a one-token sequence always); ``logit_bias`` is added;
EOS and the stop token ids are masked while fewer than ``min_tokens`` tokens exist; the repetition
penalty (prompt and output tokens: divide a positive logit, multiply a
negative one) and the frequency and presence penalties (output tokens,
OpenAI's subtraction) apply; then temperature 0 takes the argmax, and any
other temperature scales, drops tokens under ``min_p`` x the best one's
probability, keeps the ``top_k`` best and the smallest set reaching
``top_p``, and draws from what is left.

Reproducibility: a seeded choice draws only from its own
``torch.Generator`` (seed + choice index), one draw per token, so its
output does not depend on what else shares the batch or which replica
serves it. Unseeded choices share the sampler's generator.

Logprobs are those of the raw model distribution (before any of the
above), as vLLM reports them by default.

Any valid request samples (the step loop must never fail on one):
a temperature under ``SAMPLING_EPS`` is greedy, as in vLLM (dividing by
1e-39 made every logit infinite); logits a penalty made infinite are the
only candidates, drawn among by their raw values; and when the constraints
leave no token at all (``min_tokens`` blocking the only allowed ones), the
row falls back to the raw logits of the allowed tokens (the grammar's or the
guided choice's first: a constrained output never leaves its constraint).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvstore.worker_api import SamplingParams, TokenLogprob
from kvstore.workers.grammar import GrammarMatcher


class SamplingDefaults(NamedTuple):
    """A model's defaults for the fields a request leaves unset (``generation_config.json``, or greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


GREEDY = SamplingDefaults(temperature=0.0)
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def eos_split(tokenizer_eos: Sequence[int], generation_eos: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """vLLM's EOS rule: the tokenizer's EOS ids always end a choice (as EOS: no stop reason); the other ids a
    model's ``generation_config`` lists (Llama 3's ``<|eot_id|>``, a Qwen's ``<|endoftext|>``) are added to
    each request's stop token ids, so ending on one reports it as ``stop_reason``. Returns (EOS, the others)."""
    primary = tuple(dict.fromkeys(tokenizer_eos))
    return primary, tuple(t for t in dict.fromkeys(generation_eos) if t not in primary)


class ChoiceSampling:
    """One choice's resolved parameters and the state penalties need. Owned by the step loop."""

    def __init__(
        self,
        params: SamplingParams,
        defaults: SamplingDefaults,
        *,
        index: int,
        prompt_ids: Sequence[int],
        eos_token_ids: Sequence[int],
        other_eos_ids: Sequence[int] = (),
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """``eos_token_ids``: the tokenizer's EOS, which ends a choice with no stop reason; ``other_eos_ids``: the
        other ids of the model's ``generation_config``, which vLLM makes stop token ids (unless ``ignore_eos``),
        so that ending on one names it as the stop reason (see :func:`eos_split`). ``grammar``: the choice's own
        matcher of ``params.grammar`` (structured output), required when that is set."""
        assert (grammar is None) == (params.grammar is None), "a grammar needs its matcher, and only then"

        def pick(value: float | int | None, default: float | int) -> float:
            return float(default if value is None else value)

        self.temperature = pick(params.temperature, defaults.temperature)
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        self.top_p = pick(params.top_p, defaults.top_p)
        top_k = int(pick(params.top_k, defaults.top_k))
        self.top_k = top_k if top_k > 0 else 0
        self.min_p = pick(params.min_p, defaults.min_p)
        self.repetition_penalty = pick(params.repetition_penalty, defaults.repetition_penalty)
        self.presence_penalty = params.presence_penalty
        self.frequency_penalty = params.frequency_penalty
        self.logprobs = params.logprobs
        self.min_tokens = params.min_tokens
        self.logit_bias = dict(params.logit_bias or {})
        self._allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long) if params.allowed_token_ids else None
        self._bad_words = params.bad_words_token_ids
        self._choices = params.choice_token_ids  # guided choice: the output is one of these sequences
        self._output: list[int] = []  # the output so far (kept only for a guided choice)
        self._step_allowed: list[int] | None = None  # what the guided choice lets this step draw
        self._grammar = grammar
        self._grammar_bias: torch.Tensor | None = None  # this step's grammar: 0 allowed, -inf not (vocab wide)
        # A reasoning model thinks first: the constraint waits until the output ends with these tokens (None: it
        # applies from the first token).
        self._waiting_for = params.constraint_after
        self._tail: deque[int] = deque(maxlen=len(params.constraint_after or ()))
        # The output's last tokens, as many as the longest bad word's prefix (none without bad words).
        self._recent: deque[int] = deque(maxlen=max((len(w) - 1 for w in self._bad_words), default=0))
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        others = () if params.ignore_eos else tuple(t for t in other_eos_ids if t not in params.stop_token_ids)
        self.stop_token_ids = (*params.stop_token_ids, *others)
        self._blocked = sorted({*self.eos_token_ids, *self.stop_token_ids})
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu").manual_seed((params.seed + index) % 2**63)
        self._prompt = frozenset(prompt_ids)
        self.output_counts: Counter[int] = Counter()
        self.num_output = 0

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: nothing here changes them."""
        return (
            self.temperature == 0.0
            and self.repetition_penalty == 1.0
            and not self.presence_penalty
            and not self.frequency_penalty
            and not self.logit_bias
            and self._allowed is None
            and self._choices is None
            and self._grammar is None
            and not self._bad_words
            and not (self._blocked and self.num_output < self.min_tokens)
        )

    def record(self, token_id: int) -> None:
        self.output_counts[token_id] += 1
        self.num_output += 1
        if self._recent.maxlen:
            self._recent.append(token_id)
        if self._waiting_for is not None:  # still thinking: nothing is constrained yet
            self._tail.append(token_id)
            if tuple(self._tail) == self._waiting_for:
                self._waiting_for = None  # the thinking ended: the constraint applies from the next token
            return
        if self._choices is not None:
            self._output.append(token_id)
        if self._grammar is not None:
            self._grammar.consume(token_id)  # a token it refuses stops it: the choice then ends (constraint_done)

    @property
    def grammar_error(self) -> str | None:
        """Why the grammar's matcher failed (a limit of its parser, met mid-answer), or None."""
        if self._grammar is None or not self._grammar.failed:
            return None
        return self._grammar.error or "the grammar refused a token it allowed"

    def constraint_done(self) -> bool:
        """The output so far (its tokens recorded) must end here: a guided choice's is one of its sequences and no
        longer one goes on from it, or the grammar can take no more tokens."""
        if self._waiting_for is not None:
            return False
        if self._grammar is not None:
            return self._grammar.stopped
        if self._choices is None:
            return False
        n, out = len(self._output), tuple(self._output)
        return out in self._choices and not any(len(c) > n and c[:n] == out for c in self._choices)

    def _guided(self) -> list[int]:
        """The tokens a guided choice may draw next: each sequence's next token where the output is its prefix,
        and EOS once the output is a whole sequence."""
        out, n = tuple(self._output), len(self._output)
        allowed = {c[n] for c in self._choices or () if len(c) > n and c[:n] == out}
        if out in (self._choices or ()):
            allowed.update(self.eos_token_ids)
        return sorted(allowed)

    def process(self, row: torch.Tensor) -> None:
        """Allowed tokens, bias, min_tokens and penalties, in place on one row of float32 logits."""
        if self._allowed is not None:
            kept = row[self._allowed]
            row.fill_(float("-inf"))
            row[self._allowed] = kept
        constrained = self._waiting_for is None
        if self._choices is not None and constrained:
            self._step_allowed = self._guided()
            if self._step_allowed:  # else the choice is past every sequence (max_tokens cuts it short first)
                guided = torch.tensor(self._step_allowed, dtype=torch.long)
                kept = row[guided]
                row.fill_(float("-inf"))
                row[guided] = kept
        if self._grammar is not None and constrained:
            self._grammar_bias = self._grammar.bias(row.numel())
            row.add_(self._grammar_bias)
        if self._bad_words:
            banned = self._banned()
            if banned:
                kept = row[banned]
                row[banned] = float("-inf")
                if not bool(torch.isfinite(row).any()):  # every allowed token is banned: the ban gives way
                    row[banned] = kept
        if self.logit_bias:
            ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
            row.index_add_(0, ids, torch.tensor(list(self.logit_bias.values()), dtype=row.dtype))
        if self._blocked and self.num_output < self.min_tokens:
            row[self._blocked] = float("-inf")
        if self.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(self._prompt | self.output_counts.keys()), dtype=torch.long)
            values = row[seen]
            penalty = self.repetition_penalty
            row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (self.presence_penalty or self.frequency_penalty) and self.output_counts:
            ids = torch.tensor(list(self.output_counts), dtype=torch.long)
            counts = torch.tensor(list(self.output_counts.values()), dtype=row.dtype)
            row[ids] -= self.frequency_penalty * counts + self.presence_penalty

    def _banned(self) -> list[int]:
        """The last token of every bad word whose other tokens end the output so far (vLLM's rule: the output
        only, not the prompt)."""
        recent = list(self._recent)
        banned = []
        for word in self._bad_words:
            prefix = len(word) - 1
            if prefix <= len(recent) and (prefix == 0 or recent[-prefix:] == list(word[:-1])):
                banned.append(word[-1])
        return banned

    def usable(self, row: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """A processed row something can be drawn from (see the module docstring): infinite logits alone when
        there are any, else the row, else -- its constraints leave nothing -- the raw logits of the allowed
        tokens."""
        row = torch.nan_to_num(row, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        infinite = torch.isposinf(row)
        if bool(infinite.any()):
            return torch.where(infinite, raw, torch.full_like(raw, float("-inf")))
        if bool(torch.isfinite(row).any()):
            return row
        # The grammar's or the guided choice's next tokens always, whatever else ruled them out; else
        # allowed_token_ids.
        fallback = torch.full_like(raw, float("-inf"))
        grammar_allows = None if self._grammar_bias is None else self._grammar_bias == 0
        if grammar_allows is not None and bool(grammar_allows.any()):
            return torch.where(grammar_allows, raw, fallback)
        allowed = self._step_allowed if self._choices is not None and self._step_allowed else self._allowed
        if allowed is None:
            return raw.clone()
        fallback[allowed] = raw[allowed]
        return fallback

    def draw(self, row: torch.Tensor, shared: torch.Generator) -> int:
        """Temperature, min_p, top_k and top_p on processed logits (see :meth:`usable`), then one draw."""
        if self.temperature == 0.0:
            return int(row.argmax())
        row = row / self.temperature
        overflow = torch.isposinf(row)  # finite logits too large for the temperature: the largest ones alone
        if bool(overflow.any()):
            row = torch.where(overflow, 0.0, float("-inf"))
        if self.min_p > 0.0:
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < self.min_p * probs.max(), float("-inf"))
        if self.top_k and self.top_k < row.numel():
            kth = torch.topk(row, self.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if self.top_p < 1.0:
            row = _nucleus(row, self.top_p)
        return _draw(torch.softmax(row, dim=-1), self.generator or shared)


TOP_P_CANDIDATES = 1024
"""top_p looks for its nucleus among this many most likely tokens first; only a distribution too flat for them to
reach top_p (rare for a trained model) sorts the whole vocabulary. On the CPU a full sort of a 152k-token row took
10.7 ms, the top 1,024 about 0.5."""


def _nucleus(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """``row`` keeping only the smallest set of most likely tokens whose probabilities reach ``top_p`` (a token
    stays while the tokens more likely than it hold less than ``top_p`` of the mass; the best one always stays).
    The sums are in float64, against the row's own float32 total (which may be a little over or under 1 at a
    large vocabulary), so the set is the one an exact sum keeps."""
    probs = torch.softmax(row, dim=-1)
    bound = top_p * float(probs.sum(dtype=torch.float64))
    k = min(TOP_P_CANDIDATES, row.numel())
    values, ids = torch.topk(probs, k)
    cumulative = values.double().cumsum(dim=0)
    if k < row.numel() and float(cumulative[-1]) < bound:  # too flat for the candidates: the whole row
        values, ids = torch.sort(probs, descending=True)
        cumulative = values.double().cumsum(dim=0)
    keep = int(torch.searchsorted(cumulative, torch.tensor([bound], dtype=torch.float64))) + 1
    kept = ids[: min(keep, ids.numel())]
    out = torch.full_like(row, float("-inf"))
    out[kept] = row[kept]
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``probs`` (non-negative, summing to about 1) with one uniform number from
    ``generator``: the first token whose cumulative probability passes it. A token of probability 0 is never
    drawn. On the CPU this takes about 0.14 ms for a 152k-token row, where ``torch.multinomial`` took 2.5."""
    cumulative = probs.cumsum(dim=0)
    u = torch.rand(1, generator=generator, dtype=cumulative.dtype) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, u, right=True))
    if index >= cumulative.numel():  # u rounded up to the total: the last token that can be drawn
        index = int(torch.nonzero(probs > 0)[-1])
    return index


class Sampler:
    """Samples one token per row. Not thread-safe: the worker's step loop owns it."""

    def __init__(self, seed: int | None = None) -> None:
        self._shared = torch.Generator(device="cpu")
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[ChoiceSampling]) -> list[tuple[int, TokenLogprob | None]]:
        """``logits`` is float ``[len(rows), vocab]``; returns each row's token and, when asked, its logprobs."""
        assert logits.shape[0] == len(rows), "one row of logits per choice"
        if not rows:
            return []
        logits = logits.float().cpu()
        raw = torch.log_softmax(logits, dim=-1) if any(r.logprobs is not None for r in rows) else None
        if all(r.plain_greedy for r in rows):
            tokens = [int(t) for t in logits.argmax(dim=-1).tolist()]
        else:
            tokens = []
            for index, choice in enumerate(rows):
                if choice.plain_greedy:
                    tokens.append(int(logits[index].argmax()))
                    continue
                row = logits[index].clone()
                choice.process(row)
                tokens.append(choice.draw(choice.usable(row, logits[index]), self._shared))
        out: list[tuple[int, TokenLogprob | None]] = []
        for index, (choice, token) in enumerate(zip(rows, tokens, strict=True)):
            choice.record(token)
            logprob = None
            if raw is not None and choice.logprobs is not None:
                logprob = _logprob(raw[index], token, choice.logprobs)
            out.append((token, logprob))
        return out


def _logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        values, ids = torch.topk(row, min(top, row.numel()))
        alternatives = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprob(token, float(row[token]), alternatives)
