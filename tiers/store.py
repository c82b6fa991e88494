"""TierStore: one node's CPU arena and disk tier for one cache identity.

Workers reach it through the lease protocol (:mod:`~kvstore.tiers.leases`,
driven from a worker by :class:`~kvstore.tiers.link.TierLink`); the store
decides what happens around each lease.

Policy
------
- **Spill (write-back)**: :meth:`reserve` gives write leases on CPU slots;
  the caller copies KV into them and :meth:`commit` publishes them. Making
  room evicts the CPU tier's least recently used unleased blocks; each is
  written to disk (unless it is there already) before its slot is reused,
  so the disk receives exactly what leaves the arena. With
  ``write_through`` every committed block is also written to disk at once.
- **Admission**: a block takes a CPU slot on its ``admit_after_spills``-th
  spill (:class:`~kvstore.tiers.admission.AdmissionFilter`), so one-off
  blocks need not push out reused ones.
- **Lookup / promote**: :meth:`lookup` counts the consecutive blocks held in
  CPU or on disk; :meth:`acquire` leases them in CPU -- reading disk hits
  into CPU slots first, since a worker copies from the arena only -- so the
  caller can copy them into its pool, then :meth:`release`. Disk blocks stay
  on disk when promoted (the disk is the larger, colder copy).
- **Degrading**: nothing here raises for a full, slow or corrupt tier. A
  block that cannot be stored gets no grant (None) and is counted by
  reason; a block that cannot be read ends the hit there. Callers' mistakes
  (malformed blocks, unknown leases) raise typed errors.

Events: the arena and the disk tier record BlockStored / BlockRemoved
(medium CPU / STORAGE, with tokens and parent hashes); the store publishes
them after each operation (and when a late disk I/O settles) through a
ZmqEventPublisher whose snapshot covers both media. With events off (no
``events`` config, or disabled) the recorded events are discarded unbuilt.

Concurrency: drive the store from one asyncio event loop (the tier actor's);
it is bound to the first loop that uses it. The publisher's snapshot runs
on the publisher's thread and only copies what the arena and the disk index
hold (see each for how).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import Medium
from kvstore.publisher import EventEndpoints, NullEventPublisher, Snapshot, ZmqEventPublisher
from kvstore.tiers.admission import AdmissionFilter
from kvstore.tiers.arena import Arena, Lease, LeaseKind
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit, check_blocks, check_tokens
from kvstore.tiers.config import TierConfig
from kvstore.tiers.cpu_arena import new_arena
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_runner import Settled
from kvstore.tiers.errors import InvalidBlockError, TierUnavailableError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.leases import LeaseBook
from kvstore.tiers.shared_memory import ArenaInfo, SharedSlots
from kvstore.tiers.stats import DISK_READ, DISK_WRITE, StoreCounters, TierStats, tier_stats


def default_arena_name(identity: CacheIdentity, owner: str | None = None) -> str:
    """``kvstore-<identity digest>-<owner>``; the owner defaults to this process id."""
    return f"kvstore-{identity.digest()[:16]}-{owner if owner is not None else os.getpid()}"


class TierStore:
    """The CPU arena and disk tier of one node (see the module docstring for the policy)."""

    def __init__(
        self,
        config: TierConfig,
        identity: CacheIdentity,
        *,
        events: EventsConfig | None = None,
        arena_name: str | None = None,
    ) -> None:
        block_bytes = identity.block_bytes
        num_slots = config.cpu_capacity_bytes // block_bytes
        if num_slots < 1:
            raise ConfigError(
                f"tiers.cpu_capacity_bytes ({config.cpu_capacity_bytes}) is smaller than one block "
                f"({block_bytes} bytes for {identity.model}); raise it"
            )
        self.config = config
        self.identity = identity
        slots = SharedSlots.create(
            arena_name or default_arena_name(identity),
            num_slots,
            block_bytes,
            shm_dir=config.shm_dir,
            tag=identity.digest(),
            prefault=config.cpu_prefault,
        )
        self._cpu = new_arena(slots, block_size=identity.block_size)
        self._disk: DiskTier | None = None
        self._publisher: ZmqEventPublisher | NullEventPublisher = NullEventPublisher()
        try:
            if config.disk_dir is not None:
                self._disk = DiskTier(
                    config.disk_dir,
                    identity,
                    capacity_bytes=config.disk_capacity_bytes,
                    deadline_s=config.io_deadline_s,
                    max_concurrent_io=config.max_concurrent_io,
                    direct_io=config.disk_direct_io,
                    fsync=config.disk_fsync,
                )
            if events is not None and events.enabled:
                self._publisher = ZmqEventPublisher(events, snapshot_source=self._snapshot)
        except BaseException:
            if self._disk is not None:
                self._disk.close()
            self._cpu.close()
            raise
        self._admission = AdmissionFilter(config.admit_after_spills, config.admission_window_blocks)
        self._counters = StoreCounters()
        self._leases = LeaseBook(self._cpu, self._counters, block_bytes)
        self._closed = False
        self._events_off = isinstance(self._publisher, NullEventPublisher)
        self._cpu.record_events = not self._events_off  # nobody could read them: not even recorded
        self._publish()  # what the disk scan found, so subscribers from seq 0 see it

    # ----------------------------------------------------------------- queries

    @property
    def arena_info(self) -> ArenaInfo:
        """What a worker on this node passes to ``SharedSlots.attach`` to map the arena."""
        return self._cpu.slots.info

    @property
    def event_endpoints(self) -> EventEndpoints | None:
        """Where this store's events are published; None when events are off."""
        return self._publisher.endpoints

    @property
    def cpu(self) -> Arena:
        return self._cpu

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        """How many consecutive blocks from ``block_hashes[start]`` on are held, and where.

        A hint, not a lease: blocks may go before :meth:`acquire`, which
        also checks tokens (a hash collision is a miss there).
        """
        self._check_open()
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        disk = self._disk
        media: list[Medium] = []
        for block_hash in block_hashes[start:]:
            if block_hash in self._cpu:
                media.append(Medium.CPU)
            elif disk is not None and block_hash in disk:
                media.append(Medium.STORAGE)
            else:
                break
        self._counters.lookups += 1
        self._counters.lookup_blocks += max(len(block_hashes) - start, 0)
        return TierHit(len(media), tuple(media))

    def flush_events(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event batch published so far has been sent; False on timeout."""
        if isinstance(self._publisher, ZmqEventPublisher):
            return self._publisher.flush(timeout_s)
        return True

    def stats(self) -> TierStats:
        return tier_stats(self._cpu, self._disk, self._counters)

    # ------------------------------------------------------------------- spill

    async def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        """Write leases on CPU slots for ``blocks``, in order; None for a block not taken.

        ``arena``: the incarnation of the arena the caller mapped (``ArenaInfo.incarnation``);
        another one raises :class:`~kvstore.tiers.errors.ArenaMovedError` before any lease is granted.

        None means: held already (or being written), not admitted yet, or no
        slot could be freed (all leased, or the disk was too slow to drain
        one) -- each counted. A batch larger than the arena's unleased slots
        gets None beyond them: split large batches (``TierLink.spill``
        does). Commit or release every grant.
        """
        self._check_open()
        self._leases.check_arena(arena)
        admit = None if self._admission.admit_after == 1 else self._admission.admit  # 1: every block
        if admit is None and self._disk is None:  # the common case: one call, room made as it goes
            grants, duplicates, no_slot = self._reserve_checked(blocks)
        else:
            check_blocks(blocks, self.identity.block_size)
            grants, duplicates, no_slot = await self._reserve_staged(blocks, admit)
        self._counters.duplicates += duplicates
        if no_slot:
            self._counters.not_stored["no_free_slot"] += no_slot
        self._publish()
        return grants

    def _reserve_checked(self, blocks: Sequence[BlockMeta]) -> tuple[list[SlotGrant | None], int, int]:
        """:meth:`reserve` in one call of the arena. The C arena checks every block as ``check_blocks`` does before
        it changes anything (the same fields read once, not twice: 0.04 us of a 16 KiB block's 1.4), and a block it
        refuses is named by ``check_blocks``, as on every other path; the Python arena's blocks are checked first."""
        if not self._cpu.native:
            check_blocks(blocks, self.identity.block_size)
            return self._cpu.reserve_grants(blocks, time.perf_counter(), evict=True)
        try:
            return self._cpu.reserve_grants(blocks, time.perf_counter(), evict=True)
        except (TypeError, ValueError, AttributeError) as exc:
            check_blocks(blocks, self.identity.block_size)  # raises InvalidBlockError naming the block
            raise InvalidBlockError(f"malformed block metas: {exc}") from None

    async def _reserve_staged(
        self, blocks: Sequence[BlockMeta], admit: Callable[[int], bool] | None
    ) -> tuple[list[SlotGrant | None], int, int]:
        """:meth:`reserve` with admission or a disk tier: blocks held already are touched, those not admitted
        counted, and room is made (evicted blocks written to disk first) before any slot is taken."""
        cpu, counters = self._cpu, self._counters
        held = cpu.held_among([meta.block_hash for meta in blocks])
        duplicates = 0
        wanted: list[int] = []
        for index, meta in enumerate(blocks):
            if meta.block_hash in held:
                cpu.touch(meta.block_hash)
                duplicates += 1
            elif admit is not None and not admit(meta.block_hash):
                counters.not_stored["not_admitted"] += 1
            else:
                wanted.append(index)
        await self._make_cpu_room(len(wanted))
        self._check_open()  # closed while the disk drained: grant nothing in an arena that is gone
        # Held or being written by now (a duplicate within the batch, or one that arrived while the room was
        # made): duplicates; the rest get slots while free ones last.
        taken, more, no_slot = cpu.reserve_grants([blocks[index] for index in wanted], time.perf_counter(), evict=False)
        grants: list[SlotGrant | None] = [None] * len(blocks)
        for index, grant in zip(wanted, taken, strict=True):
            grants[index] = grant
        return grants, duplicates + more, no_slot

    async def commit(self, lease_ids: Sequence[int]) -> int:
        """Publish written slots as cached blocks (BlockStored CPU); returns how many.

        With ``write_through`` also writes them to disk before returning.
        Raises LeaseError (changing nothing) if any id is not a live write lease.
        """
        self._check_open()
        write_through = self.config.write_through and self._disk is not None
        count, committed = self._leases.commit(lease_ids, metas=write_through)
        if write_through and committed:
            pinned = [self._cpu.acquire(meta) for meta in committed]
            await self._write_to_disk([lease for lease in pinned if lease is not None])
        self._publish()
        return count

    # ----------------------------------------------------------------- promote

    async def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        """Read leases on the longest held prefix of ``blocks``, disk hits promoted into CPU.

        ``arena`` as for :meth:`reserve`.

        Returns one grant per block of the prefix, in order (``medium`` says
        where each was found). Copy the slots out, then :meth:`release`.
        Considers at most as many blocks as the arena has unleased slots, so
        a shorter answer may mean "no room now": call again with the blocks
        after the prefix until it comes back empty (``TierLink.promote`` does).
        """
        self._check_open()
        self._leases.check_arena(arena)
        block_size = self.identity.block_size
        check_blocks(blocks, block_size, tokens=False)
        cpu, disk = self._cpu, self._disk
        budget = cpu.num_slots - cpu.num_leased_slots
        considered = blocks[:budget]
        # The CPU hits at the front in one call (a prompt's prefix is usually all in CPU), then block by block.
        prefix = cpu.acquire_prefix_grants(considered, time.perf_counter())
        try:  # blocks equal to stored ones were checked when stored; the rest before any of them is used
            check_tokens(blocks[len(prefix) :], block_size)
        except BaseException:
            cpu.release_ids([grant.lease_id for grant in prefix])
            raise
        found: list[Lease | BlockMeta] = []  # after the prefix: a CPU lease, or a block to read from disk
        from_disk: list[BlockMeta] = []
        for meta in considered[len(prefix) :]:
            lease = cpu.acquire(meta)
            if lease is not None:
                found.append(lease)
            elif disk is not None and meta.block_hash in disk:
                found.append(meta)
                from_disk.append(meta)
            else:
                break
        if not found:  # all from CPU (past the prefix, a CPU hit follows a disk hit only)
            if prefix:
                self._counters.hits[Medium.CPU] += len(prefix)
            self._publish()
            return prefix
        try:
            promoted = await self._promote_from_disk(from_disk) if from_disk else {}
        except BaseException:  # cancelled (the caller gave up) or failed: the CPU hits' leases are nobody's now
            if not self._closed:
                cpu.release_ids([grant.lease_id for grant in prefix])
                for item in found:
                    if isinstance(item, Lease):
                        item.release()
            raise
        self._check_open()  # closed while the disk read: its leases went with the arena
        grants = list(prefix)
        for position, item in enumerate(found):
            if isinstance(item, Lease):
                grants.append(SlotGrant(item.lease_id, item.slot, item.meta.block_hash, Medium.CPU))
                continue
            lease = promoted.pop(item.block_hash, None)
            if lease is None:  # the prefix ends at a block that could not be read
                for rest in found[position + 1 :]:
                    if isinstance(rest, Lease):
                        rest.release()
                break
            grants.append(SlotGrant(lease.lease_id, lease.slot, lease.meta.block_hash, Medium.STORAGE))
        cpu.regrant([grant.lease_id for grant in grants], time.perf_counter())  # handed out now
        disk_hits = sum(1 for grant in grants if grant.medium is Medium.STORAGE)
        for medium, count in ((Medium.CPU, len(grants) - disk_hits), (Medium.STORAGE, disk_hits)):
            if count:
                self._counters.hits[medium] += count
        for lease in promoted.values():  # read, but beyond the prefix: stays cached in CPU
            lease.release()
        self._publish()
        return grants

    def release(self, lease_ids: Sequence[int]) -> None:
        """End leases: read leases after copying out, write leases to abandon a reservation.

        Raises LeaseError (changing nothing) if any id is unknown or released.
        """
        self._check_open()
        self._leases.release(lease_ids)
        self._publish()

    # ---------------------------------------------------------------- lifetime

    async def aclose(self) -> None:
        """Let disk I/O settle (one deadline at most), stop events, unlink the arena."""
        if self._closed:
            return
        self._closed = True
        if self._disk is not None:
            await self._disk.aclose()
        self._publisher.close()
        self._cpu.close()

    async def __aenter__(self) -> TierStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def check_invariants(self) -> None:
        self._cpu.check_invariants()
        if self._disk is not None:
            self._disk.check_invariants()

    # ---------------------------------------------------------------- internal

    def _check_open(self) -> None:
        """Refuse a call once :meth:`aclose` has begun: the tier is gone, not the caller mistaken.

        Without it a call that races the close (a commit queued behind it) would find its leases
        dropped with the arena and raise LeaseError, which says the caller misused a lease.
        """
        if self._closed:
            raise TierUnavailableError("the tier store is closed")

    async def _make_cpu_room(self, count: int) -> None:
        """Free slots until ``count`` are free, writing evicted blocks to disk first."""
        shortfall = count - self._cpu.num_free_slots
        if shortfall <= 0:
            return
        disk = self._disk
        if disk is None:
            self._cpu.drop_lru(shortfall)
            return
        # Blocks on disk already are dropped at once; the others are held (read leases) until written.
        writes = self._cpu.evict_lru(shortfall, keep=lambda block_hash: block_hash not in disk)
        await self._write_to_disk(writes)

    async def _write_to_disk(self, leases: list[Lease]) -> None:
        """Write leased slots' blocks to disk, as one batch; each lease ends when its write settles."""
        if not leases:
            return
        disk = self._disk
        assert disk is not None
        started = time.perf_counter()
        writes = [
            (lease.meta, self._cpu.view(lease.slot), self._disk_settled(lease, DISK_WRITE, started)) for lease in leases
        ]
        await disk.write_many(writes)

    async def _promote_from_disk(self, metas: list[BlockMeta]) -> dict[int, Lease]:
        """Read ``metas`` from disk into CPU slots, as one batch; read leases on those that arrived intact."""
        if not metas:
            return {}
        disk = self._disk
        assert disk is not None
        await self._make_cpu_room(len(metas))
        started = time.perf_counter()
        reads = []
        for meta in metas:
            lease = self._cpu.reserve(meta)
            if lease is None:
                break  # no slot (all leased) or being written: the prefix ends here anyway
            reads.append((meta, self._cpu.view(lease.slot), self._disk_settled(lease, DISK_READ, started)))
        answers = await disk.read_many(reads)
        promoted: dict[int, Lease] = {}
        for (meta, _, _), ok in zip(reads, answers, strict=True):
            lease = self._cpu.acquire(meta) if ok else None
            if lease is not None:
                promoted[meta.block_hash] = lease
        return promoted

    def _disk_settled(self, lease: Lease, direction: str, started: float) -> Settled:
        """The ``on_settled`` of a disk I/O staged through ``lease``'s slot: it ends the lease and counts the bytes.

        A write stages through a read lease (the evicted or written-through block), released either
        way. A read stages into a write lease, committed if the block arrived intact -- even after the
        caller's deadline, a verified read still lands in the CPU tier -- and released otherwise.
        """

        def done(ok: bool) -> None:
            if self._closed:  # settled after aclose() gave up waiting: the arena is gone
                return
            if ok and lease.kind is LeaseKind.WRITE:
                self._cpu.commit(lease.lease_id)
            else:
                lease.release()
            if ok:
                self._counters.offload_bytes[direction] += self.identity.block_bytes
                self._counters.offload_seconds[direction].observe(time.perf_counter() - started)
            self._publish()

        return done

    def _snapshot(self) -> Snapshot:
        # Seq first: every batch up to it was published after its mutation, so the copy reflects it.
        seq = self._publisher.last_seq
        events = self._cpu.snapshot_events()
        if self._disk is not None:
            events += self._disk.snapshot_events()
        return Snapshot(seq, events)

    def _publish(self) -> None:
        if self._events_off:  # no subscriber can exist: the events are never built
            self._cpu.discard_events()
            if self._disk is not None:
                self._disk.discard_events()
            return
        events = self._cpu.take_events()
        if self._disk is not None:
            events += self._disk.take_events()
        if events and not self._closed:
            self._publisher.publish(events)
