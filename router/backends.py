"""Replica backends: how the router sends a request to one replica.

Two kinds, one contract (:class:`ReplicaBackend`):

- :class:`RayActorBackend` -- one of our KV worker actors, by handle. It
  speaks the worker's typed contract from the core
  (:mod:`kvstore.worker_api`), so the router needs nothing from ``workers``.
- :class:`HttpBackend` -- any OpenAI-compatible server (vLLM, or our worker's
  HTTP front): ``POST /v1/completions`` with the prompt as token ids, load
  scraped from its Prometheus ``/metrics``.

Errors: :class:`ReplicaUnavailable` means the replica failed before
returning anything (dead, unreachable, 5xx) and the request may be retried
elsewhere; :class:`ReplicaRejected` means the replica refused the request
itself (4xx) and retrying elsewhere would not help.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvstore.errors import InvalidRequestError
from kvstore.events import MEDIA, Medium
from kvstore.metrics import GPU_CACHE_USAGE, REQUESTS_RUNNING, REQUESTS_WAITING
from kvstore.worker_api import GenerateRequest, GenerateResult, WorkerLoad


class ReplicaUnavailable(Exception):
    """The replica failed before producing a response; safe to retry elsewhere."""


class ReplicaRejected(Exception):
    """The replica refused the request as invalid; do not retry."""


class ReplicaLoad(NamedTuple):
    running: int
    waiting: int
    kv_usage: float  # 0..1


class ReplicaPoll(NamedTuple):
    load: ReplicaLoad
    metrics_text: str  # the replica's Prometheus page ("" when it has none)


class ReplicaResult(NamedTuple):
    output_token_ids: list[int] | None  # None when the replica returns text only
    text: str | None  # None when the router should detokenise output_token_ids
    prompt_tokens: int
    cached_tokens_by_medium: dict[Medium, int]
    queue_s: float | None
    ttft_s: float | None
    total_s: float
    finish_reason: str

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_tokens_by_medium.values())


class ReplicaBackend(Protocol):
    name: str

    async def generate(
        self,
        token_ids: list[int],
        max_tokens: int,
        *,
        request_id: str,
        cache_salt: str | None,
        lora_name: str | None,
    ) -> ReplicaResult: ...

    async def poll(self) -> ReplicaPoll:
        """Load and metrics, for the health loop; raises ReplicaUnavailable when it does not answer."""
        ...

    async def close(self) -> None: ...


class RayActorBackend:
    """A KV worker Ray actor. Any Ray error (actor died, node lost) is ReplicaUnavailable."""

    def __init__(self, name: str, handle: Any, *, timeout_s: float = 300.0) -> None:
        """``handle``: the worker actor's (Ray handles are untyped)."""
        self.name = name
        self._handle = handle
        self._timeout = timeout_s

    async def generate(
        self,
        token_ids: list[int],
        max_tokens: int,
        *,
        request_id: str,
        cache_salt: str | None,
        lora_name: str | None,
    ) -> ReplicaResult:
        import ray.exceptions  # here, not at the top: routers with HTTP replicas only never load Ray

        request = GenerateRequest(
            token_ids=token_ids,
            max_tokens=max_tokens,
            request_id=request_id,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )
        try:
            result: GenerateResult = await asyncio.wait_for(self._handle.generate.remote(request), self._timeout)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, InvalidRequestError):
                raise ReplicaRejected(str(cause.args[0] if cause.args else cause)) from None
            raise ReplicaUnavailable(f"{self.name}: {type(cause).__name__}: {cause}") from None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ReplicaUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from None
        by_medium = {m: result.cached_tokens_by_medium.get(m, 0) for m in MEDIA}
        return ReplicaResult(
            output_token_ids=result.output_token_ids,
            text=None,
            prompt_tokens=result.prompt_tokens,
            cached_tokens_by_medium=by_medium,
            queue_s=result.queue_s,
            ttft_s=result.ttft_s,
            total_s=result.total_s,
            finish_reason="length",
        )

    async def poll(self) -> ReplicaPoll:
        import ray.exceptions

        try:
            polled: tuple[WorkerLoad, bytes] = await asyncio.wait_for(
                asyncio.gather(self._handle.load.remote(), self._handle.metrics_text.remote()), 5.0
            )
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ReplicaUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from None
        load, page = polled
        return ReplicaPoll(ReplicaLoad(load.running, load.waiting, load.kv_usage), page.decode())

    async def close(self) -> None:
        return None


