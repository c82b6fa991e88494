"""The worker's tier backend: an :class:`~kvstore.workers.offload_backend.OffloadBackend` over a TierLink.

- ``store``: cached pool blocks' KV is copied into the node's shared CPU
  arena (write-back: reserve, copy, commit); the tier actor then owns them
  (CPU, later disk) and publishes them as medium CPU/STORAGE.
- ``lookup`` / ``load``: how many of a request's next blocks the node's
  tiers hold, and copying them into pool blocks the step loop allocated
  (``TierLink.promote`` with an ``allocate`` that hands those ids out in
  order). A block spilled by another worker of the node loads the same
  way: the arena is shared.

All three run on the worker's offload thread, never on its step loop (the
Offloader in workers/offload.py owns the pool side: holds, registration,
eviction). A tier that cannot take a block (full) makes the store a no-op
for it -- the KV is simply not kept; a load that fails fills nothing and the
request recomputes. Neither ever fails the request.

Round trips: the link sends a store's commit and a load's releases
without waiting. On a tier that runs one caller's calls in the order sent
(``TierLink.ordered``: the tier actor's control socket, as deployed) a job
does not wait for those answers either -- the tier has run them before the
next job's calls -- so a store ends with its copy, not a round trip later.
The answers are read as they come, at the start and end of each job (the
link keeps the errors of those that arrive in between, never raising them
into a later call), and waited for when the offload thread runs out of
jobs (``idle``), so that a drained worker's stores are in the tier for
every other caller too; one that is an error is counted against the op that
sent it (a commit's as a ``spill_failures``, a release's as a
``promote_failures``) and logged, and one that is an outage takes the tier
down. On any other tier (plain Ray calls) each job waits for its own
answers, and their errors are its own.

Errors: a ``TierUnavailableError`` is an outage (below). Any other error
-- a ``LeaseError`` or ``InvalidBlockError`` is a caller's mistake, not a
tier outage -- is counted (``spill_failures`` / ``promote_failures``) and
re-raised: the offloader logs it with its traceback and treats the job as
having done nothing, and the link stays up.

Tier outage: a call that finds the tier unavailable (its actor dead or
unreachable, or past the call's deadline: ``TierUnavailableError``) takes
the tier *down*: the link is closed (the arena unmapped), stores are
skipped -- the KV is dropped when the block is evicted, counted in
``counters.spill_skipped_blocks`` -- and loads are skipped, so no request
waits on a dead tier. With a ``reconnect`` factory (the Ray worker looks
the node's tier actor up by name), a background thread then retries with
capped exponential backoff until it gets a new link -- a restarted tier
actor, with a fresh arena -- and the next job uses it. Every outage is
counted (``counters.unavailable``), as is every reconnection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvstore.events import Medium
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.errors import TierUnavailableError
from kvstore.tiers.link import TierLink
from kvstore.workers.metrics import TierLinkCounters

logger = logging.getLogger(__name__)

Reconnect = Callable[[], TierLink]
"""Returns a new link to the node's tier (maps its current arena); raises while there is none."""


