"""One Prometheus page for the fleet: the replicas' own ``kvstore_*`` metrics, merged.

Each replica serves its metrics (pool usage, prefix-cache hits, preemptions,
tier bandwidth) labelled with its name; the router's health loop keeps the
last page of each. At scrape time these pages are parsed and merged family by
family -- concatenating them would repeat HELP/TYPE lines, which Prometheus
rejects. Only ``kvstore_`` families are merged, so a vLLM replica's own
metrics stay on its own page.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "kvstore_"


class MergedPagesCollector(Collector):
    """Yields the ``kvstore_`` families of every page ``pages()`` returns, merged by name."""

    def __init__(self, pages: Callable[[], list[str]]) -> None:
        self._pages = pages
        self.unparsable_pages = 0

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for page in self._pages():
            try:
                families = list(text_string_to_metric_families(page))
            except ValueError:
                self.unparsable_pages += 1
                continue
            for family in families:
                if not family.name.startswith(PREFIX) or family.name.startswith("kvstore_router_"):
                    continue
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(family.samples)
        yield from merged.values()
