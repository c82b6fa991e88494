"""The PNG of ``kvstore replay --plot``: TTFT CDF, per-replica load, cached fraction -- one series per run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvstore.benchmarks.figures import pyplot, save_figure
from kvstore.benchmarks.replay.report import ReplayReport


def write_plot(reports: Mapping[str, ReplayReport], path: str | Path, *, title: str) -> None:
    """Write a three-panel PNG to ``path``: TTFT CDF (solid: replica TTFT, dotted: client latency),
    requests per replica, and the cached fraction by medium. Raises ConfigError when the file cannot be written."""
    plt = pyplot()
    fig, (cdf, load, cached) = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, report) in enumerate(reports.items()):
        color = colors[i % len(colors)]
        for samples, style, what in ((report.ttft_samples, "-", "TTFT"), (report.latency_samples, ":", "latency")):
            if samples:
                xs = [v * 1000 for v in samples]
                ys = [(k + 1) / len(xs) for k in range(len(xs))]
                cdf.step(xs, ys, style, where="post", color=color, label=f"{label} {what}")
    cdf.set_xscale("log")
    cdf.set_xlabel("ms (log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT (replica, solid) and latency (client, dotted)")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize="small")

    replicas = sorted({name for report in reports.values() for name in report.replica_requests})
    width = 0.8 / max(1, len(reports))
    for i, (label, report) in enumerate(reports.items()):
        xs = [k + (i - (len(reports) - 1) / 2) * width for k in range(len(replicas))]
        counts = [report.replica_requests.get(name, 0) for name in replicas]
        ratio = report.max_mean_requests
        suffix = "" if ratio is None else f" (max/mean {ratio:.2f})"
        load.bar(xs, counts, width, color=colors[i % len(colors)], label=label + suffix)
    most = max((max(r.replica_requests.values(), default=0) for r in reports.values()), default=0)
    load.set_ylim(0, max(1, most) * 1.4)  # room for the legend above the bars
    load.set_xticks(range(len(replicas)), replicas)
    load.set_ylabel("requests served")
    load.set_title("load per replica")
    load.legend(fontsize="small")

    media = [m for m in ("GPU", "CPU", "STORAGE") if any(r.cached_tokens.get(m) for r in reports.values())] or ["GPU"]
    labels = list(reports)
    bottom = [0.0] * len(labels)
    for j, medium in enumerate(media):
        shares = [reports[label].cached_fraction_by_medium().get(medium, 0.0) for label in labels]
        cached.bar(labels, shares, bottom=bottom, color=colors[(len(labels) + j) % len(colors)], label=medium)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    for k, total in enumerate(bottom):
        cached.annotate(f"{total:.1%}", (k, total), ha="center", va="bottom")
    cached.set_ylim(0, max(0.05, max(bottom) * 1.3))
    cached.set_ylabel("prompt tokens served from cache")
    cached.set_title("cached fraction")
    cached.legend(fontsize="small")

    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
