"""One KV worker behind an OpenAI-compatible HTTP front, no Ray (``kvstore worker`` serves it).

This is a replica exactly as a vLLM server is one: ``POST /v1/completions``
(prompt as text or token ids), ``GET /health``, ``GET /metrics`` (503 once
the worker can no longer serve: the router's health poll reads this page),
and KV events on ZeroMQ. A fleet of these behind ``kvstore router`` is the same
deployment as a vLLM fleet behind it, so the plain-HTTP path is tested end to
end without Ray.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvstore.errors import InvalidRequestError
from kvstore.openai.protocol import ApiError, ModelLimits, decode_request, prompt_token_ids, validate
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.worker_api import GenerateRequest, WorkerShutdownError
from kvstore.workers.worker import KVWorker


def create_worker_app(worker: KVWorker, *, max_body_bytes: int = 4 << 20) -> FastAPI:
    """An OpenAI-compatible app over ``worker`` (which the caller owns and shuts down)."""
    info = worker.info()
    limits = ModelLimits(info.vocab_size, info.max_context)
    tokenizer = ByteTokenizer()
    app = FastAPI(title=f"kvstore worker {worker.name}", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.body()
        if len(body) > max_body_bytes:
            raise ApiError(413, f"request body larger than {max_body_bytes} bytes")
        req = decode_request(body)
        prompt = validate(req, prompt_token_ids(req, tokenizer.encode), limits)
        request_id = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        generate = GenerateRequest(
            token_ids=prompt.token_ids,
            max_tokens=prompt.max_tokens,
            request_id=request_id,
            cache_salt=prompt.cache_salt,
            lora_name=prompt.lora_name,
        )
        try:
            result = await asyncio.wrap_future(worker.submit(generate))
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc)) from None
        except WorkerShutdownError as exc:
            raise ApiError(503, str(exc)) from None
        completion_tokens = len(result.output_token_ids)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": prompt.model or "kvstore-toy",
                "choices": [
                    {
                        "index": 0,
                        "text": tokenizer.decode(result.output_token_ids),
                        "token_ids": result.output_token_ids,
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": result.prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
                },
                "kvstore": {
                    "replica": result.replica,
                    "cached_tokens": result.cached_tokens_by_medium,
                    "queue_s": result.queue_s,
                    "ttft_s": result.ttft_s,
                    "total_s": result.total_s,
                    "preempted": result.preempted,
                },
            }
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        state = worker.health()
        return JSONResponse(state, status_code=200 if state["alive"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # The router's health poll reads this page: a worker that can no longer serve must not look healthy.
        state = worker.health()
        if not state["alive"]:
            reason = state["last_error"] or "shut down"
            raise ApiError(503, f"worker {worker.name} is not serving ({reason})")
        return Response(worker.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app
