"""Replica backends: how the router reaches one replica.

Two kinds, for the two kinds of fleet:

- :class:`RayActorBackend` -- one of our KV worker actors, by handle. The
  router parses and checks each request itself and sends the worker the
  typed :class:`~kvstore.worker_api.GenerateRequest`; the worker answers
  with a Ray streaming generator of
  :class:`~kvstore.worker_api.StreamChunk` (:meth:`RayActorBackend.stream`),
  which the router turns into OpenAI bodies. Closing the stream cancels the
  request on the worker.
- :class:`HttpBackend` -- any OpenAI-compatible server (vLLM, SGLang, or
  ``kvstore worker``). The router forwards the client's body bytes as they
  came and passes the answer back as it arrives
  (:meth:`HttpBackend.forward`, over the relay's own HTTP/1.1 client,
  :mod:`kvstore.router.upstream`); closing it closes the upstream
  connection, which is how vLLM learns to abort. Load comes from its
  Prometheus ``/metrics`` (vLLM's gauges, or ours), its models from
  ``/v1/models`` (polled with httpx: a few requests a second, off the
  request path).

Errors: :class:`ReplicaUnavailable` means the replica failed before
answering anything (dead, unreachable, reset before a status line) and the
request may go elsewhere; :class:`ReplicaRejected` means it refused the
request itself; :class:`ReplicaTimedOut` means an HTTP replica took the
request and gave no status line in time (it is slow, not gone: the request
is not sent again). An HTTP replica's answer with a status line -- any
status, a 5xx included -- is no error here: it is the replica's to give,
and goes back to the client as it came (vLLM answers 500 or 501 for one
request's own failure; the dispatcher decides about 502/503/504).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvstore.errors import InvalidRequestError
from kvstore.metrics import GPU_CACHE_USAGE, REQUESTS_RUNNING, REQUESTS_WAITING
from kvstore.router.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from kvstore.worker_api import GenerateRequest, StreamChunk, WorkerLoad

logger = logging.getLogger(__name__)


class ReplicaUnavailable(Exception):
    """The replica failed before producing a response; safe to retry elsewhere."""


class ReplicaRejected(Exception):
    """The replica refused the request as invalid; do not retry."""


class ReplicaTimedOut(Exception):
    """The replica took the request and did not answer in time; the connection is closed. Do not retry."""


class ReplicaLoad(NamedTuple):
    running: int
    waiting: int
    kv_usage: float  # 0..1


class ReplicaPoll(NamedTuple):
    load: ReplicaLoad
    metrics_text: str  # the replica's Prometheus page ("" when it has none)
    models: list[dict[str, Any]]  # its /v1/models cards ([] when it does not say)


class Forwarded(NamedTuple):
    """An upstream answer: status and headers now, the body as it arrives (``close`` drops the connection).

    ``fields``: the headers as they came (pairs, in order, repeated ones repeated); ``headers``: a mapping of
    them for lookups (repeated values joined with ", ").
    """

    status: int
    headers: Mapping[str, str]
    body: AsyncIterator[bytes]
    close: Any  # async () -> None
    fields: Sequence[tuple[str, str]] = ()


class ReplicaBackend(Protocol):
    name: str

    async def poll(self) -> ReplicaPoll:
        """Load, metrics and models, for the health loop; raises ReplicaUnavailable when it does not answer."""
        ...

    async def close(self) -> None: ...


class RayActorBackend:
    """A KV worker Ray actor. Any Ray error (actor died, node lost) is ReplicaUnavailable."""

    def __init__(self, name: str, handle: Any, *, timeout_s: float = 300.0) -> None:
        """``handle``: the worker actor's (Ray handles are untyped); ``timeout_s`` bounds the wait for each chunk."""
        self.name = name
        self._handle = handle
        self._timeout = timeout_s

    async def stream(self, request: GenerateRequest) -> AsyncGenerator[StreamChunk, None]:
        """The worker's chunks for ``request``; closing the generator cancels the request on the worker.

        Raises ReplicaRejected for a request the worker refused, ReplicaUnavailable for any other failure.
        """
        import ray  # here, not at the top: routers with HTTP replicas only never load Ray
        import ray.exceptions

        refs = self._handle.generate_stream.options(num_returns="streaming").remote(request)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._timeout):
                        ref = await refs.__anext__()
                except StopAsyncIteration:
                    return
                chunk: StreamChunk = await ref
                yield chunk
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, InvalidRequestError):
                raise ReplicaRejected(str(cause.args[0] if cause.args else cause)) from None
            raise ReplicaUnavailable(f"{self.name}: {type(cause).__name__}: {cause}") from None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ReplicaUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from None
        finally:
            ray.cancel(refs)  # a no-op once the stream has ended

    async def poll(self) -> ReplicaPoll:
        import ray.exceptions

        try:
            both = asyncio.gather(self._handle.load.remote(), self._handle.metrics_text.remote())
            # A poll cancelled mid-flight (the router stopping) ends the gather with a CancelledError that
            # wait_for never reads; read it here, or asyncio logs it as never retrieved.
            both.add_done_callback(lambda done: done.cancelled() or done.exception())
            polled: tuple[WorkerLoad, bytes] = await asyncio.wait_for(both, 5.0)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ReplicaUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from None
        load, page = polled
        return ReplicaPoll(ReplicaLoad(load.running, load.waiting, load.kv_usage), page.decode(), [])

    async def close(self) -> None:
        return None


