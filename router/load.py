"""What the router knows about a replica's load, from its own dispatch records.

A router sees when it sends a request and when the response comes back; it
does not see the first token of a non-streamed completion. Counting a
request's prefill tokens until its response returns (the simplest signal)
therefore charges a replica for prefill it finished long ago: a response
also waits for the whole decode, which on a real fleet lasts several times
the prefill. Routing on that signal sends a burst away from replicas that
are only decoding and onto ones whose prefill queue is really full.

:class:`PrefillLoad` is the estimate both the router service and ``kvstore
simulate`` use: a virtual FIFO of the prefill tokens the router dispatched,
draining at the replica's prefill throughput, and never more than the
prefill tokens of requests still in flight::

    backlog(t)      = max(0, busy_until - t) * tokens_per_s
    busy_until     <- max(t, busy_until) + tokens / tokens_per_s   on dispatch
    outstanding(t)  = min(backlog(t), inflight_tokens)

``tokens_per_s`` is configured (``router.prefill_tps``) or learned from
responses that report their timings (prefill tokens / (TTFT - queueing),
an exponential moving average). While it is unknown the estimate is the
in-flight count alone, the conservative bound.

Not thread-safe: the router calls it from its event loop, the simulator
from its one thread.
"""

from __future__ import annotations

_LEARN_WEIGHT = 0.2  # weight of a new throughput sample in the moving average


class PrefillLoad:
    """One replica's outstanding prefill work, in tokens, as the router can estimate it."""

    __slots__ = ("_busy_until", "_fixed", "_tokens_per_s", "inflight_requests", "inflight_tokens")

    def __init__(self, tokens_per_s: float = 0.0) -> None:
        """``tokens_per_s`` > 0 fixes the drain rate; 0 learns it from :meth:`observe`."""
        if tokens_per_s < 0:
            raise ValueError(f"tokens_per_s must be >= 0, got {tokens_per_s}")
        self._fixed = tokens_per_s > 0
        self._tokens_per_s = tokens_per_s
        self._busy_until = 0.0
        self.inflight_requests = 0
        self.inflight_tokens = 0

    @property
    def tokens_per_s(self) -> float:
        """The drain rate in use (0 while none is known)."""
        return self._tokens_per_s

    def dispatched(self, prefill_tokens: int, now: float) -> None:
        """A request with ``prefill_tokens`` still to compute was sent to the replica at ``now``."""
        self.inflight_requests += 1
        self.inflight_tokens += prefill_tokens
        if self._tokens_per_s > 0:
            self._busy_until = max(now, self._busy_until) + prefill_tokens / self._tokens_per_s

    def finished(self, prefill_tokens: int) -> None:
        """The response of a request :meth:`dispatched` with ``prefill_tokens`` came back (or failed)."""
        assert self.inflight_requests > 0 and self.inflight_tokens >= prefill_tokens, "finished more than dispatched"
        self.inflight_requests -= 1
        self.inflight_tokens -= prefill_tokens

    def observe(self, prefill_tokens: int, prefill_s: float) -> None:
        """Learn the drain rate from one request's measured prefill (ignored when the rate is fixed)."""
        if self._fixed or prefill_tokens <= 0 or prefill_s <= 0:
            return
        sample = prefill_tokens / prefill_s
        if self._tokens_per_s == 0:
            self._tokens_per_s = sample
        else:
            self._tokens_per_s += _LEARN_WEIGHT * (sample - self._tokens_per_s)

    def outstanding(self, now: float) -> float:
        """Prefill tokens the replica has likely not computed yet at ``now``."""
        if self._tokens_per_s <= 0:
            return float(self.inflight_tokens)
        backlog = max(0.0, self._busy_until - now) * self._tokens_per_s
        return min(backlog, float(self.inflight_tokens))
