"""The node tiers' event streams: subscribing to them, and following a tier that dies or moves.

A tier actor that died serves nothing until it is back, so its CPU and
STORAGE blocks must not attract requests; a restarted one binds new ports,
and a subscription to the old ones would wait forever. So each watched tier
is asked where its streams are on every health poll (:meth:`TierWatch.poll`).

Not thread-safe: called from the router's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvstore.router.index import PrefixIndex
from kvstore.router.streams import ProducerSpec, subscribe
from kvstore.subscriber import EventListener

logger = logging.getLogger(__name__)

TierLocator = Callable[[], Awaitable[tuple[str, str | None]]]
"""Where a tier's event stream is now: (endpoint, replay endpoint). Raises when the tier does not answer."""


class _Watched:
    def __init__(self, locate: TierLocator) -> None:
        self.locate = locate
        self.up = True  # subscribed to the endpoints in its ProducerSpec


class TierWatch:
    """The tier streams subscribed to, and the locators of those to follow."""

    def __init__(self, index: PrefixIndex, listener: EventListener) -> None:
        self._index = index
        self._listener = listener
        self._producers: dict[str, ProducerSpec] = {}
        self._watched: dict[str, _Watched] = {}

    def add(
        self, node: str, producer: ProducerSpec, *, shared_storage: bool = False, locate: TierLocator | None = None
    ) -> None:
        """A node tier's stream: its blocks count for every replica of ``node``.

        With ``shared_storage`` its STORAGE blocks count for every replica of the cluster.
        ``locate``, when given, is asked on every :meth:`poll` where the tier's streams are now.
        """
        self._producers[producer.name] = producer
        self._index.add_producer(producer.name, "tier", node=node, shared_storage=shared_storage, rekey=producer.rekey)
        subscribe(self._listener, producer)
        if locate is not None:
            self._watched[producer.name] = _Watched(locate)

    def producers(self) -> dict[str, ProducerSpec]:
        """The tier streams subscribed to now, by producer name."""
        return dict(self._producers)

    async def poll(self) -> None:
        """Follow every watched tier: down, its blocks leave the index; moved, resubscribe to its new endpoints.

        A new subscription starts with a replay (or a snapshot): what the tier holds.
        """
        watched = list(self._watched.items())
        found = await asyncio.gather(*(watch.locate() for _, watch in watched), return_exceptions=True)
        for (name, watch), where in zip(watched, found, strict=True):
            spec = self._producers[name]
            if isinstance(where, BaseException):
                if watch.up:
                    logger.warning("tier %s did not answer (%s); dropping its blocks from the index", name, where)
                    self._listener.remove_producer(name, reset=True)
                    watch.up = False
                continue
            endpoint, replay_endpoint = where
            moved = (endpoint, replay_endpoint) != (spec.endpoint, spec.replay_endpoint)
            if watch.up and not moved:
                continue
            if watch.up:
                self._listener.remove_producer(name, reset=True)
            if moved:
                spec = spec._replace(endpoint=endpoint, replay_endpoint=replay_endpoint)
                self._producers[name] = spec
            logger.info("tier %s answers at %s; resubscribing", name, endpoint)
            subscribe(self._listener, spec)
            watch.up = True
