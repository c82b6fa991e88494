"""The router's own Prometheus metrics (``kvstore_router_*``), and the collectors of its /metrics page.

The page also carries the event listener's per-producer health and the
fleet's own ``kvstore_*`` families (:mod:`kvstore.router.fleet_metrics`).

Completion requests are counted in ``kvstore_router_requests_total`` with
two labels that each mean one thing: ``code``, the class of the HTTP status
the client got (``2xx``, ``4xx``, ``5xx``), and ``outcome``, how the request
ended -- ``ok`` (answered in full), ``rejected`` (a 4xx: invalid, unknown
model, unauthorised, too large), ``failed`` (a 5xx; or ``code="2xx"`` when a
replica failed after the stream's status went out, the stream then ending
with an error event) and ``cancelled`` (its client went away: ``code="4xx"``
for 499, before any answer; ``code="2xx"`` in the middle of a stream).

Where a request is counted: with :class:`RequestCounting` around the HTTP
app, there, once per request, from the status it sent and whether the client
stayed -- so the front's own refusals (401, 413, 503 with no healthy
replica) count like the rest. Without it (the service driven without its
HTTP front), :meth:`RouterMetrics.finished` counts what the dispatcher
reports, its code the one the front would answer before any byte is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from contextvars import ContextVar
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstore.events import MEDIA, Medium
from kvstore.metrics import EventStreamCollector
from kvstore.router.fleet_metrics import MergedPagesCollector
from kvstore.subscriber import EventListener

Outcome = Literal["ok", "rejected", "failed", "cancelled"]
"""How a request ended: served, refused (4xx), failed (5xx, or after its stream began), or its client went away."""
StatusClass = Literal["2xx", "4xx", "5xx"]
"""The class of the HTTP status a client got (a 3xx counts as 2xx: the router sends none)."""

_CODE: dict[Outcome, StatusClass] = {"ok": "2xx", "rejected": "4xx", "failed": "5xx", "cancelled": "4xx"}
"""What the HTTP front answers for each outcome when it ends a request before any byte (499 for cancelled)."""


class _Request:
    """One request under :class:`RequestCounting`: whether the dispatcher saw it fail after its status went out."""

    __slots__ = ("failed",)

    def __init__(self) -> None:
        self.failed = False


_CURRENT: ContextVar[_Request | None] = ContextVar("kvstore_router_request", default=None)


class RouterMetrics:
    """Counters of routing and dispatch, registered in ``registry`` with the page's other collectors."""

    def __init__(
        self,
        registry: CollectorRegistry,
        listener: EventListener,
        healthy_replicas: Callable[[], float],
        fleet_pages: Callable[[], list[str]],
    ) -> None:
        """``healthy_replicas`` and ``fleet_pages`` are read at scrape time."""
        self._decisions = Counter("kvstore_router_decisions", "Routing decisions.", ["replica"], registry=registry)
        self._route_seconds = Histogram(
            "kvstore_router_route_seconds",
            "Time to choose a replica (hash + lookup + score).",
            registry=registry,
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
        )
        self._requests = Counter(
            "kvstore_router_requests",
            "Completion requests by how they ended (outcome) and the class of the status answered (code).",
            ["outcome", "code"],
            registry=registry,
        )
        self._at_front = False  # True once a RequestCounting counts this service's requests
        self._retries = Counter("kvstore_router_retries", "Requests retried on another replica.", registry=registry)
        self._cached_tokens = Counter(
            "kvstore_router_cached_tokens", "Prompt tokens served from cache, by medium.", ["medium"],
            registry=registry,
        )  # fmt: skip
        for medium in MEDIA:  # a series per medium from the start (zeros in front of a vLLM fleet, which reports none)
            self._cached_tokens.labels(medium)
        healthy = Gauge("kvstore_router_healthy_replicas", "Replicas routed to.", registry=registry)
        healthy.set_function(healthy_replicas)
        registry.register(EventStreamCollector(listener))
        registry.register(MergedPagesCollector(fleet_pages))

    def routed(self, replica: str, seconds: float) -> None:
        self._decisions.labels(replica).inc()
        self._route_seconds.observe(seconds)

    def finished(self, outcome: Outcome) -> None:
        """How the dispatcher (or the app, for a body it refused) saw a request end.

        Under :class:`RequestCounting` the request is counted there, from what
        the client got; only a failure is noted here, the one thing the status
        cannot show (a stream that broke after its 200). Calls from outside any
        request -- an abandoned stream closed later by the garbage collector --
        are dropped: the request was counted when its answer ended.
        """
        if not self._at_front:
            self._requests.labels(outcome, _CODE[outcome]).inc()
            return
        request = _CURRENT.get()
        if request is not None and outcome == "failed":
            request.failed = True

    def answered(self, status: int | None, *, failed: bool, client_left: bool, complete: bool) -> None:
        """Count one request the HTTP front answered (see :class:`RequestCounting` for the arguments)."""
        outcome: Outcome
        code: StatusClass
        if status is None:  # nothing sent: the client left first, or the app raised (the server answers 500)
            outcome, code = ("cancelled", "4xx") if client_left else ("failed", "5xx")
        elif status == 499:
            outcome, code = "cancelled", "4xx"
        elif status >= 500:
            outcome, code = "failed", "5xx"
        elif status >= 400:
            outcome, code = "rejected", "4xx"
        elif not complete and client_left:
            outcome, code = "cancelled", "2xx"
        elif failed or not complete:
            outcome, code = "failed", "2xx"
        else:
            outcome, code = "ok", "2xx"
        self._requests.labels(outcome, code).inc()

    def counted_at_front(self) -> None:
        """From now on requests are counted by a :class:`RequestCounting`, not by :meth:`finished`."""
        self._at_front = True

    def retried(self) -> None:
        self._retries.inc()

    def served_from_cache(self, tokens_by_medium: Mapping[Medium, int]) -> None:
        for medium, tokens in tokens_by_medium.items():
            self._cached_tokens.labels(medium).inc(tokens)


class RequestCounting:
    """ASGI middleware: counts every request to ``paths`` once, in ``metrics``, when its answer is over.

    Add it outermost (``app.add_middleware(RequestCounting, metrics=..., paths=...)``
    after the app's other middleware), so it sees the status of the answers
    they give themselves. It watches what crosses the ASGI boundary: the
    status sent, whether the body's last part went out, and whether the
    client disconnected (or a send to it failed) before that.
    """

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, paths: Collection[str]) -> None:
        self._app = app
        self._metrics = metrics
        self._paths = frozenset(paths)
        metrics.counted_at_front()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self._app(scope, receive, send)
            return
        request = _Request()
        status: int | None = None
        complete = client_left = False

        async def watch_receive() -> Message:
            nonlocal client_left
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:
                client_left = True
            return message

        async def watch_send(message: Message) -> None:
            nonlocal status, complete, client_left
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # After a disconnect, servers drop what is sent (spec 2.3) -- and a middleware between
                # (BaseHTTPMiddleware) still ends the body it relays: that is no complete answer.
                complete = not client_left
            try:
                await send(message)
            except OSError:  # the server's sign that the client is gone (ASGI spec 2.4)
                client_left = True
                complete = False
                raise

        token = _CURRENT.set(request)
        try:
            await self._app(scope, watch_receive, watch_send)
        finally:
            _CURRENT.reset(token)
            self._metrics.answered(status, failed=request.failed, client_left=client_left, complete=complete)
