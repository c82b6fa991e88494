"""The lease protocol: how processes outside the tier copy into and out of arena slots safely.

A worker never touches the tier's index. It maps the arena by name and
asks the store for slots; what it gets back are leases
(:class:`~kvstore.tiers.blocks.SlotGrant`):

- spill: ``reserve`` -> write grants on free slots -> the worker copies
  into them -> ``commit`` publishes them as cached blocks (or ``release``
  abandons them);
- promote: ``acquire`` -> read grants on cached slots -> the worker copies
  out -> ``release``.

A leased slot is never evicted or reused (:mod:`~kvstore.tiers.arena`
keeps that), which is what makes a copy in another process safe while the
index changes around it. The rules kept here, by :class:`LeaseBook`:

- **The arena incarnation.** Every grant is for the arena incarnation the
  caller mapped. A restarted tier re-creates its arena under the same
  name, and Ray may route an old handle's calls to the new actor without
  any error: a worker still mapping the dead arena would copy through it --
  promotions serving another block's KV, spills committing slots nobody
  wrote. A call naming another incarnation raises ArenaMovedError before
  any lease is granted.
- **Each lease ends once, the right way.** ``commit`` takes write leases
  only; a batch naming an unknown or ended lease, one id twice, or a lease
  of the wrong kind raises LeaseError and changes nothing.
- **What is measured.** A batch's offload latency runs from its first grant
  to its commit (spill) or release (promote): the time a worker's copy
  holds the slots, which is what the ``spill`` / ``promote`` histograms
  show.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.tiers.arena import Arena
from kvstore.tiers.errors import ArenaMovedError
from kvstore.tiers.stats import PROMOTE, SPILL, StoreCounters

if TYPE_CHECKING:
    from kvstore.tiers.blocks import BlockMeta


class LeaseBook:
    """The grants handed out on one arena: their incarnation check, their ending, their timing.

    Mutates the arena's leases and the store's ``counters`` (bytes and seconds
    of spills and promotions). Drive it from the store's event loop.
    """

    def __init__(self, cpu: Arena, counters: StoreCounters, block_bytes: int) -> None:
        self._cpu = cpu
        self._counters = counters
        self._block_bytes = block_bytes

    def check_arena(self, arena: int | None) -> None:
        """Raise ArenaMovedError unless ``arena`` is None or the incarnation of the arena the store holds."""
        incarnation = self._cpu.slots.incarnation
        if arena is not None and arena != incarnation:
            raise ArenaMovedError(
                f"the caller mapped arena incarnation {arena:#x}, the tier's is {incarnation:#x}: remap it"
            )

    def commit(self, lease_ids: Sequence[int], *, metas: bool = False) -> tuple[int, list[BlockMeta] | None]:
        """Publish written slots as cached blocks: (how many, with ``metas`` the blocks committed).

        Raises LeaseError (changing nothing) if any id is not a live write lease.
        """
        now = time.perf_counter()
        count, earliest, committed = self._cpu.commit_ids(lease_ids, metas=metas)
        self._counters.offload_bytes[SPILL] += count * self._block_bytes
        if earliest is not None:
            self._counters.offload_seconds[SPILL].observe(now - earliest)
        return count, committed

    def release(self, lease_ids: Sequence[int]) -> None:
        """End leases: read leases after copying out, write leases to abandon a reservation.

        Raises LeaseError (changing nothing) if any id is unknown or ended.
        """
        now = time.perf_counter()
        reads, earliest = self._cpu.release_ids(lease_ids)  # abandoned write leases: no longer timed
        self._counters.offload_bytes[PROMOTE] += reads * self._block_bytes
        if earliest is not None:
            self._counters.offload_seconds[PROMOTE].observe(now - earliest)
