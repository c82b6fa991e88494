"""One Prometheus page for the fleet: the replicas' and tiers' own ``kvstore_*`` metrics, merged.

This page is the only place Prometheus finds kvstore's metrics: workers and
tier actors serve theirs to the router (each replica labels its series
``replica``, each node's tier ``node``), and the router's health loop keeps
the last page of each. At scrape time these pages are parsed and merged
family by family -- concatenating them would repeat HELP/TYPE lines, which
Prometheus rejects. Only ``kvstore_`` families are merged, so a vLLM
replica's own metrics stay on its own page.

Two pages must never carry the same series: Prometheus would keep one value
and drop the other without a word. The labels above prevent it; should a
page lack them (say, a tier actor of an older version), the merge keeps the
first page's sample and counts the rest in
``kvstore_router_merge_dropped_total{reason="duplicate_series"}``, beside
the pages that did not parse (``reason="unparsable_page"``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "kvstore_"
DROPPED = "kvstore_router_merge_dropped"


class MergedPagesCollector(Collector):
    """Yields the ``kvstore_`` families of every page ``pages()`` returns, merged by name, each series once."""

    def __init__(self, pages: Callable[[], list[str]]) -> None:
        self._pages = pages
        self.unparsable_pages = 0  # pages that did not parse, over every scrape
        self.duplicate_samples = 0  # samples dropped because an earlier page had the same series
        self._warned: set[str] = set()  # families already logged as colliding (once each, not every scrape)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
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
                for sample in family.samples:
                    key = (sample.name, frozenset(sample.labels.items()))
                    if key in seen:
                        self.duplicate_samples += 1
                        if family.name not in self._warned:
                            self._warned.add(family.name)
                            logger.warning(
                                "two metrics pages carry %s%s: the first is kept", sample.name, sample.labels
                            )
                        continue
                    seen.add(key)
                    into.samples.append(sample)
        yield from merged.values()
        dropped = CounterMetricFamily(
            DROPPED, "Samples and pages the merge of the fleet's pages left out.", labels=["reason"]
        )
        dropped.add_metric(["duplicate_series"], self.duplicate_samples)
        dropped.add_metric(["unparsable_page"], self.unparsable_pages)
        yield dropped


class PageSources:
    """Prometheus pages beside the replicas' (e.g. each node's tier actor), fetched on every health poll."""

    def __init__(self) -> None:
        self._fetch: dict[str, Callable[[], Awaitable[str]]] = {}
        self._pages: dict[str, str] = {}
        self._silent: set[str] = set()  # sources whose outage was logged (once), until they answer again

    def add(self, name: str, fetch: Callable[[], Awaitable[str]]) -> None:
        self._fetch[name] = fetch

    async def poll(self) -> None:
        """Fetch every page; a source that does not answer has no page until it does."""
        sources = list(self._fetch.items())
        pages = await asyncio.gather(*(fetch() for _, fetch in sources), return_exceptions=True)
        for (name, _), page in zip(sources, pages, strict=True):
            if isinstance(page, str):
                if name in self._silent:
                    self._silent.discard(name)
                    logger.warning("metrics source %s answers again", name)
                self._pages[name] = page
            else:
                self._pages.pop(name, None)
                if name not in self._silent:  # once per outage, not once per poll
                    self._silent.add(name)
                    logger.warning("metrics source %s did not answer: %s (said once until it answers)", name, page)
                else:
                    logger.debug("metrics source %s still does not answer: %s", name, page)

    def pages(self) -> list[str]:
        """The last page of every source that answered."""
        return list(self._pages.values())
