"""OpenAI response bodies and server-sent-event chunks, built from a worker's output.

One :class:`ResponseBuilder` per request turns the worker's
:class:`~kvstore.worker_api.StreamChunk` deltas (streamed) or its
:class:`~kvstore.worker_api.GenerateResult` (plain) into the bodies vLLM's
server sends for ``/v1/completions`` and ``/v1/chat/completions``:

- plain: ``text_completion`` / ``chat.completion`` with ``usage`` (and
  ``prompt_tokens_details.cached_tokens``);
- streamed: one ``data: {json}`` event per choice per step that produced
  text or ended, a chat stream opening each choice with its
  ``{"role": "assistant"}`` delta, an optional usage chunk (``choices``
  empty) when ``stream_options.include_usage``, then ``data: [DONE]``;
  with ``continuous_usage_stats`` too, every chunk carries the usage so far
  (the prompt, and the tokens its choice has generated).

Prompt logprobs, as vLLM returns them: a completion's ``echo`` with
``logprobs`` scores the echoed prompt too (its first token with no
logprob), and a plain body carries ``prompt_logprobs`` (per choice for
completions, once for chat): per prompt token, None for the first, then
``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt's own
token first, then the top alternatives. A completion's ``echo`` with
``max_tokens`` 0 shows the prompt alone (one token is generated).

With a tool-call parser (``ParsedRequest.tool_parser``), a chat answer's
tool calls are parsed out of its text (:mod:`kvstore.openai.tool_calls`):
the message (or the stream's deltas) carries ``tool_calls`` and the choice
ends with ``finish_reason: "tool_calls"``, as vLLM answers. A named
``tool_choice`` makes the answer one call of that function (content ``""``,
``finish_reason`` as generated), ``"required"`` an array of calls
(``finish_reason: "tool_calls"`` once the array closed; cut short, the
calls that closed and the rest as content), as vLLM answers them.

With a reasoning parser (``ParsedRequest.reasoning_parser``), a chat answer's
reasoning (before ``</think>``) is split from its content
(:mod:`kvstore.openai.reasoning`): the message or delta carries it as
``reasoning`` and ``reasoning_content``; a tool-call parser reads the content only.

Beyond vLLM, choices carry ``token_ids`` and the body (or the stream's
last chunk) a ``kvstore`` object the caller supplies: which replica served
the request, cached tokens per medium, timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvstore.openai.protocol import ParsedRequest
from kvstore.openai.reasoning import NO_THINKING, ReasoningStream, split
from kvstore.openai.tokenizer import Tokenizer
from kvstore.openai.tool_calls import (
    NamedCallStream,
    Piece,
    RequiredCallStream,
    ToolCallStream,
    extract,
    merged_calls,
    named_call,
    read_required,
)
from kvstore.worker_api import ChoiceDelta, GenerateResult, PromptLogprobs, RequestStats, StreamChunk, TokenLogprob

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()

Extras = Callable[[RequestStats], dict[str, Any]]


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def usage(stats: RequestStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


class ResponseBuilder:
    """Bodies for one request (see the module docstring). Not thread-safe: one per request."""

    def __init__(
        self,
        parsed: ParsedRequest,
        tokenizer: Tokenizer,
        *,
        model: str,
        request_id: str,
        extras: Extras | None = None,
        batch: Sequence[ParsedRequest] | None = None,
    ) -> None:
        """``batch``: a completions request's prompts, each parsed (``parsed`` is the first); choice ``i`` is
        choice ``i % n`` of prompt ``i // n``, as vLLM numbers them."""
        self.parsed = parsed
        self._batch = list(batch) if batch else [parsed]
        self.num_choices = parsed.sampling.n * len(self._batch)
        self.chat = parsed.kind == "chat"
        self._tokenizer = tokenizer
        self.model = model
        self.id = request_id
        self.created = int(time.time())
        self._extras = extras
        self._started: set[int] = set()  # choices whose first chunk went out
        self._offsets: dict[int, int] = {}  # completions' logprobs text_offset, per choice
        self._generated: dict[int, int] = {}  # tokens each choice has generated so far (continuous usage)
        self._tool_streams: dict[int, CallStream] = {}  # per choice, with a tool-call parser or forced calls
        self._reasoning_streams: dict[int, ReasoningStream] = {}  # per choice, with a reasoning parser

    # ------------------------------------------------------------------ plain

    def body(self, result: GenerateResult) -> dict[str, Any]:
        choices = []
        for choice in result.choices:
            prompt = self._prompt_of(choice.index)
            shown = not prompt.echo_only
            text = (prompt.echo_text or "") + (choice.text if shown else "")
            entry: dict[str, Any] = {"index": choice.index}
            finish_reason = str(choice.finish_reason)
            if self.chat:
                answer: str | None = choice.text
                parsed: dict[str, Any] = {}  # what the parsers took out of the answer
                if prompt.reasoning_parser is not None:
                    reasoning, answer = split(choice.text, prompt.reasoning_parser)
                    parsed["reasoning"] = parsed["reasoning_content"] = reasoning
                if prompt.tool_parser is not None:
                    found = extract(answer or "", prompt.tool_parser, prompt.tool_types)
                    answer = found.content
                    parsed["tool_calls"] = found.tool_calls
                    if found.tool_calls:
                        finish_reason = "tool_calls"
                forced = _forced_calls(prompt, answer or "", finish_reason)
                if forced is not None:  # as vLLM: a forced call's message has "" content, the answer is the call
                    answer, parsed["tool_calls"], finish_reason = forced
                content: str | None = (prompt.echo_text or "") + (answer or "")
                if parsed and forced is None:  # an answer a parser split has null content when nothing is left of it
                    content = content or None
                entry["message"] = {"role": prompt.role, "content": content, **parsed}
            else:
                entry["text"] = text
            entry["logprobs"] = self._logprobs(
                choice.index, choice.logprobs if shown else [], self._echoed(choice.index, choice.prompt_logprobs)
            )
            entry["finish_reason"] = finish_reason
            entry["stop_reason"] = choice.stop_reason
            entry["token_ids"] = choice.token_ids
            if not self.chat:
                entry["prompt_logprobs"] = self._prompt_logprobs(choice.prompt_logprobs)
            choices.append(entry)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(result.stats),
        }
        if self.chat:  # vLLM's chat body carries the prompt's once
            body["prompt_logprobs"] = self._prompt_logprobs(
                result.choices[0].prompt_logprobs if result.choices else None
            )
        if self._extras is not None:
            body["kvstore"] = self._extras(result.stats)
        return body

    # ---------------------------------------------------------------- streamed

    def events(self, chunk: StreamChunk) -> list[bytes]:
        """The SSE events for one worker chunk (its stats, if any, end the stream's content)."""
        payloads = []
        for delta in chunk.deltas:
            payloads.extend(self._delta_payloads(delta))
        if chunk.stats is not None:
            if self.parsed.include_usage:
                payloads.append(self._envelope([], usage=usage(chunk.stats)))
            if self._extras is not None and payloads:
                payloads[-1]["kvstore"] = self._extras(chunk.stats)
        return [sse(p) for p in payloads]

    def _delta_payloads(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        out = []
        text = delta.text
        first = delta.index not in self._started
        generated = self._generated.get(delta.index, 0) + len(delta.token_ids)  # counted, sent or held back
        self._generated[delta.index] = generated
        if self.chat and not self._started:  # as vLLM: every choice's role chunk, before any content
            for index in range(self.num_choices):
                opened = {"role": self._prompt_of(index).role, "content": ""}
                role = {"index": index, "delta": opened, "logprobs": None, "finish_reason": None}
                out.append(self._envelope([role], usage=self._running_usage(index, 0)))
            for index in range(self.num_choices):  # then a chat's echo, a chunk of its own per choice
                echo = self._prompt_of(index).echo_text
                if echo:
                    echoed = {"index": index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                    out.append(self._envelope([echoed], usage=self._running_usage(index, 0)))
        entries = delta.logprobs
        if self._prompt_of(delta.index).echo_only:  # the prompt alone: the token generated is not shown
            text, entries = "", [] if entries is not None else None
        scored = None
        if first:
            self._started.add(delta.index)
            if not self.chat:  # a completion's echo opens its choice's first chunk, as vLLM sends it
                text = (self._prompt_of(delta.index).echo_text or "") + text
                scored = self._echoed(delta.index, delta.prompt_logprobs)
        logprobs = self._logprobs(delta.index, entries, scored)
        finish_reason = None if delta.finish_reason is None else str(delta.finish_reason)
        calls: list[dict[str, Any]] = []
        reasoning = ""
        prompt = self._prompt_of(delta.index)
        splits = self.chat and prompt.reasoning_parser not in (None, NO_THINKING)
        if splits:
            stream = self._reasoning_streams.setdefault(delta.index, ReasoningStream())
            reasoning, text = _through(stream, text, finish_reason is not None)
        if self.chat and (prompt.tool_parser is not None or prompt.named_tool is not None or prompt.tools_required):
            tools = self._tool_streams.get(delta.index)
            if tools is None:
                tools = self._tool_streams[delta.index] = _call_stream(prompt)
            text, calls = _through(tools, text, finish_reason is not None)
            # a named call ends as generated; a required answer "tool_calls" only once its array closed
            if isinstance(tools, RequiredCallStream):
                if finish_reason == "stop" and tools.complete:
                    finish_reason = "tool_calls"
            elif finish_reason is not None and tools.calls and prompt.named_tool is None:
                finish_reason = "tool_calls"
        if (
            not text
            and not reasoning
            and not calls
            and not delta.token_ids
            and finish_reason is None
            and logprobs is None
        ):
            return out
        # A token whose text is held back (an unfinished UTF-8 character) still goes out, with its id and no
        # text, as vLLM sends it: the chunks' token_ids add up to the answer's.
        choice: dict[str, Any] = {"index": delta.index}
        if self.chat:
            # a token whose text is held back goes out with no content -- and while thinking, none at all
            shown = text or (delta.token_ids and not calls and not reasoning and not splits)
            choice["delta"] = {"content": text} if shown else {}
            if reasoning:
                choice["delta"]["reasoning"] = choice["delta"]["reasoning_content"] = reasoning
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = delta.stop_reason
        choice["token_ids"] = delta.token_ids
        out.append(self._envelope([choice], usage=self._running_usage(delta.index, generated)))
        return out

    def _prompt_of(self, index: int) -> ParsedRequest:
        return self._batch[index // self.parsed.sampling.n]

    def _running_usage(self, index: int, completion_tokens: int) -> dict[str, Any] | None:
        """``continuous_usage_stats``: a chunk's usage, as vLLM counts it -- the prompt, and the tokens its choice
        has generated so far (none yet on a chat stream's opening role chunk); None without the option."""
        if not self.parsed.continuous_usage:
            return None
        prompt = len(self._prompt_of(index).token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def _envelope(self, choices: list[dict[str, Any]], *, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            payload["usage"] = usage
        return payload

    # ---------------------------------------------------------------- logprobs

    def _echoed(self, index: int, scored: PromptLogprobs | None) -> list[tuple[int, TokenLogprob | None]] | None:
        """A completion's echoed prompt as (token id, its score) pairs for its logprobs, when echo and logprobs
        are asked for together (the worker then scored the prompt); None otherwise."""
        prompt = self._prompt_of(index)
        if self.chat or prompt.echo_text is None or prompt.logprobs is None or scored is None:
            return None
        return list(zip(prompt.token_ids, scored, strict=True))

    def _logprobs(
        self,
        index: int,
        entries: Sequence[TokenLogprob] | None,
        echoed: Sequence[tuple[int, TokenLogprob | None]] | None = None,
    ) -> dict[str, Any] | None:
        """A choice's logprobs object for ``entries`` (its tokens this time), after its ``echoed`` prompt's."""
        if self.parsed.logprobs is None or entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        if echoed:  # the prompt may be scored with more alternatives (prompt_logprobs) than logprobs shows
            top = self._prompt_of(index).logprobs or 0
            echoed = [(t, e if e is None or len(e.top) <= top else msgspec.structs.replace(e, top=e.top[:top]))
                      for t, e in echoed]  # fmt: skip
        steps = [*(echoed or ()), *((e.token_id, e) for e in entries)]
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for token_id, _ in steps:
            token = self._token(token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _finite(e.logprob) for _, e in steps],
            # As vLLM (and OpenAI's legacy API) answer: the chosen token first, then the top ``logprobs``
            # alternatives, one entry per distinct text (so logprobs=0 still names the chosen token); the
            # prompt's first token, which nothing predicts, has none.
            "top_logprobs": [
                None
                if e is None
                else {token: _finite(e.logprob)}
                | {name: _finite(lp) for t, lp in e.top if (name := self._token(t)) != token}
                for token, (_, e) in zip(tokens, steps, strict=True)
            ],
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, scored: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or ``{id: {logprob, rank,
        decoded_token}}``, the prompt's token first, then the alternatives ranked 1, 2, ..."""
        if scored is None:
            return None
        out: list[dict[str, Any] | None] = []
        for entry in scored:
            if entry is None:
                out.append(None)
                continue
            ranked = [
                (entry.token_id, entry.logprob, entry.rank),
                *((t, lp, r) for r, (t, lp) in enumerate(entry.top, 1)),
            ]
            step: dict[str, Any] = {}
            for token_id, logprob, rank in ranked:
                step.setdefault(
                    str(token_id),
                    {"logprob": _finite(logprob), "rank": rank, "decoded_token": self._token(token_id)},
                )
            out.append(step)
        return out

    def _chat_entry(self, entry: TokenLogprob) -> dict[str, Any]:
        token = self._token(entry.token_id)
        return {
            "token": token,
            "logprob": _finite(entry.logprob),
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (t := self._token(i)), "logprob": _finite(lp), "bytes": list(t.encode())}
                for i, lp in entry.top
            ],
        }

    def _token(self, token_id: int) -> str:
        if self.parsed.tokens_as_ids:  # vLLM's return_tokens_as_token_ids: tokens that do not decode alone stay apart
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


CallStream = ToolCallStream | NamedCallStream | RequiredCallStream


def _call_stream(prompt: ParsedRequest) -> CallStream:
    """How a streamed chat answer's tool calls are read: a forced call's way, else the tool-call parser's."""
    if prompt.named_tool is not None:
        return NamedCallStream(prompt.named_tool)
    if prompt.tools_required:
        return RequiredCallStream()
    assert prompt.tool_parser is not None
    return ToolCallStream(prompt.tool_parser, prompt.tool_types)


def _forced_calls(
    prompt: ParsedRequest, answer: str, finish_reason: str
) -> tuple[str, list[dict[str, Any]], str] | None:
    """A plain answer as (content, calls, finish reason) when ``tool_choice`` forced calls: the named function's one
    call; a required answer's calls, ``tool_calls`` once its array closed, and what no call was made of (an answer
    cut short) as content, read as a stream reads it. None when nothing was forced."""
    if prompt.named_tool is not None:  # no answer (cut short while thinking): no call, as the stream makes none
        return "", [named_call(prompt.named_tool, answer)] if answer else [], finish_reason
    if prompt.tools_required:
        calls, rest, complete = read_required(answer)
        return rest, calls, "tool_calls" if complete and finish_reason == "stop" else finish_reason
    return None


def _through(stream: ReasoningStream | CallStream, text: str, finished: bool) -> Any:
    """A streamed delta's text through a choice's parser (its piece), and on the choice's last delta what the
    parser still held too, field by field."""
    piece: Any = stream.push(text)  # a NamedTuple of str / list fields, each concatenated with the tail's
    if finished:
        tail: Any = stream.finish()
        piece = type(piece)(*(held + more for held, more in zip(piece, tail, strict=True)))
        if isinstance(piece, Piece) and piece.tool_calls:  # one entry per call in the chunk, as vLLM sends them
            piece = Piece(piece.content, merged_calls(piece.tool_calls))
    return piece


def _finite(logprob: float) -> float:
    """-inf (a token the model rules out) as the JSON-safe -9999.0 that vLLM and OpenAI send."""
    return max(logprob, -9999.0)
