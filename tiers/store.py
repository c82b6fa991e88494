"""TierStore: one node's CPU arena and disk tier for one cache identity.

Policy
------
- **Spill (write-back)**: :meth:`reserve` gives write leases on CPU slots;
  the caller copies KV into them and :meth:`commit` publishes them
  (:meth:`put` does all three with the store's own copy engine). Making
  room evicts the CPU tier's least recently used unleased blocks; each is
  written to disk (unless it is there already) before its slot is reused.
  With ``write_through`` every committed block is also written to disk at
  once.
- **Admission**: a block takes a CPU slot on its ``admit_after_spills``-th
  spill (:class:`~kvstore.tiers.admission.AdmissionFilter`).
- **Lookup / promote**: :meth:`lookup` counts the consecutive blocks held in
  CPU or on disk; :meth:`acquire` leases them in CPU -- reading disk hits
  into CPU slots first -- so the caller can copy them into its pool, then
  :meth:`release` (:meth:`get` does it all with the store's copy engine).
  Disk blocks stay on disk when promoted (the disk is the larger, colder
  copy).
- **Degrading**: nothing here raises for a full, slow or corrupt tier. A
  block that cannot be stored gets no grant (None) and is counted by
  reason; a block that cannot be read ends the hit there. Callers' mistakes
  (malformed blocks or tensors, unknown leases) raise typed errors.

Events: the arena and the disk tier record BlockStored / BlockRemoved
(medium CPU / STORAGE, with tokens and parent hashes); the store publishes
them after each operation (and when a late disk I/O settles) through a
ZmqEventPublisher whose snapshot covers both media.

Concurrency: drive the store from one asyncio event loop (the tier actor's);
it is bound to the first loop that uses it. The publisher's snapshot runs
on the publisher's thread and only copies the indexes under their locks.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import NamedTuple

import torch

from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import Medium
from kvstore.publisher import EventEndpoints, NullEventPublisher, Snapshot, ZmqEventPublisher
from kvstore.tiers.admission import AdmissionFilter
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierGet, TierHit, check_blocks
from kvstore.tiers.config import TierConfig
from kvstore.tiers.copy_engine import CopyEngine, block_rows
from kvstore.tiers.cpu_arena import CpuArena, Lease, LeaseKind
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_runner import Settled
from kvstore.tiers.errors import ArenaMovedError, InvalidBlockError, LeaseError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.shared_memory import ArenaInfo, SharedSlots
from kvstore.tiers.stats import DISK_READ, DISK_WRITE, PROMOTE, SPILL, StoreCounters, TierStats

_CHUNK_BYTES = 64 * 1024 * 1024  # measured: smaller chunks cost more in hand-offs than overlap saves


def _rows(rows: Sequence[int] | None, count: int, limit: int) -> Sequence[int]:
    """The tensor rows of ``count`` blocks (default ``0..count-1``), checked against ``limit`` rows."""
    if rows is None:
        if count > limit:
            raise InvalidBlockError(f"{count} blocks but the tensor has {limit} rows")
        return range(count)
    if len(rows) != count:
        raise InvalidBlockError(f"{count} blocks but {len(rows)} rows")
    for row in rows:
        if not 0 <= row < limit:
            raise InvalidBlockError(f"row {row} is outside the tensor's 0..{limit - 1}")
    return rows


class _Copy(NamedTuple):
    future: Future[None]  # the copy engine's batch
    lease_ids: list[int]  # the leases it copies into (spill) or out of (promote)


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
        self._cpu = CpuArena(slots, block_size=identity.block_size)
        self._disk: DiskTier | None = None
        self._engine: CopyEngine | None = None
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
            self._engine = CopyEngine(slots.tensor, num_threads=config.copy_threads)
            if events is not None and events.enabled:
                self._publisher = ZmqEventPublisher(events, snapshot_source=self._snapshot)
        except BaseException:
            if self._engine is not None:
                self._engine.close()
            if self._disk is not None:
                self._disk.close()
            self._cpu.close()
            raise
        self._admission = AdmissionFilter(config.admit_after_spills, config.admission_window_blocks)
        self._counters = StoreCounters()
        self._lease_started: dict[int, float] = {}
        self._closed = False
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
    def cpu(self) -> CpuArena:
        return self._cpu

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        """How many consecutive blocks from ``block_hashes[start]`` on are held, and where.

        A hint, not a lease: blocks may go before :meth:`acquire`, which
        also checks tokens (a hash collision is a miss there).
        """
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
        cpu, disk, counters = self._cpu, self._disk, self._counters
        usage = {Medium.CPU: cpu.used_bytes}
        capacity = {Medium.CPU: cpu.capacity_bytes}
        blocks = {Medium.CPU: cpu.num_blocks}
        not_stored = {Medium.CPU: dict(counters.not_stored)}
        evictions = {Medium.CPU: cpu.num_evictions}
        collisions = {Medium.CPU: cpu.num_collisions}
        disk_errors: dict[str, int] = {}
        integrity: dict[str, int] = {}
        scan_removed: dict[str, int] = {}
        io_mode = "off"
        if disk is not None:
            usage[Medium.STORAGE] = disk.used_bytes
            capacity[Medium.STORAGE] = disk.limit_bytes
            blocks[Medium.STORAGE] = disk.num_blocks
            not_stored[Medium.STORAGE] = dict(disk.counters.not_stored)
            evictions[Medium.STORAGE] = disk.counters.evictions
            collisions[Medium.STORAGE] = disk.counters.collisions
            disk_errors = dict(disk.counters.io_errors)
            disk_errors.update({f"deadline_{op}": n for op, n in disk.counters.deadline_expired.items()})
            integrity = dict(disk.counters.integrity_failures)
            scan_removed = dict(disk.counters.scan_removed)
            io_mode = disk.io_mode
        return TierStats(
            usage_bytes=usage,
            capacity_bytes=capacity,
            blocks=blocks,
            hits=dict(counters.hits),
            lookups=counters.lookups,
            lookup_blocks=counters.lookup_blocks,
            offload_bytes=dict(counters.offload_bytes),
            offload_seconds={d: h.snapshot() for d, h in counters.offload_seconds.items()},
            not_stored=not_stored,
            duplicates=counters.duplicates,
            evictions=evictions,
            collisions=collisions,
            disk_errors=disk_errors,
            integrity_failures=integrity,
            scan_removed=scan_removed,
            disk_io_mode=io_mode,
            pinned=self._engine is not None and self._engine.pinned,
        )

    # ------------------------------------------------------------------- spill

    async def put(self, blocks: Sequence[BlockMeta], data: torch.Tensor, rows: Sequence[int] | None = None) -> int:
        """Spill ``blocks``: reserve, copy (copy engine), commit.

        ``data`` is block-major (any contiguous tensor with the identity's
        block bytes per row); block ``i`` comes from row ``rows[i]`` (default
        ``i``) -- pass a worker's whole pool and the evicted block ids.
        Long batches go in chunks: the next chunk's bookkeeping overlaps the
        current chunk's copy, and once the arena is full earlier blocks are
        written back to disk to make room. Returns how many blocks were newly
        stored; the rest were held already or not stored (counted).
        """
        source = block_rows(data, self.identity.block_bytes)
        rows = _rows(rows, len(blocks), source.shape[0])
        stored = 0
        inflight: list[_Copy] = []  # at most two: the one finishing, the one just started
        try:
            first = 0
            while first < len(blocks):
                if inflight and not self._room_for_another_chunk():
                    stored += await self._finish_spill(inflight.pop(0))
                chunk = self._chunk_blocks()
                grants = await self.reserve(blocks[first : first + chunk])
                chosen = [(rows[first + i], g) for i, g in enumerate(grants) if g is not None]
                first += chunk
                if chosen:
                    future = self._copy_engine().spill(source, [r for r, _ in chosen], [g.slot for _, g in chosen])
                    inflight.append(_Copy(future, [g.lease_id for _, g in chosen]))
                while len(inflight) > 1 or (inflight and first >= len(blocks)):
                    stored += await self._finish_spill(inflight.pop(0))
        except BaseException:
            await self._abandon(inflight)
            raise
        return stored

    def _check_arena(self, arena: int | None) -> None:
        incarnation = self._cpu.slots.incarnation
        if arena is not None and arena != incarnation:
            raise ArenaMovedError(
                f"the caller mapped arena incarnation {arena:#x}, the tier's is {incarnation:#x}: remap it"
            )

    async def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        """Write leases on CPU slots for ``blocks``, in order; None for a block not taken.

        ``arena``: the incarnation of the arena the caller mapped (``ArenaInfo.incarnation``);
        another one raises :class:`~kvstore.tiers.errors.ArenaMovedError` before any lease is granted.

        None means: held already (or being written), not admitted yet, or no
        slot could be freed (all leased, or the disk was too slow to drain
        one) -- each counted. A batch larger than the arena's unleased slots
        gets None beyond them: split large batches (:meth:`put` and
        ``TierLink.spill`` do). Commit or release every grant.
        """
        self._check_arena(arena)
        check_blocks(blocks, self.identity.block_size)
        cpu = self._cpu
        wanted: list[int] = []
        for index, meta in enumerate(blocks):
            if meta.block_hash in cpu:
                cpu.touch(meta.block_hash)
                self._counters.duplicates += 1
            elif not self._admission.admit(meta.block_hash):
                self._counters.not_stored["not_admitted"] += 1
            else:
                wanted.append(index)
        await self._make_cpu_room(len(wanted))
        grants: list[SlotGrant | None] = [None] * len(blocks)
        now = time.perf_counter()
        for index in wanted:
            meta = blocks[index]
            if meta.block_hash in cpu or cpu.is_writing(meta.block_hash):
                self._counters.duplicates += 1
                continue
            lease = cpu.reserve(meta)
            if lease is None:
                self._counters.not_stored["no_free_slot"] += 1
                continue
            self._lease_started[lease.lease_id] = now
            grants[index] = SlotGrant(lease.lease_id, lease.slot, meta.block_hash, Medium.CPU)
        self._publish()
        return grants

    async def commit(self, lease_ids: Sequence[int]) -> int:
        """Publish written slots as cached blocks (BlockStored CPU); returns how many.

        With ``write_through`` also writes them to disk before returning.
        Raises LeaseError (changing nothing) if any id is not a live write lease.
        """
        leases = self._leases(lease_ids, LeaseKind.WRITE)
        now = time.perf_counter()
        for lease in leases:
            self._cpu.commit(lease.lease_id)
            self._counters.offload_bytes[SPILL] += self.identity.block_bytes
        self._observe_batch(SPILL, [lease.lease_id for lease in leases], now)
        if self.config.write_through and self._disk is not None:
            pinned = [self._cpu.acquire(lease.meta) for lease in leases]
            await self._write_to_disk([lease for lease in pinned if lease is not None])
        self._publish()
        return len(leases)

    # ----------------------------------------------------------------- promote

    async def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        """Read leases on the longest held prefix of ``blocks``, disk hits promoted into CPU.

        ``arena`` as for :meth:`reserve`.

        Returns one grant per block of the prefix, in order (``medium`` says
        where each was found). Copy the slots out, then :meth:`release`.
        Considers at most as many blocks as the arena has unleased slots, so
        a shorter answer may mean "no room now": call again with the blocks
        after the prefix until it comes back empty (:meth:`get` does).
        """
        self._check_arena(arena)
        check_blocks(blocks, self.identity.block_size)
        budget = self._cpu.num_slots - self._cpu.num_leased_slots
        found: list[Lease | BlockMeta] = []  # a CPU lease, or a block to read from disk
        for meta in blocks[:budget]:
            lease = self._cpu.acquire(meta)
            if lease is not None:
                found.append(lease)
            elif self._disk is not None and meta.block_hash in self._disk:
                found.append(meta)
            else:
                break
        promoted = await self._promote_from_disk([item for item in found if isinstance(item, BlockMeta)])
        grants: list[SlotGrant] = []
        now = time.perf_counter()
        for position, item in enumerate(found):
            lease = item if isinstance(item, Lease) else promoted.pop(item.block_hash, None)
            if lease is None:  # the prefix ends at a block that could not be read
                for rest in found[position + 1 :]:
                    if isinstance(rest, Lease):
                        rest.release()
                break
            medium = Medium.CPU if isinstance(item, Lease) else Medium.STORAGE
            self._counters.hits[medium] += 1
            self._lease_started[lease.lease_id] = now
            grants.append(SlotGrant(lease.lease_id, lease.slot, lease.meta.block_hash, medium))
        for lease in promoted.values():  # read, but beyond the prefix: stays cached in CPU
            lease.release()
        self._publish()
        return grants

    def release(self, lease_ids: Sequence[int]) -> None:
        """End leases: read leases after copying out, write leases to abandon a reservation.

        Raises LeaseError (changing nothing) if any id is unknown or released.
        """
        leases = [self._cpu.lease(lease_id) for lease_id in lease_ids]
        if len({lease.lease_id for lease in leases}) != len(leases):
            raise LeaseError("a lease id is listed twice")
        now = time.perf_counter()
        reads = [lease.lease_id for lease in leases if lease.kind is LeaseKind.READ]
        self._counters.offload_bytes[PROMOTE] += len(reads) * self.identity.block_bytes
        self._observe_batch(PROMOTE, reads, now)
        for lease in leases:
            self._lease_started.pop(lease.lease_id, None)
            self._cpu.release(lease.lease_id)
        self._publish()

    async def get(
        self, blocks: Sequence[BlockMeta], out: torch.Tensor | None = None, rows: Sequence[int] | None = None
    ) -> TierGet:
        """Read back the longest held prefix of ``blocks``: acquire, copy (copy engine), release.

        Block ``i`` goes to row ``rows[i]`` (default ``i``) of ``out``
        (block-major; default a new ``[len(blocks), *block_shape]`` tensor).
        ``TierGet.data`` is ``out[:n]``, or all of ``out`` when ``rows`` were
        given. Goes in chunks, the next chunk's bookkeeping (and disk reads)
        overlapping the current chunk's copy, so a prefix longer than the
        arena works.
        """
        if out is None:
            if rows is not None:
                raise InvalidBlockError("rows need an out tensor to index")
            out = torch.empty((len(blocks), *self.identity.layout.block_shape), dtype=self.identity.torch_dtype)
        if not blocks:
            return TierGet(0, (), out if rows is not None else out[:0])
        target = block_rows(out, self.identity.block_bytes)
        explicit_rows = rows is not None
        rows = _rows(rows, len(blocks), target.shape[0])
        media: list[Medium] = []
        inflight: list[_Copy] = []  # at most two: the one finishing, the one just started
        try:
            while len(media) < len(blocks):
                if inflight and not self._room_for_another_chunk():
                    await self._finish_promote(inflight.pop(0))
                position = len(media)
                grants = await self.acquire(blocks[position : position + self._chunk_blocks()])
                if not grants:
                    break
                destination = rows[position : position + len(grants)]
                future = self._copy_engine().promote([g.slot for g in grants], target, destination)
                inflight.append(_Copy(future, [g.lease_id for g in grants]))
                media.extend(g.medium for g in grants)
                if len(inflight) > 1:
                    await self._finish_promote(inflight.pop(0))
            while inflight:
                await self._finish_promote(inflight.pop(0))
        except BaseException:
            await self._abandon(inflight)
            raise
        count = len(media)
        return TierGet(count, tuple(media), out if explicit_rows else out[:count])

    # ---------------------------------------------------------------- lifetime

    async def aclose(self) -> None:
        """Let disk I/O settle (one deadline at most), stop copies and events, unlink the arena."""
        if self._closed:
            return
        self._closed = True
        if self._disk is not None:
            await self._disk.aclose()
        if self._engine is not None:
            self._engine.close()
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
        assert all(self._cpu.holds(lease_id) for lease_id in self._lease_started), "timing kept for an ended lease"

    # ---------------------------------------------------------------- internal

    def _chunk_blocks(self) -> int:
        """Blocks per chunk of put/get: about 64 MiB (large copies; longer batches overlap one chunk's
        bookkeeping with the previous chunk's copy), at most half the unleased slots (two in flight)."""
        available = self._cpu.num_slots - self._cpu.num_leased_slots
        return max(1, min(_CHUNK_BYTES // self.identity.block_bytes, available // 2))

    def _room_for_another_chunk(self) -> bool:
        return self._cpu.num_slots - self._cpu.num_leased_slots >= self._chunk_blocks()

    async def _finish_spill(self, copy: _Copy) -> int:
        """Wait for a spill copy and commit its leases (released instead if the copy failed)."""
        try:
            await asyncio.wrap_future(copy.future)
        except BaseException:
            self.release(copy.lease_ids)
            raise
        return await self.commit(copy.lease_ids)

    async def _finish_promote(self, copy: _Copy) -> None:
        """Wait for a promotion copy, then release its leases either way."""
        try:
            await asyncio.wrap_future(copy.future)
        finally:
            self.release(copy.lease_ids)

    async def _abandon(self, copies: list[_Copy]) -> None:
        """After a failure: let the copies still running finish, then release whatever they hold."""
        for copy in copies:
            await asyncio.wait([asyncio.wrap_future(copy.future)])
            self.release([lease_id for lease_id in copy.lease_ids if self._cpu.holds(lease_id)])

    async def _make_cpu_room(self, count: int) -> None:
        """Free slots until ``count`` are free, writing evicted blocks to disk first."""
        shortfall = count - self._cpu.num_free_slots
        if shortfall <= 0:
            return
        victims = self._cpu.evict_lru(shortfall)
        disk = self._disk
        writes = []
        for lease in victims:
            if disk is None or lease.meta.block_hash in disk:
                lease.release()
            else:
                writes.append(lease)
        await self._write_to_disk(writes)

    async def _write_to_disk(self, leases: list[Lease]) -> None:
        """Write leased slots' blocks to disk, as one batch; each lease ends when its write settles."""
        if not leases:
            return
        disk = self._disk
        assert disk is not None
        started = time.perf_counter()

        def settled(lease: Lease) -> Settled:
            def done(ok: bool) -> None:
                if self._closed:  # settled after aclose() gave up waiting: the arena is gone
                    return
                lease.release()
                if ok:
                    self._counters.offload_bytes[DISK_WRITE] += self.identity.block_bytes
                    self._counters.offload_seconds[DISK_WRITE].observe(time.perf_counter() - started)
                self._publish()

            return done

        await disk.write_many([(lease.meta, self._cpu.view(lease.slot), settled(lease)) for lease in leases])

    async def _promote_from_disk(self, metas: list[BlockMeta]) -> dict[int, Lease]:
        """Read ``metas`` from disk into CPU slots, as one batch; read leases on those that arrived intact."""
        if not metas:
            return {}
        disk = self._disk
        assert disk is not None
        await self._make_cpu_room(len(metas))
        started = time.perf_counter()

        def settled(write_lease: Lease) -> Settled:
            def done(ok: bool) -> None:
                if self._closed:  # settled after aclose() gave up waiting: the arena is gone
                    return
                # Even after the caller's deadline: a verified read still lands in the CPU tier.
                if ok:
                    self._cpu.commit(write_lease.lease_id)
                    self._counters.offload_bytes[DISK_READ] += self.identity.block_bytes
                    self._counters.offload_seconds[DISK_READ].observe(time.perf_counter() - started)
                else:
                    self._cpu.release(write_lease.lease_id)
                self._publish()

            return done

        reads = []
        for meta in metas:
            lease = self._cpu.reserve(meta)
            if lease is None:
                break  # no slot (all leased) or being written: the prefix ends here anyway
            reads.append((meta, self._cpu.view(lease.slot), settled(lease)))
        answers = await disk.read_many(reads)
        promoted: dict[int, Lease] = {}
        for (meta, _, _), ok in zip(reads, answers, strict=True):
            lease = self._cpu.acquire(meta) if ok else None
            if lease is not None:
                promoted[meta.block_hash] = lease
        return promoted

    def _observe_batch(self, direction: str, lease_ids: list[int], now: float) -> None:
        starts = [self._lease_started.pop(lease_id) for lease_id in lease_ids if lease_id in self._lease_started]
        if starts:
            self._counters.offload_seconds[direction].observe(now - min(starts))

    def _leases(self, lease_ids: Sequence[int], kind: LeaseKind) -> list[Lease]:
        leases = [self._cpu.lease(lease_id) for lease_id in lease_ids]
        if len({lease.lease_id for lease in leases}) != len(leases):
            raise LeaseError("a lease id is listed twice")
        for lease in leases:
            if lease.kind is not kind:
                raise LeaseError(f"lease {lease.lease_id} is a {lease.kind.value} lease; this call takes {kind.value}")
        return leases

    def _copy_engine(self) -> CopyEngine:
        assert self._engine is not None, "the store is closed"
        return self._engine

    def _snapshot(self) -> Snapshot:
        # Seq first: every batch up to it was published after its mutation, so the copy reflects it.
        seq = self._publisher.last_seq
        events = self._cpu.snapshot_events()
        if self._disk is not None:
            events += self._disk.snapshot_events()
        return Snapshot(seq, events)

    def _publish(self) -> None:
        events = self._cpu.take_events()
        if self._disk is not None:
            events += self._disk.take_events()
        if events and not self._closed:
            self._publisher.publish(events)
