"""From sampled tokens to a request's stream: finish rules, text, and the per-step chunk.

A request of ``n`` choices is a :class:`RequestGroup` of ``n`` scheduler
states (:class:`~kvstore.workers.scheduler.RequestState`), each carrying a
:class:`ChoiceRecord`: its sampling state and its detokenizer. After each
model step the worker hands every sampled token to :meth:`ChoiceRecord.accept`,
which decides, as vLLM does, whether the choice ends:

- the tokenizer's EOS id (unless ``ignore_eos``) ends it with ``stop`` and
  no stop reason; one of ``stop_token_ids`` -- the generation config's
  other EOS ids among them, as vLLM adds them -- with ``stop`` and the id;
  the token stays in ``token_ids`` but, as vLLM's v1 detokenizer does, is left out of the text unless
  ``include_stop_str_in_output`` (then it is rendered like any other,
  specials subject to ``skip_special_tokens``);
- a stop string ends it with ``stop``, the text cut before it (after it
  with ``include_stop_str_in_output``);
- none of these count before ``min_tokens`` tokens exist (the sampler
  masks EOS and stop ids until then), and stop strings must end in the
  text of a later token, as vLLM's detokenizer searches them;
- ``max_tokens`` tokens end it with ``length``.

Prompt logprobs (``SamplingParams.prompt_logprobs``) belong to the group:
each choice that computes its prompt scores it (:meth:`RequestGroup.score_prompt`),
since until the scores are whole every choice is admitted without a
prefix hit; a choice's first delta with a token carries them, so they are
always whole by then.

Not thread-safe: the step loop owns every record.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.events import MEDIA, Medium
from kvstore.openai.detokenizer import IncrementalDetokenizer
from kvstore.openai.tokenizer import Tokenizer
from kvstore.worker_api import (
    ChoiceDelta,
    FinishReason,
    PromptLogprobs,
    RequestStats,
    SamplingParams,
    StreamChunk,
    TokenLogprob,
)
from kvstore.workers.grammar import GrammarMatcher
from kvstore.workers.sampler import ChoiceSampling, SamplingDefaults
from kvstore.workers.scheduler import RequestState
from kvstore.workers.stream import RequestStream


class ChoiceRecord:
    """One choice's sampling and text (``RequestState.output``)."""

    def __init__(
        self,
        group: RequestGroup,
        index: int,
        params: SamplingParams,
        defaults: SamplingDefaults,
        tokenizer: Tokenizer,
        eos_token_ids: Sequence[int],
        prompt_ids: Sequence[int],
        other_eos_ids: Sequence[int] = (),
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """``grammar``: this choice's own matcher of ``params.grammar`` (``request_table.new_group`` builds it)."""
        self.group = group
        self.index = index
        self.sampling = ChoiceSampling(
            params, defaults, index=index, prompt_ids=prompt_ids, eos_token_ids=eos_token_ids,
            other_eos_ids=other_eos_ids, grammar=grammar,
        )  # fmt: skip
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            context=prompt_ids,
        )
        self.want_logprobs = params.logprobs is not None
        self.want_prompt_logprobs = params.prompt_logprobs is not None
        self.text_of_stop_token = params.include_stop_str_in_output

    @property
    def failure(self) -> str | None:
        """Why this choice cannot go on (its grammar's matcher failed), or None."""
        return self.sampling.grammar_error

    def accept(self, state: RequestState, token: int, logprob: TokenLogprob | None) -> ChoiceDelta:
        """Record a sampled token; returns what to stream, with the finish reason once the choice is done."""
        state.output_token_ids.append(token)
        count = len(state.output_token_ids)
        counts = count >= self.sampling.min_tokens
        if counts and token in self.sampling.eos_token_ids:
            state.finish(FinishReason.STOP)
        elif counts and token in self.sampling.stop_token_ids:
            state.finish(FinishReason.STOP, token)
        if state.is_finished and not self.text_of_stop_token:  # ended by this token: none of its text
            text, stop = "", None
        else:
            # As vLLM's detokenizer: stop strings only in text past the first min_tokens tokens' (that token's own
            # text is not searched, though EOS and stop ids count from it on).
            search = count > self.sampling.min_tokens and not state.is_finished
            text, stop = self.detokenizer.push([token], search_stop=search)
        if stop is not None:
            state.finish(FinishReason.STOP, stop)
        elif not state.is_finished and self.sampling.constraint_done():
            # a guided choice's whole sequence, or a grammar that can take no more -- or one whose matcher failed
            # (a parser limit met mid-answer): the worker then fails the request (see ``failure``)
            state.finish(FinishReason.ABORT if self.failure else FinishReason.STOP)
        elif count >= state.max_tokens:
            state.finish(FinishReason.LENGTH)
        if state.is_finished:
            text += self.detokenizer.finish()
        logprobs = [logprob] if self.want_logprobs and logprob is not None else None
        prompt = None
        if count == 1 and self.want_prompt_logprobs:
            prompt = self.group.prompt_logprobs
            assert prompt is not None, f"{state} sampled before its prompt was scored"
        return ChoiceDelta(self.index, [token], text, logprobs, state.finish_reason, state.stop_reason, prompt)


