"""One Prometheus page for the fleet: the replicas' own ``kvstore_*`` metrics, merged.

Each replica serves its metrics (pool usage, prefix-cache hits, preemptions,
tier bandwidth) labelled with its name; the router's health loop keeps the
last page of each. At scrape time these pages are parsed and merged family by
family -- concatenating them would repeat HELP/TYPE lines, which Prometheus
rejects. Only ``kvstore_`` families are merged, so a vLLM replica's own
metrics stay on its own page.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

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


class PageSources:
    """Prometheus pages beside the replicas' (e.g. each node's tier actor), fetched on every health poll."""

    def __init__(self) -> None:
        self._fetch: dict[str, Callable[[], Awaitable[str]]] = {}
        self._pages: dict[str, str] = {}

    def add(self, name: str, fetch: Callable[[], Awaitable[str]]) -> None:
        self._fetch[name] = fetch

    async def poll(self) -> None:
        """Fetch every page; a source that does not answer has no page until it does."""
        sources = list(self._fetch.items())
        pages = await asyncio.gather(*(fetch() for _, fetch in sources), return_exceptions=True)
        for (name, _), page in zip(sources, pages, strict=True):
            if isinstance(page, str):
                self._pages[name] = page
            else:
                self._pages.pop(name, None)
                logger.warning("metrics source %s did not answer: %s", name, page)

    def pages(self) -> list[str]:
        """The last page of every source that answered."""
        return list(self._pages.values())
