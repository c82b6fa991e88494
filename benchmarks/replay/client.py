"""The load generator of ``kvstore replay``: sends a workload to a router and records each outcome.

One asyncio loop and one ``httpx.AsyncClient``. Three schedules
(:class:`Schedule`):

- ``trace``: request ``i`` is sent at its trace arrival time divided by
  ``speedup`` (open loop: a slow answer does not delay later sends);
- ``rate``: request ``i`` is sent at ``i / rate`` seconds (open loop);
- ``concurrency``: ``C`` clients, each sending its next request when its
  previous one is answered (closed loop).

Every request is ``POST /v1/completions`` with the prompt as token ids. An
answer is recorded whatever it is: an HTTP error by its status code, a
transport failure by the exception's class name. Nothing is retried -- a
replay measures the service, errors included.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple

import httpx
from tqdm import tqdm

from kvstore.benchmarks.replay.workload import ReplayRequest, Workload
from kvstore.errors import ConfigError

ScheduleMode = Literal["trace", "rate", "concurrency"]


class Schedule(NamedTuple):
    """When requests are sent (module docstring). Build with :func:`make_schedule`, which validates."""

    mode: ScheduleMode
    value: float  # trace: speedup; rate: requests per second; concurrency: clients

    def describe(self) -> str:
        if self.mode == "trace":
            return f"trace timestamps / {self.value:g}"
        if self.mode == "rate":
            return f"{self.value:g} requests/s"
        return f"{int(self.value)} concurrent clients"


def make_schedule(
    *, rate: float | None, concurrency: int | None, speedup: float | None, has_timestamps: bool
) -> Schedule:
    """The schedule the flags ask for; raises ConfigError for a contradictory or out-of-range choice."""
    if rate is not None and concurrency is not None:
        raise ConfigError("--rate and --concurrency are exclusive: pass one of them")
    if speedup is not None and (rate is not None or concurrency is not None):
        raise ConfigError("--speedup compresses trace timestamps; it does not apply with --rate or --concurrency")
    if rate is not None:
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"--rate must be > 0 requests/s, got {rate}")
        return Schedule("rate", rate)
    if concurrency is not None:
        if concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
        return Schedule("concurrency", float(concurrency))
    if not has_timestamps:
        raise ConfigError("this workload has no timestamps: pass --rate R or --concurrency C")
    speedup = 1.0 if speedup is None else speedup
    if not (math.isfinite(speedup) and speedup > 0):
        raise ConfigError(f"--speedup must be > 0, got {speedup}")
    return Schedule("trace", speedup)


class Outcome(NamedTuple):
    """What one request got. Token and cache fields are 0 / empty unless ``status == "200"``."""

    status: str  # HTTP status code, or the transport error's class name (e.g. "ConnectError")
    prompt_tokens: int  # tokens sent
    completion_tokens: int
    cached_tokens: dict[str, int]  # prompt tokens served from cache, by medium (GPU, CPU, STORAGE)
    replica: str | None  # the replica that served it (the router's kvstore.replica)
    ttft_s: float | None  # the replica's time to first token (kvstore.ttft_s)
    latency_s: float  # client side: send to complete answer (the whole completion; no streaming)
    sent_at_s: float  # seconds after the run started

    @property
    def ok(self) -> bool:
        return self.status == "200"


class RunResult(NamedTuple):
    outcomes: list[Outcome]  # one per request, in workload order
    wall_s: float  # first send to last answer
    replicas: list[str]  # the router's replicas when the run started


def check_url(url: str) -> str:
    """``url`` without a trailing slash; raises ConfigError unless it is an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ConfigError(f"--url {url!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"--url must be http://HOST:PORT of a kvstore router, got {url!r}")
    return url.rstrip("/")


async def fetch_replicas(client: httpx.AsyncClient) -> list[str]:
    """The router's replica names (``GET /workers``); raises ConfigError when it is not a reachable router."""
    where = f"{client.base_url}"
    try:
        response = await client.get("/workers")
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach the router at {where}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise ConfigError(f"{where} is not a kvstore router: GET /workers answered HTTP {response.status_code}")
    try:
        names = [str(w["name"]) for w in response.json()["workers"]]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{where} is not a kvstore router: GET /workers did not list workers") from None
    if not names:
        raise ConfigError(f"the router at {where} has no replicas")
    return names


async def run_replay(
    url: str,
    workload: Workload,
    schedule: Schedule,
    *,
    timeout_s: float = 600.0,
    progress: bool = True,
    api_key: str | None = None,
    label: str = "replay",
) -> RunResult:
    """Send every request of ``workload`` to the router at ``url`` on ``schedule``; record each outcome.

    Raises ConfigError before sending anything when ``url`` is not a
    reachable kvstore router; afterwards every failure is an outcome.
    """
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=check_url(url), timeout=timeout_s, limits=limits, headers=headers) as client:
        replicas = await fetch_replicas(client)
        requests = workload.requests
        outcomes: list[Outcome | None] = [None] * len(requests)
        with tqdm(total=len(requests), desc=label, unit="req", disable=not progress, dynamic_ncols=True) as bar:
            started = time.perf_counter()
            errors = 0

            async def send(index: int) -> None:
                nonlocal errors
                outcome = await _send(client, requests[index], started)
                outcomes[index] = outcome
                errors += not outcome.ok
                bar.update(1)
                if errors:
                    bar.set_postfix(errors=errors, refresh=False)

            await _drive(schedule, requests, send)
            wall = time.perf_counter() - started
    assert all(o is not None for o in outcomes)
    return RunResult([o for o in outcomes if o is not None], wall, replicas)


async def _drive(schedule: Schedule, requests: list[ReplayRequest], send: Callable[[int], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    if schedule.mode == "concurrency":
        next_index = iter(range(len(requests)))

        async def client_loop() -> None:
            for index in next_index:  # a shared iterator: each index is taken by exactly one client
                await send(index)

        await asyncio.gather(*(client_loop() for _ in range(int(schedule.value))))
        return

    async def at(index: int, offset_s: float) -> None:
        delay = start + offset_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(index)

    if schedule.mode == "rate":
        offsets = [i / schedule.value for i in range(len(requests))]
    else:
        first = min((r.arrival_s for r in requests if r.arrival_s is not None), default=0.0)
        offsets = [((first if r.arrival_s is None else r.arrival_s) - first) / schedule.value for r in requests]
    await asyncio.gather(*(at(i, offset) for i, offset in enumerate(offsets)))


async def _send(client: httpx.AsyncClient, request: ReplayRequest, started: float) -> Outcome:
    sent = time.perf_counter()
    body = {"prompt": request.token_ids, "max_tokens": request.max_tokens}
    prompt_tokens = len(request.token_ids)

    def failed(status: str) -> Outcome:
        return Outcome(status, prompt_tokens, 0, {}, None, None, time.perf_counter() - sent, sent - started)

    try:
        response = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return failed(type(exc).__name__)
    latency = time.perf_counter() - sent
    if response.status_code != 200:
        return failed(str(response.status_code))
    try:
        data: dict[str, Any] = response.json()
        usage = data["usage"]
        ours = data.get("kvstore") or {}
        if "cached_tokens" in ours:
            cached = {str(m): int(n) for m, n in ours["cached_tokens"].items()}
        else:  # a plain OpenAI server (e.g. vLLM): the total only
            cached = {"unattributed": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}
        ttft = ours.get("ttft_s")
        return Outcome(
            "200",
            prompt_tokens,
            int(usage.get("completion_tokens") or 0),
            cached,
            ours.get("replica"),
            None if ttft is None else float(ttft),
            latency,
            sent - started,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return failed("bad_response")