# Names vLLM (old and new) and kvstore workers use for the load signals.
_RUNNING = ("vllm:num_requests_running", REQUESTS_RUNNING)
_WAITING = ("vllm:num_requests_waiting", REQUESTS_WAITING)
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", GPU_CACHE_USAGE)


class HttpBackend:
    """An OpenAI-compatible completions server, e.g. ``vllm serve``."""

    def __init__(self, name: str, base_url: str, *, model: str | None = None, timeout_s: float = 300.0) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def generate(
        self,
        token_ids: list[int],
        max_tokens: int,
        *,
        request_id: str,
        cache_salt: str | None,
        lora_name: str | None,
    ) -> ReplicaResult:
        body: dict[str, Any] = {"prompt": token_ids, "max_tokens": max_tokens, "temperature": 0.0}
        model = lora_name or self.model
        if model:
            body["model"] = model
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        start = time.monotonic()
        try:
            response = await self._client.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})
        except httpx.HTTPError as exc:
            raise ReplicaUnavailable(f"{self.name}: {type(exc).__name__}: {exc}") from None
        elapsed = time.monotonic() - start
        if 400 <= response.status_code < 500:
            raise ReplicaRejected(_error_message(response))
        if response.status_code != 200:
            raise ReplicaUnavailable(f"{self.name}: HTTP {response.status_code}: {_error_message(response)}")
        try:
            data = response.json()
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            ours = data.get("kvstore") or {}
            by_medium = {m: 0 for m in MEDIA}
            if isinstance(ours.get("cached_tokens"), dict):
                by_medium.update({m: int(ours["cached_tokens"].get(m, 0)) for m in MEDIA})
            else:
                by_medium[Medium.GPU] = int(details.get("cached_tokens") or 0)
            return ReplicaResult(
                output_token_ids=choice.get("token_ids"),
                text=str(choice.get("text", "")),
                prompt_tokens=int(usage.get("prompt_tokens", len(token_ids))),
                cached_tokens_by_medium=by_medium,
                queue_s=ours.get("queue_s"),
                ttft_s=ours.get("ttft_s"),
                total_s=elapsed,
                finish_reason=str(choice.get("finish_reason") or "length"),
            )
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ReplicaUnavailable(f"{self.name}: malformed completion response: {exc}") from None

    async def poll(self) -> ReplicaPoll:
        try:
            response = await self._client.get("/metrics", timeout=5.0)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ReplicaUnavailable(f"{self.name}: metrics unavailable: {exc}") from None
        try:
            return ReplicaPoll(parse_load(response.text), response.text)
        except ValueError as exc:
            raise ReplicaUnavailable(f"{self.name}: unparsable metrics page: {exc}") from None

    async def close(self) -> None:
        await self._client.aclose()


def parse_load(metrics_text: str) -> ReplicaLoad:
    """Running/waiting requests and KV usage from a Prometheus text page (vLLM or kvstore names)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)

    def first(names: tuple[str, ...]) -> float:
        return next((values[n] for n in names if n in values), 0.0)

    return ReplicaLoad(int(first(_RUNNING)), int(first(_WAITING)), float(first(_USAGE)))


def _error_message(response: httpx.Response) -> str:
    try:
        data = response.json()
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(data, dict) and "detail" in data:
            return str(data["detail"])
    except ValueError:
        pass
    return response.text[:500]
