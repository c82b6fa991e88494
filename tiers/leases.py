"""The lease protocol: how processes outside the tier copy into and out of arena slots safely.

A worker never touches the tier's index. It maps the arena by name and
asks the store for slots; what it gets back are leases
(:class:`~kvstore.tiers.blocks.SlotGrant`):

- spill: ``reserve`` -> write grants on free slots -> the worker copies
  into them -> ``commit`` publishes them as cached blocks (or ``release``
  abandons them);
- promote: ``acquire`` -> read grants on cached slots -> the worker copies
  out -> ``release``.

A leased slot is never evicted or reused (:mod:`~kvstore.tiers.cpu_arena`
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
from operator import attrgetter

from kvstore.events import Medium
from kvstore.tiers.blocks import SlotGrant, make_grants
from kvstore.tiers.cpu_arena import CpuArena, Lease, LeaseKind
from kvstore.tiers.errors import ArenaMovedError
from kvstore.tiers.stats import PROMOTE, SPILL, StoreCounters

_LEASE_ID, _SLOT, _BLOCK_HASH = attrgetter("lease_id"), attrgetter("slot"), attrgetter("meta.block_hash")


class LeaseBook:
    """The grants handed out on one arena: their incarnation check, their ending, their timing.

    Mutates the arena's leases and the store's ``counters`` (bytes and seconds
    of spills and promotions). Drive it from the store's event loop.
    """

    def __init__(self, cpu: CpuArena, counters: StoreCounters, block_bytes: int) -> None:
        self._cpu = cpu
        self._counters = counters
        self._block_bytes = block_bytes
        self._native = cpu.native  # the arena's C loops, or None: these follow its choice

    def check_arena(self, arena: int | None) -> None:
        """Raise ArenaMovedError unless ``arena`` is None or the incarnation of the arena the store holds."""
        incarnation = self._cpu.slots.incarnation
        if arena is not None and arena != incarnation:
            raise ArenaMovedError(
                f"the caller mapped arena incarnation {arena:#x}, the tier's is {incarnation:#x}: remap it"
            )

    def grant(self, lease: Lease, medium: Medium, now: float) -> SlotGrant:
        """Hand ``lease`` out (``medium``: where its block was found), its batch granted at ``now``."""
        lease.granted_at = now
        return SlotGrant(lease.lease_id, lease.slot, lease.meta.block_hash, medium)

    def grant_many(self, leases: Sequence[Lease], medium: Medium, now: float) -> list[SlotGrant]:
        """:meth:`grant` each of ``leases``, in order."""
        if self._native is not None:
            return self._native.grant_many(SlotGrant, leases, medium, now)
        for lease in leases:
            lease.granted_at = now
        return make_grants(map(_LEASE_ID, leases), map(_SLOT, leases), map(_BLOCK_HASH, leases), medium)

    def commit(self, lease_ids: Sequence[int]) -> list[Lease]:
        """Publish written slots as cached blocks; returns their leases (now ended).

        Raises LeaseError (changing nothing) if any id is not a live write lease.
        """
        now = time.perf_counter()
        leases = self._cpu.commit_many(lease_ids)  # checks them all before it changes anything
        self._counters.offload_bytes[SPILL] += len(leases) * self._block_bytes
        self._observe(SPILL, leases, LeaseKind.WRITE, now)
        return leases

    def release(self, lease_ids: Sequence[int]) -> None:
        """End leases: read leases after copying out, write leases to abandon a reservation.

        Raises LeaseError (changing nothing) if any id is unknown or ended.
        """
        now = time.perf_counter()
        leases = self._cpu.release_many(lease_ids)  # checks them all before it changes anything
        reads = self._observe(PROMOTE, leases, LeaseKind.READ, now)  # abandoned write leases: no longer timed
        self._counters.offload_bytes[PROMOTE] += reads * self._block_bytes

    def _observe(self, direction: str, leases: Sequence[Lease], kind: LeaseKind, now: float) -> int:
        """The leases of ``kind`` among ``leases`` (ended at ``now``) observed as one ``direction`` offload, from
        the earliest grant among them; returns how many there are."""
        if self._native is not None:
            count, earliest = self._native.earliest_grant(leases, kind)
        else:
            starts = [lease.granted_at for lease in leases if lease.kind is kind]
            count, earliest = len(starts), min((start for start in starts if start is not None), default=None)
        if earliest is not None:
            self._counters.offload_seconds[direction].observe(now - earliest)
        return count