class TierOffload:
    """An :class:`~kvstore.workers.offload_backend.OffloadBackend` over one node's tier actor, through a mapped arena.

    ``reconnect`` (optional) builds a new link after an outage; attempts
    start ``backoff_s[0]`` after the outage and back off, doubling, to at
    most ``backoff_s[1]`` apart. Each attempt is bounded by the client's own
    deadline and runs on a background thread, never on the step loop.
    """

    def __init__(
        self,
        link: TierLink | None,
        *,
        reconnect: Reconnect | None = None,
        backoff_s: tuple[float, float] = (0.05, 2.0),
    ) -> None:
        if link is None and reconnect is None:
            raise ValueError("a TierOffload needs a link, or a reconnect factory to get one")
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
    # Called only on the worker's offload thread (workers/offload.py), one at a time.

    def lookup(self, blocks: Sequence[BlockMeta]) -> int:
        link = self._answered(self._link)
        if link is None:
            self.counters.promote_skipped += 1
            return 0
        try:
            return link.lookup([m.block_hash for m in blocks]).num_blocks
        except TierUnavailableError as exc:
            self.counters.promote_skipped += 1
            self._down(link, exc)
            return 0

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        link = self._answered(self._link)
        if link is None:  # the tier is down: the KV is dropped, as with no tier at all
            self.counters.spill_skipped_blocks += len(blocks)
            return 0
        try:
            stored = link.spill(blocks, kv, block_ids)
            # The link sends the commit without waiting. On an ordered tier its answer is read when it comes
            # (counted then); on any other it is waited for here, so that its error is this store's.
            if not link.ordered:
                link.settle()
            elif self._answered(link) is None:  # an answer in already (a synchronous tier's always is) said: gone
                self.counters.spill_skipped_blocks += len(blocks)
                return 0
            return stored
        except TierUnavailableError as exc:
            self.counters.spill_skipped_blocks += len(blocks)
            self._down(link, exc)
            return 0
        except Exception:  # not an outage: a fault of ours or the tier's, surfaced by the offloader's log
            self.counters.spill_failures += 1
            raise

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        link = self._answered(self._link)
        if link is None:
            self.counters.promote_skipped += 1
            return ()
        handed = 0

        def allocate(n: int) -> list[int]:  # hands out the pool blocks the step loop allocated, in order
            nonlocal handed
            if handed + n > len(block_ids):
                raise ValueError(f"the tier granted {handed + n} blocks, {len(block_ids)} were asked for")
            ids = list(block_ids[handed : handed + n])
            handed += n
            return ids

        try:
            promoted = link.promote(blocks, kv, allocate)
            if not link.ordered:
                link.settle()  # the releases' answers: an error in them is this load's
            elif self._answered(link) is None:  # gone: the blocks copied are dropped, as below
                self.counters.promote_failures += 1
                return ()
        except TierUnavailableError as exc:  # blocks already copied are dropped: their leases are in doubt
            self.counters.promote_failures += 1
            self._down(link, exc)
            return ()
        except Exception:
            self.counters.promote_failures += 1
            raise
        if list(promoted.block_ids) != list(block_ids[: len(promoted.block_ids)]):
            raise AssertionError(f"the link filled blocks {promoted.block_ids}, not a prefix of {list(block_ids)}")
        return promoted.media

    def idle(self) -> None:
        """The offload thread's queue ran dry: wait for the answers still on their way (an ordered tier's
        commits and releases), counting their errors, so that every store is in the tier for every caller."""
        self._answered(self._link, wait=True)

    def close(self) -> None:
        """Stop reconnecting and unmap the arena. Idempotent."""
        with self._lock:
            self._closed.set()
            link, self._link = self._link, None
            thread = self._reconnecting
        if thread is not None:
            thread.join(timeout=30)
        if link is not None:
            self._count(link.collect(wait=True))  # the last jobs' answers (one timeout at most on a stuck tier)
            link.close()

    def _answered(self, link: TierLink | None, *, wait: bool = False) -> TierLink | None:
        """``link`` once the answers in (of calls this or earlier jobs sent without waiting; ``wait``: all of
        them, waited for) are read: each error counted against its op and logged; None if one says the tier is
        gone (it is taken down)."""
        if link is None:
            return None
        outage = self._count(link.collect(wait=wait))
        if outage is not None:
            self._down(link, outage)
            return None
        return link

    def _count(self, errors: list[tuple[str, BaseException]]) -> TierUnavailableError | None:
        """Count and log the errors of calls sent without waiting, each against its op; returns the first outage
        among them (not counted here: taking the tier down counts it)."""
        outage: TierUnavailableError | None = None
        for op, exc in errors:
            if isinstance(exc, TierUnavailableError):
                outage = outage or exc
                continue
            if op == "commit":
                self.counters.spill_failures += 1
            else:
                self.counters.promote_failures += 1
            logger.error("the tier failed a %s sent without waiting: %s", op, exc, exc_info=exc)
        return outage

    # ------------------------------------------------------------- outages

    def _down(self, link: TierLink, exc: Exception) -> None:
        """The tier did not answer: stop using ``link`` and (with a factory) start reconnecting."""
        with self._lock:
            if self._link is not link:  # already taken down (or replaced)
                return
            self._link = None
            self.counters.unavailable += 1
        logger.warning("the node's tier is unavailable (%s): spills and promotions are off until it is back", exc)
        self._count(link.collect())  # errors the link kept, and answers in: still counted against their ops
        try:
            link.close(wait=False)  # answers still out would only time out on a tier that is gone
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
