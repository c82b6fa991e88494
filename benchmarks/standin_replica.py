"""A stand-in for a vLLM server's HTTP face, written from vLLM's documented OpenAI-server behaviour.

vLLM itself cannot run here (no GPU, no weights), but a router in front of
a vLLM fleet only depends on what crosses the wire, so this server answers
exactly that: ``POST /v1/completions`` and ``/v1/chat/completions`` (plain
bodies with ``usage``; ``stream: true`` as SSE chunks in vLLM's shape --
a role chunk per choice on chat, ``stream_options.include_usage`` adding a
usage chunk (and ``continuous_usage_stats`` the usage so far to every
chunk), ``data: [DONE]`` last), ``GET /v1/models`` and ``GET /metrics`` with vLLM's load gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``), and on completions an ``X-Request-Id``
header (the request's own, or a new one), as vLLM run with
``--enable-request-id-headers`` answers. It records every request's path, headers and
exact body bytes, so a test can prove a router forwarded what the client
sent, and it streams with configurable delays (time to the first chunk,
between chunks), so a benchmark can time what a router adds.

What it generates is not language: token ``i`` of a completion is the text
``"t{i} "``, and ``usage`` counts those tokens and the prompt's characters.
It reads ``max_tokens`` (default 16) and ``n``; every other field is only
recorded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvstore.openai.http import model_card


class Recorded(NamedTuple):
    path: str
    headers: dict[str, str]
    body: bytes


class StandinState:
    """What the stand-in serves and what it saw; tests and benchmarks set the fields directly."""

    def __init__(self, model: str, *, ttft_s: float = 0.0, itl_s: float = 0.0) -> None:
        self.model = model
        self.ttft_s = ttft_s  # delay before the first chunk (or the plain body)
        self.itl_s = itl_s  # delay between chunks
        self.running = 0.0  # reported by /metrics
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.requests: list[Recorded] = []
        self.disconnects = 0  # streams whose client went away before the end
        self._lock = threading.Lock()

    def record(self, item: Recorded) -> None:
        with self._lock:
            self.requests.append(item)


def create_standin_app(state: StandinState) -> FastAPI:
    app = FastAPI(title="vLLM stand-in", docs_url=None, redoc_url=None)

    async def generate(request: Request, chat: bool) -> Response:
        raw = await request.body()
        state.record(Recorded(request.url.path, dict(request.headers), raw))
        headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}
        body = json.loads(raw)
        if body.get("model") not in (None, state.model):
            message = f"The model `{body['model']}` does not exist."
            error = {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
            return JSONResponse({"error": error}, status_code=404, headers=headers)
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        n = int(body.get("n") or 1)
        prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": tokens * n,
            "total_tokens": len(prompt) + tokens * n,
        }
        ident = ("chatcmpl-" if chat else "cmpl-") + str(len(state.requests))
        if body.get("stream"):
            options = body.get("stream_options")
            with_usage = options is not None and options.get("include_usage", True)
            running = with_usage and bool(options.get("continuous_usage_stats"))  # as vLLM: only with include_usage
            stream = _stream(state, ident, chat, tokens, n, usage if with_usage else None, running)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        await asyncio.sleep(state.ttft_s + state.itl_s * (tokens - 1))
        text = "".join(f"t{i} " for i in range(tokens))
        choices = [
            {"index": c, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "length"}
            if chat
            else {"index": c, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            for c in range(n)
        ]
        kind = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        return JSONResponse(
            {"id": ident, "object": kind, "created": created, "model": state.model, "choices": choices, "usage": usage},
            headers=headers,
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = model_card(state.model, 4096, owned_by="vllm")  # vLLM's card, field for field
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        label = f'{{model_name="{state.model}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{label} {state.running}",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{label} {state.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{label} {state.kv_usage}",
        ]  # fmt: skip
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


async def _stream(
    state: StandinState, ident: str, chat: bool, tokens: int, n: int, usage: dict[str, int] | None, running: bool
) -> AsyncIterator[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {"id": ident, "object": kind, "created": created, "model": state.model, "choices": choices, **extra}
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def so_far(generated: int) -> dict[str, Any]:  # continuous_usage_stats: the usage up to this chunk
        if not running or usage is None:
            return {}
        prompt = usage["prompt_tokens"]
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}}

    finished = False
    try:
        await asyncio.sleep(state.ttft_s)
        if chat:
            for c in range(n):
                yield event([{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}], **so_far(0))  # fmt: skip
        for i in range(tokens):
            if i:
                await asyncio.sleep(state.itl_s)
            reason = "length" if i == tokens - 1 else None
            for c in range(n):
                choice: dict[str, Any] = {"index": c, "logprobs": None, "finish_reason": reason}
                choice.update({"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} ", "stop_reason": None})
                yield event([choice], **so_far(i + 1))
        if usage is not None:
            yield event([], usage=usage)
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            state.disconnects += 1
