"""The worker's connector to its node's tiers: an :class:`OffloadConnector` over a TierLink.

- ``on_evict``: the evicted blocks' KV is copied into the node's shared CPU
  arena (write-back) before the pool reuses their memory; the tier actor
  then owns them (CPU, later disk) and publishes them as medium CPU/STORAGE.
- ``promote``: after the GPU prefix hit, the request's next blocks that the
  node's tiers hold are copied into freshly allocated pool blocks, registered
  in the prefix cache, and returned as an extended hit -- the request skips
  their prefill. A block spilled by another worker of the node is promoted
  the same way: the arena is shared.

Failure: a tier that cannot take a block (full) makes the spill a no-op for
that block -- the KV is simply not kept; a promotion that fails leaves the
GPU hit as it was. Neither ever fails the request. Both run on the worker's
step-loop thread under its lock (workers/offload.py).

Tier outage: a call that finds the tier unavailable (its actor dead or
unreachable, or past the call's deadline: ``TierUnavailableError``) takes
the tier *down*: the link is closed (the arena unmapped), spills are
skipped -- the evicted KV is dropped, counted in
``counters.spill_skipped_blocks`` -- and promotions are skipped, so no
request waits on a dead tier. With a ``reconnect`` factory (the Ray worker
looks the node's tier actor up by name), a background thread then retries
with capped exponential backoff until it gets a new link -- a restarted tier
actor, with a fresh arena -- and the next step uses it. Every outage is
counted (``counters.unavailable``), as is every reconnection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import Medium
from kvstore.kv_cache_manager import CacheRequest, PrefixHit
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.errors import TierUnavailableError
from kvstore.tiers.link import TierLink
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.metrics import TierLinkCounters
from kvstore.workers.offload import Promotion

logger = logging.getLogger(__name__)

Reconnect = Callable[[], TierLink]
"""Returns a new link to the node's tier (maps its current arena); raises while there is none."""


