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
than the copy). Their answers are collected by the link's later calls (and
by :meth:`TierLink.close`); an error one of them raised is raised there, so
none is lost. How much a later call waits for them depends on the client:

- A client that runs one caller's calls in the order sent (``ordered``:
  the tier actor's control socket, a store with no disk run on the
  caller's thread) needs no wait: the tier has run the commit before the
  next reserve. A call takes the answers already in and leaves the rest.
- Any other (a plain Ray actor call, which an async actor may run out of
  order) waits for every answer first: a spill or promotion in several
  chunks waits for each chunk's commit or release before it asks for the
  next. Its slots are what the next chunk needs; a tier that ran the next
  reserve first would find no slot to give and the chunk's blocks would be
  lost.

A caller that must know which call failed collects the answers itself
(:meth:`TierLink.collect`, :meth:`TierLink.settle`); the worker's offload
thread does, at the start and end of each store and load. A spill counts
its granted blocks as stored: a commit of live write leases always
publishes them all.
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
from kvstore.tiers.errors import TierError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.shared_memory import SharedSlots

logger = logging.getLogger(__name__)

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

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        self._before_call()
        return self.client.lookup(block_hashes, start)

    @property
    def ordered(self) -> bool:
        """Whether the client runs this link's calls at the tier in the order sent (its ``ordered``), so that
        no call waits for an earlier one's answer: the tier has run it first."""
        return bool(getattr(self.client, "ordered", False))

    def settle(self) -> None:
        """Wait for the answers of the commits and releases sent without waiting; raises the first error."""
        errors = self.collect(wait=True)
        if errors:
            raise errors[0][1]

    def collect(self, *, wait: bool = False) -> list[tuple[str, BaseException]]:
        """The errors of the commits and releases sent without waiting whose answers are in (``wait``: of all
        of them, waiting for each), each with its op (``"commit"`` or ``"release"``), oldest first; returned,
        not raised. The calls collected are forgotten; those still on their way stay for a later collect."""
        pending = self._pending
        if not pending:
            return []
        if wait:
            taken, self._pending = pending, []
        else:
            arrived = len(pending)
            for index, (_, call) in enumerate(pending):
                if not call.done():  # answers come in order on an ordered channel: the rest are on their way too
                    arrived = index
                    break
            taken, self._pending = pending[:arrived], pending[arrived:]
        errors: list[tuple[str, BaseException]] = []
        for op, call in taken:
            try:
                call.result()
            except BaseException as exc:  # every answer is collected before any error is reported
                errors.append((op, exc))
        return errors

    def _before_call(self) -> None:
        """What a call needs of the answers before it: on an ordered client only those already in (their errors
        raised here); on any other all of them, waited for."""
        if not self.ordered:
            self.settle()
            return
        errors = self.collect()
        if errors:
            raise errors[0][1]

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

    def close(self) -> None:
        """Collect what is still pending (an error is logged, not raised), stop copying, unmap the arena."""
        try:
            self.settle()
        except Exception as exc:
            logger.warning("tier link: a commit or release sent before close failed: %s", exc)
        finally:
            self.engine.close()
            self.slots.close()
            closer = getattr(self.client, "close", None)
            if self._close_client and closer is not None:
                closer()
