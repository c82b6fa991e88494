"""Completions in front of external replicas (vLLM, SGLang): the client's body forwarded, the answer relayed.

The body is only read, to route it (:func:`~kvstore.openai.routing.read_for_routing`),
and goes to the chosen replica byte for byte, to the path the client named
with its query string as received, with the client's headers in order (a
repeated one repeated); the replica's status -- a 5xx too -- body and SSE
chunks come back as it sent them, its headers too, in order and repeated
as they came (``x-request-id``, ``set-cookie``; not those about the one
connection: :func:`relayed_headers`), with what the router adds in
``x-kvstore-*`` headers (:func:`~kvstore.router.response.routing_headers`).

This runs as plain ASGI beside the FastAPI app rather than as one of its
routes (the router's front sends these paths here): every request and every
chunk of every stream passes here, and the framework's request handling,
middleware, response classes and per-chunk send wrappers would add a good
part of what the router costs a stream's first token. What it answers
itself: 400 for a body no replica could serve, 413 for one beyond
``router``'s body bounds (:mod:`kvstore.openai.bounds`), 503 when no replica
can take it (none answered at all), 504 when the replica took it and gave no
status line within its timeout, 502 when the replica's plain answer breaks
off (all as OpenAI error bodies); a stream that breaks off after its 200 went out ends with an
error event (502) and ``data: [DONE]``, as a worker's failed stream does. A client that disconnects --
mid-stream, or while a plain answer is still being computed -- closes the
upstream connection, which is how the replica learns to abort.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from typing import Any, Literal

import msgspec
from fastapi import Request
from starlette.types import Receive, Scope, Send

from kvstore.openai.errors import ApiError
from kvstore.openai.http import ClientDisconnected, error_response, read_body, until_disconnected
from kvstore.openai.responses import DONE, sse
from kvstore.openai.routing import read_for_routing, read_token_ids
from kvstore.router.response import routing_headers
from kvstore.router.routing import Prompt, RouteResult
from kvstore.router.service import RouterService

Kind = Literal["completion", "chat"]
_NOT_RELAYED = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "te", "trailer", "transfer-encoding",
     "upgrade", "content-length", "date", "server"}
)  # fmt: skip
# A replica's answer that breaks off: its connection reset or closed mid-body, a stalled read, a bad chunk header.
_UPSTREAM_FAILED = (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError)
KINDS: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
# vLLM's tokenizer endpoints: forwarded as the completions are, to the least loaded replica serving the model.
FORWARDED = frozenset({*KINDS, "/tokenize", "/detokenize"})
_INLINE_TEXT_BYTES = 2048  # shorter text tokenises faster than a hop to a thread and back
# Bytes a request target cannot carry as they are (a server that let them into a query string): percent-encoded.
_NOT_IN_TARGET = re.compile(rb"[\x00-\x20\x7f-\xff]")


class RelayApp:
    """Serves the completion routes while the fleet is external (:attr:`RouterService.forwards`).

    An ASGI app of its own, which the router's front (:class:`~kvstore.router.app.RouterApp`) calls for
    those routes instead of the FastAPI app: nothing of the framework runs per request or per chunk.
    """

    def __init__(self, service: RouterService) -> None:
        self._service = service
        self._bounds = service.config.router.body_bounds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = KINDS.get(scope["path"])
        request = Request(scope, receive)
        try:
            body = await read_body(request, self._bounds)
            if kind is None:  # /tokenize, /detokenize: no prefix to match, the load decides
                prompt = Prompt([], None, model=_model_named(body))
                routed = self._service.route(prompt)
            else:
                prompt, routed = await self._route(body, kind)
            # From here the client may leave at any time -- while a plain answer is being computed too:
            # the relay is then cancelled, which closes the upstream connection.
            target = scope["path"] + _query(scope.get("query_string", b""))
            await until_disconnected(request, self._relay(send, prompt, routed, target, body, request))
        except ApiError as exc:  # raised before anything was sent
            await error_response(exc)(scope, receive, send)
        except ClientDisconnected:
            pass

    async def _route(self, body: bytes, kind: Kind) -> tuple[Prompt, RouteResult]:
        service = self._service
        view = read_token_ids(body) if kind == "completion" else None
        trust = service.config.router.trust_request_chat_template
        if view is None and service.tokenizer is not None and (len(body) > _INLINE_TEXT_BYTES or trust):
            # Tokenising releases the GIL: in a thread it runs beside the loop, which meanwhile relays
            # every other stream's chunks instead of holding them back for milliseconds. So does a request's
            # own chat template, however short its body: what it runs is its author's to decide.
            view = await asyncio.to_thread(read_for_routing, body, kind, service.tokenizer, trust_template=trust)
        elif view is None:
            view = read_for_routing(body, kind, service.tokenizer)
        prompt = Prompt(view.token_ids or [], view.cache_salt, model=view.model)
        return prompt, service.route(prompt)

    async def _relay(
        self, send: Send, prompt: Prompt, routed: RouteResult, target: str, body: bytes, request: Request
    ) -> None:
        relayed = await self._service.relay(prompt, routed, target, body, request.headers)
        answer = relayed.upstream
        headers = relayed_headers(answer.fields)
        headers += routing_headers(relayed.replica, relayed.retried, routed).items()
        media_type = answer.headers.get("content-type")
        try:
            if media_type and media_type.startswith("text/event-stream"):
                await send({"type": "http.response.start", "status": answer.status, "headers": _raw(headers)})
                last = b"\n\n"
                try:
                    async for data in answer.body:  # each chunk as it arrives
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                        last = data or last
                except _UPSTREAM_FAILED as exc:  # after the 200 went out: the stream ends with an error event
                    failure = ApiError(502, f"replica {relayed.replica} failed mid-stream: {_describe(exc)}")
                    ending = b"" if last.endswith(b"\n\n") else b"\n\n"  # a cut event stays apart from ours
                    await send({"type": "http.response.body", "body": ending + sse(failure.body()) + DONE,
                                "more_body": True})  # fmt: skip
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                try:
                    content = b"".join([data async for data in answer.body])
                except _UPSTREAM_FAILED as exc:  # nothing sent yet: an error answer of our own
                    raise ApiError(502, f"replica {relayed.replica} failed while answering: {_describe(exc)}") from None
                headers.append(("content-length", str(len(content))))
                await send({"type": "http.response.start", "status": answer.status, "headers": _raw(headers)})
                await send({"type": "http.response.body", "body": content, "more_body": False})
        finally:  # the dispatcher's generator: it settles the replica's books and the connection
            await answer.body.aclose()  # type: ignore[attr-defined]


def _model_named(body: bytes) -> str | None:
    """The ``model`` a body names, if it is a JSON object naming one (anything else: None; the replica judges)."""
    try:
        model = msgspec.json.decode(body, type=dict[str, Any]).get("model")
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None
    return model if isinstance(model, str) else None


def relayed_headers(upstream: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The replica's answer headers a client gets, in order, a repeated one repeated (``set-cookie``): all but
    those about this one connection (hop-by-hop), the length (set again for the body as relayed), the ones the
    router's server writes itself (``date``, ``server``: never two of each) and ``x-kvstore-*`` (the router's
    own). Names are lower-case, as the relay's client reads them."""
    return [(name, value) for name, value in upstream if name not in _NOT_RELAYED and not name.startswith("x-kvstore-")]


def _query(raw: bytes) -> str:
    """``?`` and the client's query string as received (empty when it sent none)."""
    if not raw:
        return ""
    return "?" + _NOT_IN_TARGET.sub(lambda byte: b"%%%02X" % byte[0][0], raw).decode("ascii")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the connection closed before the answer ended"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _raw(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers]