class TierOffload:
    """Spills to and promotes from one node's tier actor through a mapped arena.

    ``reserve_blocks`` pool blocks are never taken for promotion, so the
    request itself (and the running ones) still find room to compute.
    ``reconnect`` (optional) builds a new link after an outage; attempts
    start ``backoff_s[0]`` after the outage and back off, doubling, to at
    most ``backoff_s[1]`` apart. Each attempt is bounded by the client's own
    deadline and runs on a background thread, never on the step loop.
    """

    def __init__(
        self,
        link: TierLink | None,
        *,
        reserve_blocks: int = 4,
        reconnect: Reconnect | None = None,
        backoff_s: tuple[float, float] = (0.05, 2.0),
    ) -> None:
        if link is None and reconnect is None:
            raise ValueError("a TierOffload needs a link, or a reconnect factory to get one")
        self.reserve_blocks = reserve_blocks
        self.counters = TierLinkCounters()
        self._link = link
        self._reconnect = reconnect
        self._backoff_s = backoff_s
        self._lock = threading.Lock()  # guards _link swaps, _reconnecting and _closed
        self._reconnecting: threading.Thread | None = None
        self._closed = threading.Event()
        if link is None:
            self._start_reconnecting()

    # ------------------------------------------------------------------ state

    @property
    def link(self) -> TierLink | None:
        """The link in use; None while the tier is down."""
        return self._link

    @property
    def connected(self) -> bool:
        return self._link is not None

    # ------------------------------------------------------------- the seam

    def on_evict(self, blocks: Sequence[KVCacheBlock], kv_pool: KVTensorPool) -> None:
        link = self._link
        if link is None:  # the tier is down: the KV is dropped, as with no tier at all
            self.counters.spill_skipped_blocks += len(blocks)
            return
        try:
            link.spill([BlockMeta.from_pool_block(b) for b in blocks], kv_pool.kv, [b.block_id for b in blocks])
        except TierUnavailableError as exc:
            self.counters.spill_skipped_blocks += len(blocks)
            self._down(link, exc)
        except Exception as exc:  # a tier fault must not stop the GPU pool from reusing its memory
            self.counters.spill_failures += 1
            logger.warning("spill of %d blocks failed, their KV is dropped: %s", len(blocks), exc)

    def promote(
        self, request: CacheRequest, gpu_hit: PrefixHit, block_pool: BlockPool, kv_pool: KVTensorPool
    ) -> Promotion:
        link = self._link
        if link is None:
            self.counters.promote_skipped += 1
            return Promotion(gpu_hit, {})
        size = block_pool.block_size
        first = len(gpu_hit.blocks)
        limit = (request.num_tokens - 1) // size  # a hit never covers the last token
        spare = block_pool.num_free_blocks - sum(1 for b in gpu_hit.blocks if b.ref_cnt == 0) - self.reserve_blocks
        limit = min(limit, first + max(0, spare))
        if limit <= first:
            return Promotion(gpu_hit, {})
        hashes = request.block_hashes
        metas = BlockMeta.chain(hashes[:limit], request.token_ids, size, start=first)
        try:
            if link.lookup([m.block_hash for m in metas]).num_blocks == 0:
                return Promotion(gpu_hit, {})
        except TierUnavailableError as exc:
            self.counters.promote_skipped += 1
            self._down(link, exc)
            return Promotion(gpu_hit, {})
        except Exception as exc:
            self.counters.promote_failures += 1
            logger.warning("tier lookup failed: %s", exc)
            return Promotion(gpu_hit, {})

        block_pool.touch(gpu_hit.blocks)  # allocating below must not evict the GPU hit
        allocated: list[KVCacheBlock] = []

        def allocate(n: int) -> list[int]:
            blocks = block_pool.get_new_blocks(n)
            allocated.extend(blocks)
            return [b.block_id for b in blocks]

        try:
            promoted = link.promote(metas, kv_pool.kv, allocate)
        except TierUnavailableError as exc:  # blocks already copied are dropped: their leases are in doubt
            self.counters.promote_failures += 1
            self._down(link, exc)
            promoted = None
        except Exception as exc:
            self.counters.promote_failures += 1
            logger.warning("promotion failed, serving from the GPU hit only: %s", exc)
            promoted = None
        filled = [] if promoted is None else allocated[: len(promoted.block_ids)]
        unfilled = allocated[len(filled) :]
        blocks = [*gpu_hit.blocks, *filled]
        if filled:
            block_pool.cache_full_blocks(
                blocks, hashes, first, len(blocks), request.token_ids, lora_name=request.lora_name
            )
        # Release everything: allocate_slots takes the extended hit like any other hit.
        block_pool.free_blocks([*unfilled, *reversed(filled), *reversed(gpu_hit.blocks)])
        if not filled or promoted is None:
            return Promotion(gpu_hit, {})
        by_medium = {Medium.CPU: 0, Medium.STORAGE: 0}
        for medium in promoted.media:
            by_medium[medium] = by_medium.get(medium, 0) + size
        return Promotion(PrefixHit(tuple(blocks), len(blocks) * size), by_medium)

    def close(self) -> None:
        """Stop reconnecting and unmap the arena. Idempotent."""
        with self._lock:
            self._closed.set()
            link, self._link = self._link, None
            thread = self._reconnecting
        if thread is not None:
            thread.join(timeout=30)
        if link is not None:
            link.close()

    # ------------------------------------------------------------- outages

    def _down(self, link: TierLink, exc: Exception) -> None:
        """The tier did not answer: stop using ``link`` and (with a factory) start reconnecting."""
        with self._lock:
            if self._link is not link:  # already taken down (or replaced)
                return
            self._link = None
            self.counters.unavailable += 1
        logger.warning("the node's tier is unavailable (%s): spills and promotions are off until it is back", exc)
        try:
            link.close()
        except Exception as close_exc:  # unmapping is best effort; the mapping goes with the process anyway
            logger.info("closing the dead tier's link failed: %s", close_exc)
        self._start_reconnecting()

    def _start_reconnecting(self) -> None:
        with self._lock:
            if self._reconnect is None or self._closed.is_set() or self._reconnecting is not None:
                return
            thread = threading.Thread(target=self._reconnect_loop, name="kv-tier-reconnect", daemon=True)
            self._reconnecting = thread
        thread.start()

    def _reconnect_loop(self) -> None:
        assert self._reconnect is not None
        delay, most = self._backoff_s
        started = time.monotonic()
        while not self._closed.wait(delay):
            try:
                link = self._reconnect()
            except Exception as exc:  # no tier yet (not restarted, still starting): try again later
                self.counters.reconnect_failures += 1
                logger.debug("tier reconnection failed: %s", exc)
                delay = min(delay * 2, most)
                continue
            with self._lock:
                installed = not self._closed.is_set()
                if installed:
                    self._link = link
                    self._reconnecting = None
                    self.counters.reconnects += 1
            if installed:
                logger.warning("reconnected to the node's tier after %.1f s", time.monotonic() - started)
            else:
                link.close()  # closed while connecting
            return
        with self._lock:
            self._reconnecting = None
