"""The disk tier: blocks in the fixed-size slots of slab files, an LRU index bounded in bytes.

Layout: ``<root>/<identity digest>/<n:06d>.kvslab``, each slab a run of
slots, one block per slot (format in :mod:`kvstore.tiers.disk_format`).
:class:`DiskTier` owns four parts, one job each, and decides what their
outcomes mean:

- :mod:`~kvstore.tiers.disk_capacity` -- which block is in which slot, in
  LRU order, the free slots, and the byte limit that ENOSPC lowers and free
  room restores;
- :mod:`~kvstore.tiers.disk_runner` -- batches of I/Os on the I/O threads,
  each answered by its deadline;
- :mod:`~kvstore.tiers.disk_files` -- one run's system calls (one vectored
  I/O of consecutive slots, O_DIRECT) and a slab's growth;
- :mod:`~kvstore.tiers.disk_scan` -- the start-up scan that rebuilds the
  index from the slot headers of an earlier life.

Runs
----
A batch of writes takes the lowest free slots (growing the last slab, then
evicting least recently used blocks, when none are free); the slots are
sorted and cut into runs of consecutive slots of one slab, at most
:data:`RUN_BYTES` each (several runs in flight beat one huge one), and each
run is one ``pwritev`` of header, payload, header, payload... A batch of
reads is sorted by slot and cut the same way, each run one ``preadv``. A
full tier evicts its least recently used blocks, which were mostly written
together, so their slots are mostly consecutive again. Every block keeps its
own header and checksum, its own answer and its own events.

Contracts
---------
- Nothing here raises for a storage problem. A write that cannot be done
  (capacity, ENOSPC, I/O error, deadline) returns False: *not stored*,
  counted by reason. A read of a slot that is missing, short, holds another
  block or identity or format version, or fails its checksum returns False:
  a *miss*, counted by reason; the block leaves the index and the slot's
  header is zeroed (best effort), so no restart takes it up again. Wrong KV
  is never handed back.
- Every I/O keeps the runner's deadline and hands its buffers back through
  ``on_settled(ok)``, exactly once per block, possibly after its answer
  (see :mod:`~kvstore.tiers.disk_runner`). A write that completes late is
  still indexed; a read that completes late is still verified.
- ``write_many`` / ``read_many`` take a batch and give one answer per
  block, in order; ``write`` / ``read_into`` are batches of one.
- A slot is never written while it is read, nor by two writes at once
  (:mod:`~kvstore.tiers.disk_capacity`). A block evicted for a write is not
  served while the write runs; if the write never touched the slot (a
  read-only file system refused the open, or the deadline passed before it
  started) the block is indexed again, so a read-only disk loses no block
  and keeps serving every one of them; writes are then *not stored*
  (``read_only``). Writes keep away from a refused slab for
  :data:`REFUSED_SLAB_S` while other slabs have room, so one slab that
  cannot be written does not stop the rest.
- The identity directory removed while the tier runs (found on an ENOENT)
  is made again; the blocks of its slabs are lost: dropped from the index,
  published as removed, counted ``missing``; the slabs start over from
  slab 0 (see :meth:`DiskTier._lost_directory`).
- ``used_bytes`` is the slots in use; the slab files on disk
  (``disk_bytes``) never exceed the limit in force, and a slab grows only
  when no slot is free.

Not thread-safe: drive it from one event loop; :meth:`DiskTier.snapshot_events`
may run on another thread.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.events import BlockStored, KVEvent, Medium
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_capacity import Entry, SlotIndex
from kvstore.tiers.disk_files import (
    MAX_RUN_BLOCKS,
    FileLayout,
    RunWrite,
    aligned,
    direct_io_refusal,
    errno_name,
    grow_slab,
    invalidate_slot,
    read_run,
    write_run,
)
from kvstore.tiers.disk_format import ALIGN, IntegrityError, slab_name, slots_per_slab
from kvstore.tiers.disk_runner import BlockIo, IoRunner, Request, Settled, settled_nothing
from kvstore.tiers.disk_scan import scan
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.tier_events import MediumEvents

logger = logging.getLogger(__name__)

# The most one I/O moves. Measured on a virtio disk (docs/tiers.md, "Slab files"): for 192 KiB blocks runs
# of 2-8 MiB came out alike (4 MiB a little ahead on writes), and for 2 MiB blocks one block per I/O beat
# runs of 2-8 blocks (16 I/Os in flight either way): past a few MiB the device rewards more I/Os in flight,
# not longer ones.
RUN_BYTES = 4 * 1024 * 1024
# How long writes keep away from a slab after the file system refused one into it (then it is tried again).
REFUSED_SLAB_S = 60.0
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_REFUSED_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)  # a read-only (or locked-down) file system


class DiskCounters:
    """Plain counters, read by the store's stats and metrics."""

    def __init__(self) -> None:
        self.not_stored: Counter[str] = Counter()  # reason -> blocks not written
        self.integrity_failures: Counter[str] = Counter()  # reason -> blocks refused (and dropped)
        self.io_errors: Counter[str] = Counter()  # errno name -> blocks of failed I/Os
        self.deadline_expired: Counter[str] = Counter()  # "read" / "write" -> blocks answered late
        self.scan_removed: Counter[str] = Counter()  # reason -> slots or files dropped by the start-up scan
        self.collisions = 0  # reads whose hash matched a block of other tokens
        self.evictions = 0


