"""What a replay measured: the numbers (:class:`ReplayReport`), the table, the JSON.

Definitions (every number of the table and JSON):

- throughput: answered-OK requests / wall seconds, and (prompt + output)
  tokens of those requests / wall seconds; wall time runs from the first
  send to the last answer.
- TTFT: the replica's ``kvstore.ttft_s`` (request received by the worker to
  first output token, so queueing at the replica included); latency: the
  client's send-to-answer time. Percentiles interpolate linearly between
  the closest ranks (numpy's default): ``p(q)`` of sorted ``v[0..n-1]`` is
  ``v[i] + (v[i+1] - v[i]) * f`` with ``i + f = (n - 1) * q / 100``.
- cached fraction per medium: prompt tokens served from that medium's cache
  / prompt tokens, over the requests answered OK; ``prefill tokens saved``
  is the sum over media, ``prefill tokens computed`` the rest.
- load per replica: requests it served, and work = prefill tokens it
  computed + tokens it generated (as ``kvstore simulate`` counts work);
  ``max/mean`` over every replica the router listed when the run started,
  idle ones included (1.0 = perfectly even).
- errors: requests not answered OK, by HTTP status or transport error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvstore.benchmarks.replay.client import RunResult
from kvstore.events import MEDIA


class Percentiles(NamedTuple):
    p50: float | None  # None when there were no samples
    p90: float | None
    p99: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation (module docstring); None if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentiles(values: Sequence[float]) -> Percentiles:
    return Percentiles(percentile(values, 50), percentile(values, 90), percentile(values, 99))


def max_over_mean(values: Sequence[float]) -> float | None:
    """``max / mean`` of ``values``; None when empty or all zero."""
    if not values:
        return None
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else None


@dataclass(frozen=True)
class ReplayReport:
    """One replay's results (module docstring for each definition). Immutable; build with :func:`summarize`."""

    label: str
    requests: int  # sent
    succeeded: int  # answered 200
    errors: dict[str, int]  # status or transport error -> requests
    wall_s: float
    prompt_tokens: int  # of the requests answered OK
    output_tokens: int
    cached_tokens: dict[str, int]  # medium -> prompt tokens served from it
    replica_requests: dict[str, int]  # every listed replica, idle ones at 0
    replica_work: dict[str, int]  # prefill tokens computed + output tokens, per replica
    ttft_samples: tuple[float, ...]  # sorted, seconds
    latency_samples: tuple[float, ...]  # sorted, seconds

    @property
    def requests_per_s(self) -> float:
        return self.succeeded / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prefill_tokens_saved(self) -> int:
        return sum(self.cached_tokens.values())

    @property
    def prefill_tokens_computed(self) -> int:
        return self.prompt_tokens - self.prefill_tokens_saved

    @property
    def cached_fraction(self) -> float:
        return self.prefill_tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    def cached_fraction_by_medium(self) -> dict[str, float]:
        total = self.prompt_tokens
        return {medium: (tokens / total if total else 0.0) for medium, tokens in self.cached_tokens.items()}

    @property
    def ttft_s(self) -> Percentiles:
        return percentiles(self.ttft_samples)

    @property
    def latency_s(self) -> Percentiles:
        return percentiles(self.latency_samples)

    @property
    def max_mean_requests(self) -> float | None:
        return max_over_mean(list(self.replica_requests.values()))

    @property
    def max_mean_work(self) -> float | None:
        return max_over_mean(list(self.replica_work.values()))

    def as_json(self, *, samples: bool = True) -> dict[str, Any]:
        """Every number of the report; with ``samples`` also the sorted TTFT and latency samples (ms, 3 decimals)."""
        out: dict[str, Any] = {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "errors": dict(self.errors),
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s,
            "tokens_per_s": self.tokens_per_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_tokens_saved": self.prefill_tokens_saved,
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "cached_fraction": self.cached_fraction,
            "cached_tokens_by_medium": dict(self.cached_tokens),
            "cached_fraction_by_medium": self.cached_fraction_by_medium(),
            "ttft_s": self.ttft_s._asdict(),
            "latency_s": self.latency_s._asdict(),
            "replica_requests": dict(self.replica_requests),
            "replica_work": dict(self.replica_work),
            "max_mean_requests": self.max_mean_requests,
            "max_mean_work": self.max_mean_work,
        }
        if samples:
            out["ttft_ms_sorted"] = [round(v * 1000, 3) for v in self.ttft_samples]
            out["latency_ms_sorted"] = [round(v * 1000, 3) for v in self.latency_samples]
        return out