class RequestGroup:
    """The choices of one request, its stream, and the numbers its stats are made of."""

    def __init__(
        self, request_id: str, stream: RequestStream, arrival: float, *, prompt_tokens: int = 0, score: bool = False
    ) -> None:
        """``score``: the prompt's logprobs are wanted (a prompt of ``prompt_tokens`` tokens)."""
        self.request_id = request_id
        self.stream = stream
        self.arrival = arrival
        self.choices: list[RequestState] = []
        self._scores: PromptLogprobs | None = [None] * prompt_tokens if score else None
        self._unscored = max(prompt_tokens - 1, 0) if score else 0  # entries 1.. not yet scored
        self.prompt_logprobs: PromptLogprobs | None = self._scores if score and not self._unscored else None

    def score_prompt(self, start: int, entries: Sequence[TokenLogprob]) -> None:
        """Prompt tokens ``start + 1 ...`` scored (by the rows at positions ``start ...``). Once every token after
        the first is, the scores are :attr:`prompt_logprobs` and no choice skips the prefix cache any more."""
        scores = self._scores
        if scores is None or self.prompt_logprobs is not None:
            return
        for offset, entry in enumerate(entries, start + 1):
            if scores[offset] is None:
                self._unscored -= 1
            scores[offset] = entry
        if not self._unscored:
            self.prompt_logprobs = scores
            for state in self.choices:
                state.skip_prefix_cache = False

    @property
    def done(self) -> bool:
        return all(state.is_finished for state in self.choices)

    def chunk(self, deltas: list[ChoiceDelta], replica: str, now: float) -> StreamChunk:
        """This step's deltas, with the stats once every choice is done."""
        return StreamChunk(self.request_id, deltas, self.stats(replica, now) if self.done else None)

    def abort_deltas(self) -> list[ChoiceDelta]:
        """Close every unfinished choice with ``abort`` (the request was cancelled or the worker stops)."""
        deltas = []
        for index, state in enumerate(self.choices):
            if not state.is_finished:
                state.finish(FinishReason.ABORT)
                deltas.append(ChoiceDelta(index, [], "", None, FinishReason.ABORT))
        return deltas

    def stats(self, replica: str, now: float) -> RequestStats:
        first = self.choices[0]
        scheduled = [s.first_scheduled for s in self.choices if s.first_scheduled is not None]
        tokens = [s.first_token for s in self.choices if s.first_token is not None]
        by_medium: dict[Medium, int] = dict(first.cached_tokens_by_medium or dict.fromkeys(MEDIA, 0))
        return RequestStats(
            replica=replica,
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(len(s.output_token_ids) for s in self.choices),
            cached_tokens_by_medium=by_medium,
            queue_s=(min(scheduled) if scheduled else now) - self.arrival,
            ttft_s=(min(tokens) if tokens else now) - self.arrival,
            total_s=now - self.arrival,
            preempted=sum(s.num_preemptions for s in self.choices),
        )