class DiskTier:
    """Slab files under one cache identity's directory, LRU-evicted beyond ``capacity_bytes``.

    Raises ConfigError, before anything on disk is touched, when ``capacity_bytes`` is below one slot (the
    start-up scan would remove every slab and no block could ever be stored).
    """

    def __init__(
        self,
        root: str | Path,
        identity: CacheIdentity,
        *,
        capacity_bytes: int,
        deadline_s: float,
        max_concurrent_io: int,
        direct_io: bool = True,
        fsync: bool = False,
    ) -> None:
        if deadline_s <= 0 or max_concurrent_io < 1 or capacity_bytes < 0:
            raise ValueError("deadline_s must be > 0, max_concurrent_io >= 1 and capacity_bytes >= 0")
        self.identity = identity
        self.directory = Path(root) / identity.digest()
        self.block_bytes = identity.block_bytes
        self.counters = DiskCounters()
        self._layout = FileLayout(bytes.fromhex(identity.digest()), identity.block_size, identity.block_bytes)
        self.file_bytes = self._layout.file_bytes  # one slot
        if capacity_bytes < self.file_bytes:  # checked before the scan, which would remove every slab
            raise ConfigError(
                f"tiers.disk_capacity_bytes ({capacity_bytes}) is smaller than one disk slot ({self.file_bytes} "
                f"bytes: a {self._layout.header_len}-byte header and a block of {identity.model}); raise it, "
                "or unset tiers.disk_dir to turn the disk tier off"
            )
        self._per_slab = slots_per_slab(self.file_bytes)
        self._run_blocks = max(1, min(MAX_RUN_BLOCKS, RUN_BYTES // self.file_bytes))
        self._index = SlotIndex(self.directory, capacity_bytes=capacity_bytes, slot_bytes=self.file_bytes)
        self._runner = IoRunner(max_concurrent_io, deadline_s, self.counters.deadline_expired)
        self._fsync = fsync
        self._growth_refused: int | None = None  # errno of the last failed growth (logged once)
        self._refused_slabs: dict[int, float] = {}  # slab -> until when writes keep away from it (monotonic)
        self._events = MediumEvents(Medium.STORAGE, identity.block_size)
        # Prompts can be read back from KV, so the files are the tier user's alone: directories 0700
        # (tightened where an older version left them open), files 0600 (disk_files).
        _private_dir(self.directory, parents=True)
        self.direct_io, self.io_mode = self._choose_io_mode(direct_io)
        found = scan(self.directory, self._layout, self._index.max_slots)
        self.counters.scan_removed.update(found.removed)
        self.counters.io_errors.update(found.io_errors)
        self._sequence = found.next_sequence
        self._index.load(found.slots, found.kept)
        for meta, _ in found.kept:
            self._events.stored(meta)

    # ----------------------------------------------------------------- queries

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity."""
        return self._index.capacity_bytes

    @property
    def num_blocks(self) -> int:
        return self._index.num_blocks

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def limit_bytes(self) -> int:
        """The capacity in force: the configured one, or less after the disk filled up."""
        return self._index.limit_bytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def lru_hashes(self) -> list[int]:
        """Stored block hashes, least recently used (next to be evicted) first."""
        return self._index.lru_hashes()

    @property
    def disk_bytes(self) -> int:
        """Bytes of the slab files on disk (at most the limit in force)."""
        return self._index.disk_bytes

    def slab_paths(self) -> list[Path]:
        """Every slab file, first slot first."""
        return [self._slab_path(slab) for slab in range(-(-self._index.num_slots // self._per_slab))]

    def location_of(self, block_hash: int) -> tuple[Path, int]:
        """The slab and byte offset of a stored block's slot; KeyError if it is not stored."""
        entry = self._index.get(block_hash)
        if entry is None:
            raise KeyError(f"block {block_hash:#x} is not on disk")
        return self._slab_path(entry.slot // self._per_slab), (entry.slot % self._per_slab) * self.file_bytes

    def path_of(self, block_hash: int) -> Path:
        """The slab file that holds a stored block; KeyError if it is not stored."""
        return self.location_of(block_hash)[0]

    def take_events(self) -> list[KVEvent]:
        return self._events.take()

    def discard_events(self) -> int:
        """Forget the events recorded since the last take (the owner publishes nowhere)."""
        return self._events.discard()

    def snapshot_events(self) -> list[BlockStored]:
        """Every stored block as a BlockStored (medium STORAGE). Safe from another thread."""
        return self._events.snapshot(self._index.metas())

    # ---------------------------------------------------------------------- io

    async def write(self, meta: BlockMeta, payload: memoryview, on_settled: Settled = settled_nothing) -> bool:
        """Store ``payload`` as ``meta``'s block; True once it is in place (or already was).

        ``payload`` is read until ``on_settled`` is called, possibly after
        this returns False at the deadline.
        """
        return (await self.write_many([(meta, payload, on_settled)]))[0]

    async def write_many(self, requests: Sequence[Request]) -> list[bool]:
        """:meth:`write` for each ``(meta, payload, on_settled)``, run together: one answer each."""
        for _, payload, _ in requests:
            if payload.nbytes != self.block_bytes:
                raise InvalidBlockError(
                    f"payload is {payload.nbytes} bytes; this identity's blocks are {self.block_bytes}"
                )
        return await self._runner.run_batch(requests, self._plan_writes, "write")

    async def read_into(self, meta: BlockMeta, out: memoryview, on_settled: Settled = settled_nothing) -> bool:
        """Read ``meta``'s payload into ``out``; True only if it passed every check.

        ``out`` may be written until ``on_settled`` is called, possibly after
        this returns False at the deadline; its content counts only if
        ``on_settled`` gets True.
        """
        return (await self.read_many([(meta, out, on_settled)]))[0]

    async def read_many(self, requests: Sequence[Request]) -> list[bool]:
        """:meth:`read_into` for each ``(meta, out, on_settled)``, run together: one answer each."""
        for _, out, _ in requests:
            if out.nbytes != self.block_bytes or out.readonly:
                raise InvalidBlockError(f"read buffer must be {self.block_bytes} writable bytes, got {out.nbytes}")
        return await self._runner.run_batch(requests, self._plan_reads, "read")

    async def aclose(self) -> None:
        """Wait (up to one deadline) for I/O still running, then stop the I/O threads."""
        await self._runner.aclose()

    def close(self) -> None:
        """Stop the I/O threads without waiting (I/O already running finishes on its own)."""
        self._runner.close()

    # ------------------------------------------------------------------ writes

    def _plan_writes(self, requests: Sequence[Request]) -> tuple[list[bool | None], list[BlockIo]]:
        """Answers without I/O (stored already, in flight, no room) and the runs that write the rest."""
        answers: list[bool | None] = [None] * len(requests)
        todo: list[int] = []
        seen: set[int] = set()
        for position, (meta, _, _) in enumerate(requests):
            block_hash = meta.block_hash
            if block_hash in self._index:
                self._index.touch(block_hash)
                answers[position] = True
            elif self._index.is_writing(block_hash) or block_hash in seen:
                self.counters.not_stored["in_flight"] += 1
                answers[position] = False
            else:
                seen.add(block_hash)
                todo.append(position)
        slots, refused = self._slots_for(len(todo))
        if refused is not None:  # no slot because a slab could not grow: the file system's reason
            short = "read_only" if refused.errno in _REFUSED_ERRNOS else "io_error"
        else:  # no slot: the tier is at its limit with every block in use
            short = "disk_full" if self._index.limit_bytes < self._index.capacity_bytes else "capacity"
        for position in todo[len(slots) :]:
            self.counters.not_stored[short] += 1
            answers[position] = False
        placed = list(zip(sorted(slots), todo, strict=False))  # in request order: a batch's blocks stay in order
        for slot, position in placed:
            self._index.start_write(requests[position][0].block_hash, slot)
        ios = []
        for run in self._runs(placed):
            blocks = []
            for _, position in run:
                meta, payload, _ = requests[position]
                blocks.append(RunWrite(meta, payload, self._sequence))
                self._sequence += 1
            direct = self.direct_io and all(aligned(block.payload) for block in blocks)
            path, offset = self._place(run[0][0])
            job = partial(write_run, path, offset, blocks, self._layout, direct, self._fsync)
            settled = [requests[position][2] for _, position in run]
            slab = run[0][0] // self._per_slab
            ios.append(BlockIo([p for _, p in run], job, partial(self._settle_writes, blocks, settled, slab)))
        return answers, ios

    def _slots_for(self, count: int) -> tuple[list[int], OSError | None]:
        """Up to ``count`` slots to write: free ones, then new ones (the slabs grow), then evicted ones; and
        why a slab could not grow (None if it grew, or needed not), ENOSPC / EDQUOT left out: they lower the
        limit instead (``disk_full``)."""
        avoid = self._avoid_refused_slabs()
        slots = self._index.take_free(count, avoid)
        grow = self._index.slots_to_grow(count - len(slots))
        refused = None
        if grow:
            added, refused = self._grow(grow)
            slots += added
        if len(slots) < count:
            slots += self._evict(count - len(slots), avoid)
        if len(slots) < count and avoid is not None:  # nowhere else: the refused slabs are tried again
            slots += self._index.take_free(count - len(slots))
            if len(slots) < count:
                slots += self._evict(count - len(slots), None)
        return slots, refused

    def _evict(self, count: int, avoid: Callable[[int], bool] | None) -> list[int]:
        """Up to ``count`` slots of least recently used blocks (passing over those ``avoid`` names)."""
        evicted, gone = self._index.evict(count, avoid)
        for entry in gone:  # being read: evicted now, their slots free once the reads end
            self._events.removed(entry.meta)
            self.counters.evictions += 1
        return evicted

    def _avoid_refused_slabs(self) -> Callable[[int], bool] | None:
        """Which slots to keep writes away from: those of slabs whose last write the file system refused
        (EACCES, EPERM, EROFS) less than :data:`REFUSED_SLAB_S` ago; None when there are none.

        Without this, one slab the tier cannot write (mode 0400, immutable) stops every write once the tier
        is full: each batch evicts that slab's least recently used blocks, the write is refused before it
        touches them, they come back at the head of the LRU, and the next batch picks them again. Passed
        over, they stay served while writes go to the other slabs; when every slab is refused (a read-only
        file system) the writes go to them anyway and are *not stored* (``read_only``) as before.
        """
        if not self._refused_slabs:
            return None
        now = time.monotonic()
        for slab, until in list(self._refused_slabs.items()):
            if until <= now:
                del self._refused_slabs[slab]
        refused = set(self._refused_slabs)
        per_slab = self._per_slab
        return (lambda slot: slot // per_slab in refused) if refused else None

    def _grow(self, count: int) -> tuple[list[int], OSError | None]:
        """Grow the slab files by up to ``count`` slots, slab by slab: the slots that were added, and the
        OSError that stopped the growth short, if any but ENOSPC / EDQUOT (those lower the limit: the tier
        is full, not broken). Such an error is counted once per growth tried (``io_errors``); the growth is
        tried again by the next batch that needs it (the cause -- permissions, a directory in the slab's
        place -- may be fixed meanwhile), logged once per errno until a growth succeeds."""
        added: list[int] = []
        retried = False
        while len(added) < count:
            first = self._index.num_slots
            slab, index = divmod(first, self._per_slab)
            more = min(count - len(added), self._per_slab - index)
            try:
                grow_slab(self._slab_path(slab), index * self.file_bytes, (index + more) * self.file_bytes)
            except OSError as exc:
                if exc.errno == errno.ENOENT and not retried and self._lost_directory():
                    retried = True  # made again: the slabs start over from slab 0
                    continue
                if exc.errno in _FULL_ERRNOS:
                    self._index.disk_full(exc)
                    return added, None
                self.counters.io_errors[errno_name(exc)] += 1
                if self._growth_refused != exc.errno:
                    self._growth_refused = exc.errno
                    logger.warning("disk tier %s: could not grow slab %d: %s", self.directory, slab, exc)
                return added, exc
            added += self._index.add_slots(more)
            self._growth_refused = None
        return added, None

    def _settle_writes(self, blocks: list[RunWrite], settled: list[Settled], slab: int, io: BlockIo) -> list[bool]:
        ok = io.started and io.error is None
        error = io.error
        # Nothing was written when the run never started, or the file system refused to open the slab.
        refused = io.started and isinstance(error, OSError) and error.errno in _REFUSED_ERRNOS
        untouched = not io.started or refused
        if refused:  # later writes go to other slabs for a while (_avoid_refused_slabs)
            self._refused_slabs[slab] = time.monotonic() + REFUSED_SLAB_S
        elif ok:
            self._refused_slabs.pop(slab, None)
        try:
            for block in blocks:
                entry, gone = self._index.end_write(block.meta, stored=ok, untouched=untouched)
                for removed in gone:
                    self._events.removed(removed.meta)
                    self.counters.evictions += 1
                if entry is not None:
                    self._events.stored(block.meta)
                if not io.started:
                    self.counters.not_stored["timeout"] += 1
                elif isinstance(error, OSError):
                    self._count_write_error(error)
            if isinstance(error, FileNotFoundError):  # O_CREAT found no directory to create the slab in?
                self._lost_directory()
            return [ok] * len(blocks)
        finally:
            for on_settled in settled:
                on_settled(ok)

    def _count_write_error(self, exc: OSError) -> None:
        if exc.errno in _FULL_ERRNOS:
            self.counters.not_stored["disk_full"] += 1
            self._index.disk_full(exc)
        elif exc.errno in _REFUSED_ERRNOS:
            self.counters.not_stored["read_only"] += 1
            self.counters.io_errors[errno_name(exc)] += 1
        else:
            self.counters.not_stored["io_error"] += 1
            self.counters.io_errors[errno_name(exc)] += 1

    # ------------------------------------------------------------------- reads

    def _plan_reads(self, requests: Sequence[Request]) -> tuple[list[bool | None], list[BlockIo]]:
        """False for blocks not stored; the runs that read the rest."""
        answers: list[bool | None] = [None] * len(requests)
        placed: list[tuple[int, int]] = []
        for position, (meta, _, _) in enumerate(requests):
            entry = self._index.get(meta.block_hash)
            if entry is None:
                answers[position] = False
                continue
            self._index.start_read(entry.slot)
            placed.append((entry.slot, position))
        placed.sort()
        ios = []
        for run in self._runs(placed):
            entries: list[Entry] = []
            blocks: list[tuple[BlockMeta, memoryview]] = []
            collisions: list[bool] = []
            for slot, position in run:
                meta, out, _ = requests[position]
                entry = self._index.get(meta.block_hash)
                assert entry is not None and entry.slot == slot
                # Other tokens (or parent) under this hash: a collision if the slot is intact -- or a header
                # damaged while the tier was down, which the start-up scan cannot tell (the checksum covers the
                # payload). Read it as what it claims to be: a damaged slot is refused like any other. Never a
                # hit: ``out`` is handed back with on_settled(False) either way.
                collisions.append(entry.meta != meta)
                entries.append(entry)
                blocks.append((entry.meta, out))
            direct = self.direct_io and all(aligned(out) for _, out in blocks)
            path, offset = self._place(run[0][0])
            job = partial(read_run, path, offset, blocks, direct, self._layout)
            settled = [requests[position][2] for _, position in run]
            ios.append(BlockIo([p for _, p in run], job, partial(self._settle_reads, entries, collisions, settled)))
        return answers, ios

    def _settle_reads(
        self, entries: list[Entry], collisions: list[bool], settled: list[Settled], io: BlockIo
    ) -> list[bool]:
        """Each block's answer; with its ``collision`` flag an intact slot is a hash collision and a miss."""
        answers = [False] * len(entries)
        for entry in entries:
            self._index.end_read(entry.slot)
        try:
            error = io.error
            results = io.result if isinstance(io.result, list) else [None] * len(entries)
            for i, (entry, collision, result) in enumerate(zip(entries, collisions, results, strict=True)):
                if not io.started:
                    continue
                if isinstance(error, FileNotFoundError):
                    self.counters.integrity_failures["missing"] += 1
                    self._forget(entry, invalidate=False)
                elif isinstance(error, OSError):
                    self.counters.io_errors[errno_name(error)] += 1
                    self._forget(entry, invalidate=False)
                elif error is not None:
                    pass  # a bug: raised by the runner once every I/O of the batch is settled
                elif isinstance(result, IntegrityError):
                    self.counters.integrity_failures[result.reason] += 1
                    logger.warning("disk tier: refused slot %d of %s: %s", entry.slot, self.directory, result)
                    self._forget(entry, invalidate=True)
                elif collision:
                    self.counters.collisions += 1
                else:
                    # Evicted while it was read, the slot may be taken by now -- the bytes read were verified.
                    if entry.meta.block_hash in self._index:
                        self._index.touch(entry.meta.block_hash)
                    answers[i] = True
            if io.started and isinstance(error, FileNotFoundError):
                self._lost_directory()
            return answers
        finally:
            for on_settled, ok in zip(settled, answers, strict=True):
                on_settled(ok)

    # ---------------------------------------------------------------- internal

    def _runs(self, placed: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """``(slot, position)`` pairs sorted by slot, cut into runs of consecutive slots of one slab."""
        runs: list[list[tuple[int, int]]] = []
        for pair in placed:
            last = runs[-1] if runs else None
            if (
                last is not None
                and pair[0] == last[-1][0] + 1
                and pair[0] % self._per_slab != 0
                and len(last) < self._run_blocks
            ):
                last.append(pair)
            else:
                runs.append([pair])
        return runs

    def _place(self, slot: int) -> tuple[Path, int]:
        slab, index = divmod(slot, self._per_slab)
        return self._slab_path(slab), index * self.file_bytes

    def _slab_path(self, slab: int) -> Path:
        return self.directory / slab_name(slab)

    def _forget(self, entry: Entry, *, invalidate: bool) -> None:
        """Stop serving ``entry`` (BlockRemoved) unless it is gone already (evicted) or a newer copy of its
        block replaced it; with ``invalidate`` zero its slot's header so no restart takes it up again."""
        if self._index.discard(entry):
            self._events.removed(entry.meta)
            if invalidate:  # the slot is free now or once its reads end: no write is in flight to it
                path, offset = self._place(entry.slot)
                invalidate_slot(path, offset, self._layout.header_len)

    def _lost_directory(self) -> bool:
        """After an ENOENT: whether the identity directory itself was removed behind the tier's back. If it
        was, it is made again (0700) and every block of the slabs that went with it is dropped -- lost:
        published as removed and counted (``integrity_failures["missing"]``, as a read of them would have) --
        and the slabs start over from slab 0, so writes go on and ``disk_bytes`` counts only slots that an
        I/O in flight still holds. A directory that cannot be made again is logged; the next ENOENT tries
        again."""
        if self.directory.is_dir():
            return False
        try:
            _private_dir(self.directory, parents=True)
        except OSError as exc:
            logger.warning("disk tier: could not make %s again: %s", self.directory, exc)
        gone = self._index.drop_all()
        self._refused_slabs.clear()
        for entry in gone:
            self._events.removed(entry.meta)
        self.counters.integrity_failures["missing"] += len(gone)
        logger.warning("disk tier %s was removed while in use: made again, %d blocks lost", self.directory, len(gone))
        return True

    def _choose_io_mode(self, wanted: bool) -> tuple[bool, str]:
        if not wanted:
            return False, "buffered (tiers.disk_direct_io is off)"
        if self.block_bytes % ALIGN:
            return False, f"buffered (block bytes {self.block_bytes} are not a multiple of {ALIGN})"
        refusal = direct_io_refusal(self.directory)
        if refusal is not None:
            return False, f"buffered ({refusal})"
        return True, "O_DIRECT"

    def check_invariants(self) -> None:
        """Assert index and accounting agree; raises AssertionError naming the fault."""
        self._index.check_invariants(self.identity.block_size)


def _private_dir(path: Path, *, parents: bool = False) -> None:
    """``path`` as a directory only its owner can enter (0700), created or tightened."""
    path.mkdir(mode=0o700, parents=parents, exist_ok=True)
    if path.stat().st_mode & 0o077:
        try:
            path.chmod(0o700)
        except OSError as exc:  # e.g. a read-only file system: the tier still works, only less private
            logger.warning("could not make %s private (0700): %s", path, exc)