def summarize(result: RunResult, label: str) -> ReplayReport:
    """The report of one run (module docstring)."""
    ok = [o for o in result.outcomes if o.ok]
    errors = Counter(o.status for o in result.outcomes if not o.ok)
    cached: dict[str, int] = dict.fromkeys(MEDIA, 0)
    replica_requests: dict[str, int] = dict.fromkeys(result.replicas, 0)
    replica_work: dict[str, int] = dict.fromkeys(result.replicas, 0)
    for outcome in ok:
        for medium, tokens in outcome.cached_tokens.items():
            cached[medium] = cached.get(medium, 0) + tokens
        if outcome.replica is not None:
            computed = outcome.prompt_tokens - sum(outcome.cached_tokens.values())
            replica_requests[outcome.replica] = replica_requests.get(outcome.replica, 0) + 1
            replica_work[outcome.replica] = replica_work.get(outcome.replica, 0) + computed + outcome.completion_tokens
    return ReplayReport(
        label=label,
        requests=len(result.outcomes),
        succeeded=len(ok),
        errors=dict(sorted(errors.items())),
        wall_s=result.wall_s,
        prompt_tokens=sum(o.prompt_tokens for o in ok),
        output_tokens=sum(o.completion_tokens for o in ok),
        cached_tokens=cached,
        replica_requests=replica_requests,
        replica_work=replica_work,
        ttft_samples=tuple(sorted(o.ttft_s for o in ok if o.ttft_s is not None)),
        latency_samples=tuple(sorted(o.latency_s for o in ok)),
    )


# --------------------------------------------------------------------- table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _errors(report: ReplayReport) -> str:
    return " ".join(f"{status}:{count}" for status, count in report.errors.items()) or "none"


def table_rows(report: ReplayReport) -> list[tuple[str, str]]:
    """(metric, value) rows of one report, in table order."""
    ttft, latency = report.ttft_s, report.latency_s
    rows = [
        ("requests ok", f"{report.succeeded}/{report.requests}"),
        ("errors", _errors(report)),
        ("throughput req/s", f"{report.requests_per_s:.2f}"),
        ("throughput tokens/s", f"{report.tokens_per_s:,.0f}"),
        ("TTFT p50 ms (replica)", _ms(ttft.p50)),
        ("TTFT p90 ms (replica)", _ms(ttft.p90)),
        ("TTFT p99 ms (replica)", _ms(ttft.p99)),
        ("latency p50 ms (client)", _ms(latency.p50)),
        ("latency p90 ms (client)", _ms(latency.p90)),
        ("latency p99 ms (client)", _ms(latency.p99)),
        ("cached fraction", f"{report.cached_fraction:.3f}"),
    ]
    rows += [(f"  cached {medium}", f"{share:.3f}") for medium, share in report.cached_fraction_by_medium().items()]
    rows += [
        ("prefill tokens saved", f"{report.prefill_tokens_saved:,}"),
        ("prefill tokens computed", f"{report.prefill_tokens_computed:,}"),
    ]
    rows += [(f"requests {name}", f"{count:,}") for name, count in report.replica_requests.items()]
    rows += [
        ("max/mean load (requests)", _ratio(report.max_mean_requests)),
        ("max/mean load (work)", _ratio(report.max_mean_work)),
    ]
    return rows


def format_table(reports: Mapping[str, ReplayReport]) -> str:
    """Reports side by side: one row per metric, one column per report (a single report is one column)."""
    columns = {label: dict(table_rows(report)) for label, report in reports.items()}
    metrics: list[str] = []
    for report in reports.values():
        metrics += [m for m, _ in table_rows(report) if m not in metrics]
    label_width = max(len(m) for m in metrics) + 2
    widths = {label: max(len(label), *(len(v) for v in col.values())) + 2 for label, col in columns.items()}
    lines = [" " * label_width + "".join(f"{label:>{widths[label]}}" for label in columns)]
    for metric in metrics:
        cells = "".join(f"{columns[label].get(metric, '-'):>{widths[label]}}" for label in columns)
        lines.append(f"{metric:<{label_width}}{cells}")
    return "\n".join(lines)