# Names vLLM (old and new) and kvstore workers use for the load signals.
_RUNNING = ("vllm:num_requests_running", REQUESTS_RUNNING)
_WAITING = ("vllm:num_requests_waiting", REQUESTS_WAITING)
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", GPU_CACHE_USAGE)
# Request headers that describe the client's connection, not its request: never forwarded.
_HOP_BY_HOP = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
     "proxy-authorization", "proxy-connection", "accept-encoding"}
)  # fmt: skip


class HttpBackend:
    """An OpenAI-compatible server (``vllm serve``, SGLang, ``kvstore worker``), reached over HTTP."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        model: str | None = None,
        timeout_s: float = 300.0,
        api_key: str | None = None,
        keep_client_auth: bool = True,
    ) -> None:
        """``model``: the name this replica serves, put in each body's ``model`` (the one rewrite; None: none).

        ``api_key``: the replica's own key (vLLM's ``--api-key``), sent as ``Authorization: Bearer`` with every
        forwarded request and every poll. ``keep_client_auth`` False: the client's ``Authorization`` -- the
        router's own key, when ``router.api_key`` is set -- is never passed on to the replica.
        """
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._drop = _HOP_BY_HOP if keep_client_auth and not api_key else _HOP_BY_HOP | {"authorization"}
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=5.0), headers=self._auth
        )
        self._relay = UpstreamPool(self.base_url, timeout_s=timeout_s)  # the hot path: see kvstore.router.upstream

    async def forward(self, target: str, body: bytes, headers: Mapping[str, str]) -> Forwarded:
        """POST ``body`` to ``target`` (the client's path and ``?query``) unchanged; the answer comes back unread.

        ``headers`` are the client's, every (name, value) pair its ``items()`` gives -- a repeated header
        repeated (Starlette's Headers give them so) -- less those about its connection. Any answer with a
        status line is returned as it came, a 5xx too. Raises ReplicaUnavailable when there was none (refused,
        reset, malformed), ReplicaTimedOut when the request went out and none came in time (its connection
        closed: vLLM aborts it).
        """
        drop = self._drop
        sent = [(name, value) for name, value in headers.items() if name.lower() not in drop]
        sent += self._auth.items()
        if self.model is not None:
            body = _with_model(body, self.model)
        try:
            answer = await self._relay.post(target, body, sent)
        except UpstreamTimeout as exc:
            raise ReplicaTimedOut(f"{self.name}: {exc}") from None
        except UpstreamError as exc:
            raise ReplicaUnavailable(f"{self.name}: {exc}") from None
        return Forwarded(answer.status, answer.headers, answer.body, answer.close, answer.fields)

    async def poll(self) -> ReplicaPoll:
        try:
            response, models = await asyncio.gather(
                self._client.get("/metrics", timeout=5.0), self._client.get("/v1/models", timeout=5.0)
            )
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ReplicaUnavailable(f"{self.name}: metrics unavailable: {exc}") from None
        try:
            load = parse_load(response.text)
        except ValueError as exc:
            raise ReplicaUnavailable(f"{self.name}: unparsable metrics page: {exc}") from None
        return ReplicaPoll(load, response.text, _model_cards(models))

    async def close(self) -> None:
        await self._relay.close()
        await self._client.aclose()


def parse_load(metrics_text: str) -> ReplicaLoad:
    """Running/waiting requests and KV usage from a Prometheus text page (vLLM or kvstore names)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)

    def first(names: tuple[str, ...]) -> float:
        value = next((values[n] for n in names if n in values), 0.0)
        # NaN and infinities are legal on a Prometheus page but no load: a NaN cost would leave the scorer
        # no replica to choose (every comparison false), an infinite count is no integer.
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{next(n for n in names if n in values)} is {value}, not a load")
        return value

    return ReplicaLoad(int(first(_RUNNING)), int(first(_WAITING)), float(first(_USAGE)))


_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
# One token of a JSON text, for walking its top level: a string; an opening or closing bracket; a run of anything
# else (numbers, literals, whitespace, commas and colons -- an array of a prompt's token ids is one run).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]|[\]}]|[^"\[\]{}]+')
_KEY_END = re.compile(rb"\s*:\s*")


def _with_model(body: bytes, model: str) -> bytes:
    """``body`` with its ``model`` value replaced by ``model``: only those bytes, every other byte as sent.

    A body with no ``model`` gets ``"model": ...`` as its first field. A body that is no JSON object, or whose
    ``model`` cannot be located, goes unchanged (the replica judges it: a 400 of its own, not ours).
    Duplicate ``model`` keys: the last is replaced -- the one a JSON parser keeps.
    """
    try:
        fields = _TOP_LEVEL.decode(body)
    except (msgspec.DecodeError, ValueError):
        return body
    named = msgspec.json.encode(model)
    if "model" not in fields:
        start = body.index(b"{") + 1  # the first byte that is no whitespace: it decoded as an object
        return body[:start] + b'"model": ' + named + (b", " if fields else b"") + body[start:]
    span = _model_span(body, bytes(fields["model"]))
    if span is None:
        logger.warning("a body's model field could not be located; forwarded without the replica's model name")
        return body
    return body[: span[0]] + named + body[span[1] :]


def _model_span(body: bytes, value: bytes) -> tuple[int, int] | None:
    """Where the last top-level ``"model"`` key's value (``value``, as decoded) lies in ``body``; None if nowhere."""
    found = None
    depth = 0
    for token in _TOKEN.finditer(body):
        first = token[0][:1]
        if first in (b"[", b"{"):
            depth += 1
        elif first in (b"]", b"}"):
            depth -= 1
        elif first == b'"' and depth == 1 and (colon := _KEY_END.match(body, token.end())) is not None:
            try:
                key = msgspec.json.decode(token[0])
            except (msgspec.DecodeError, ValueError):
                return None
            if key == "model":
                found = colon.end()
    if found is None or body[found : found + len(value)] != value:
        return None
    return found, found + len(value)


def _model_cards(response: httpx.Response) -> list[dict[str, Any]]:
    """The ``data`` of a /v1/models answer; [] when the replica has none or it is malformed."""
    if response.status_code != 200:
        return []
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        return []
    return (
        [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]
        if isinstance(data, list)
        else []
    )
