"""A worker process's side of its node's tier: the mapped arena, a copy engine, a client.

The two operations a worker's offload seam needs, with the lease protocol
done right (every grant committed or released, even when a copy fails):

- :meth:`TierLink.spill` -- inside the block pool's eviction hook: reserve
  slots, copy the pool rows into them, commit. Returns once the bytes are
  in the arena, so the pool may reuse the blocks.
- :meth:`TierLink.promote` -- at admission: lease the longest held prefix,
  let the caller allocate that many pool blocks, copy into them, release
  (in chunks when the prefix is longer than the arena's free slots).

Copies go straight between the worker's pool tensor and the shared arena
(pinned, on a side stream, when the pool is on a GPU); only block metas and
lease ids travel to the tier.

Round trips: a spill waits for one answer (``reserve``) and a promotion
for one per chunk (``acquire``). The ``commit`` after a spill's copy and the
``release`` after a promotion's are sent without waiting
(``commit_later`` / ``release_later``), so the caller need not sit through
a second round trip per call (on small blocks that round trip costs more
than the copy). How the link deals with their answers depends on the client:

- A client that runs one caller's calls in the order sent (``ordered``:
  the tier actor's control socket, a store with no disk run on the
  caller's thread) needs no wait: the tier has run the commit before the
  next reserve. The link's calls take the answers already in and keep
  their errors, never raising them into a later call: they are the
  earlier calls' errors. :meth:`TierLink.collect` returns them, each with
  the op that sent it; :meth:`TierLink.settle` raises the first (the
  others stay for the next collect or settle). At most ``MAX_UNANSWERED``
  answers are left outstanding: past that a call waits for the oldest, so
  an answer that never comes is kept as the client's timeout error (an
  outage, to the worker) rather than left to pile up.
- Any other (a plain Ray actor call, which an async actor may run out of
  order) waits for every answer before each call and each chunk, raising
  the first error there. A chunk's slots are what the next chunk needs; a
  tier that ran the next reserve first would find no slot to give and the
  chunk's blocks would be lost.

The worker's offload thread collects the answers at the start and end of
each store and load, so that each error is counted against the call that
sent it; :meth:`TierLink.close` logs any left. A spill counts its granted
blocks as stored: a commit of live write leases always publishes them all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import NamedTuple, cast

import torch

from kvstore.events import Medium
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit
from kvstore.tiers.client import Pending, TierClient
from kvstore.tiers.copy_engine import CopyEngine
from kvstore.tiers.errors import TierError, TierUnavailableError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.shared_memory import SharedSlots

logger = logging.getLogger(__name__)

# On an ordered client, answers of commits and releases left outstanding before a call waits for the oldest.
MAX_UNANSWERED = 32

# A grant's fields, read by map() over a batch: no Python frame per grant.
_LEASE_ID, _SLOT, _MEDIUM = attrgetter("lease_id"), attrgetter("slot"), attrgetter("medium")


class Promoted(NamedTuple):
    block_ids: tuple[int, ...]  # pool blocks now holding the promoted KV, in prefix order
    media: tuple[Medium, ...]  # where each block came from: CPU or STORAGE


class TierLink:
    """Maps the node's arena by name and moves blocks between it and a pool tensor."""

    def __init__(
        self,
        client: TierClient,
        identity: CacheIdentity,
        *,
        copy_threads: int = 2,
        pin: bool | None = None,
        close_client: bool = False,
    ) -> None:
        """``close_client``: :meth:`close` also closes ``client`` (a RayTierClient made for this link)."""
        self.client = client
        self._close_client = close_client
        self.identity = identity
        info = client.arena_info()
        self.slots = SharedSlots.attach(info.name, shm_dir=info.shm_dir, expect_tag=identity.digest())
        try:
            self.engine = CopyEngine(self.slots.tensor, num_threads=copy_threads, pin=pin)
        except BaseException:
            self.slots.close()
            raise
        self._pending: list[tuple[str, Pending]] = []  # commits and releases sent without waiting, with their op
        self._errors: list[tuple[str, BaseException]] = []  # their errors, collected but not yet reported

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        self._before_call()
        return self.client.lookup(block_hashes, start)

    @property
    def ordered(self) -> bool:
        """Whether the client runs this link's calls at the tier in the order sent (its ``ordered``), so that
        no call waits for an earlier one's answer: the tier has run it first."""
        return bool(getattr(self.client, "ordered", False))

    def settle(self) -> None:
        """Wait for the answers of the commits and releases sent without waiting; raises the first error
        among them (and among those collected but not yet reported)."""
        errors = self.collect(wait=True)
        if errors:
            self._errors[:0] = errors[1:]  # the others stay to be reported: by the next collect() or settle()
            raise errors[0][1]

    def collect(self, *, wait: bool = False) -> list[tuple[str, BaseException]]:
        """The errors of the commits and releases sent without waiting whose answers are in (``wait``: of all
        of them, waiting for each), each with its op (``"commit"`` or ``"release"``), oldest first; returned,
        not raised. Each error is reported once; calls whose answers are still on their way stay pending."""
        self._take(wait=wait)
        errors, self._errors = self._errors, []
        return errors

    def _take(self, *, wait: bool, keep: int | None = None) -> None:
        """Read the answers in (``wait``: all, waiting; ``keep``: at least until no more than ``keep`` are left,
        waiting for the oldest), their errors kept for :meth:`collect`. Once one says the tier timed out or is
        gone, the calls whose answers are not in are dropped rather than waited for, one timeout each."""
        pending = self._pending
        if not pending:
            return
        taken = len(pending)
        if not wait:
            for index, (_, call) in enumerate(pending):
                if not call.done():  # answers come in order on an ordered channel: the rest are on their way too
                    taken = index
                    break
            if keep is not None:
                taken = max(taken, len(pending) - keep)
        self._pending = pending[taken:]
        gone = False
        for op, call in pending[:taken]:
            if gone and not call.done():
                continue  # the tier timed out or went away: waiting for the rest would only time out again
            try:
                call.result()
            except BaseException as exc:  # every answer is read before any error is reported
                self._errors.append((op, exc))
                gone = gone or isinstance(exc, TierUnavailableError)

    def _before_call(self) -> None:
        """What a call needs of the answers before it. An ordered client: only those already in, their errors
        kept for collect() (an earlier call's error is not this call's). Any other: all of them, waited for,
        the first error raised here (the call has done nothing yet)."""
        if self.ordered:
            self._take(wait=False, keep=MAX_UNANSWERED - 1)  # the call may add one: at most MAX_UNANSWERED after it
        else:
            self.settle()

    def spill(self, blocks: Sequence[BlockMeta], pool: torch.Tensor, block_ids: Sequence[int]) -> int:
        """Copy pool rows ``block_ids`` out as ``blocks``; returns how many the tier newly stored.

        Blocks the tier already holds, does not admit, or has no room for
        are skipped (the tier counts them). Batches larger than the arena go
        in arena-sized chunks (the tier writes earlier chunks back to disk to
        make room). Returns after the copies.
        """
        if len(blocks) != len(block_ids):
            raise ValueError(f"{len(blocks)} blocks but {len(block_ids)} block ids")
        stored = 0
        chunk = self.slots.num_slots
        for first in range(0, len(blocks), chunk):
            # A later chunk needs the slots of the one before, which its commit lets the tier write back to
            # disk. An async tier actor need not run a caller's calls in the order sent: a reserve run
            # before that commit finds every slot under a write lease and grants nothing, and those blocks
            # are lost. So unless the client is ordered, each chunk waits for the commits before it, as
            # promote waits for releases.
            self._before_call()
            stored += self._spill_chunk(blocks[first : first + chunk], pool, block_ids[first : first + chunk])
        return stored

    def _spill_chunk(self, blocks: Sequence[BlockMeta], pool: torch.Tensor, block_ids: Sequence[int]) -> int:
        # Every lease names the arena mapped here: a restarted tier re-creates its arena under
        # the same name, and slots of the new one must never be copied through this mapping.
        grants = self.client.reserve(blocks, self.slots.incarnation)
        if len(grants) != len(block_ids):  # a damaged answer: hand back what it granted, copy nothing
            self.client.release([grant.lease_id for grant in grants if grant is not None])
            raise TierError(f"the tier answered {len(grants)} grants for {len(block_ids)} blocks")
        rows: Sequence[int] = block_ids
        if grants.count(None):  # some blocks not taken: copy the others
            rows = [block_id for block_id, grant in zip(block_ids, grants, strict=True) if grant is not None]
            grants = [grant for grant in grants if grant is not None]
            if not grants:
                return 0
        taken = cast("list[SlotGrant]", grants)
        lease_ids = list(map(_LEASE_ID, taken))
        try:
            self.engine.spill(pool, rows, list(map(_SLOT, taken))).result()
        except BaseException:
            self.client.release(lease_ids)
            raise
        self._pending.append(("commit", self.client.commit_later(lease_ids)))
        return len(lease_ids)

    def promote(
        self, blocks: Sequence[BlockMeta], pool: torch.Tensor, allocate: Callable[[int], Sequence[int]]
    ) -> Promoted:
        """Bring the longest held prefix of ``blocks`` into the pool.

        ``allocate(n)`` returns ``n`` pool block ids to fill; it is called
        once per chunk (a prefix longer than the arena's free slots comes in
        several) and may raise -- the leases are released either way, and
        blocks copied by earlier chunks stay in the ids already returned.
        Returns after the copies.
        """
        self._before_call()
        block_ids: list[int] = []
        media: list[Medium] = []
        while len(media) < len(blocks):
            if media:
                # The next chunk needs the slots this one's release frees; an async tier actor need not run
                # a caller's calls in the order sent, so (unless the client is ordered) wait for that release.
                self._before_call()
            grants = self.client.acquire(blocks[len(media) :], self.slots.incarnation)
            if not grants:
                break
            lease_ids = list(map(_LEASE_ID, grants))
            try:
                chunk_ids = tuple(allocate(len(grants)))
                if len(chunk_ids) != len(grants):
                    raise ValueError(f"allocate({len(grants)}) returned {len(chunk_ids)} block ids")
                self.engine.promote(list(map(_SLOT, grants)), pool, chunk_ids).result()
            except BaseException:
                self.client.release(lease_ids)
                raise
            self._pending.append(("release", self.client.release_later(lease_ids)))
            block_ids.extend(chunk_ids)
            media.extend(map(_MEDIUM, grants))
        return Promoted(tuple(block_ids), tuple(media))

    def close(self, *, wait: bool = True) -> None:
        """Collect what is still pending (errors are logged, not raised; ``wait=False``: only the answers
        already in, as after an outage, when waiting would only time out), stop copying, unmap the arena."""
        try:
            for op, exc in self.collect(wait=wait):
                logger.warning("tier link: a %s sent before close failed: %s", op, exc)
        finally:
            self.engine.close()
            self.slots.close()
            closer = getattr(self.client, "close", None)
            if self._close_client and closer is not None:
                closer()
