"""The disk tier: one content-addressed file per block, an LRU index bounded in bytes.

Layout: ``<root>/<identity digest>/<top byte of hash>/<hash:016x>.kvb``
(format in :mod:`kvstore.tiers.disk_format`). :class:`DiskTier` owns four
parts, one job each, and decides what their outcomes mean:

- :mod:`~kvstore.tiers.disk_capacity` -- which blocks are held, in LRU
  order, and the byte limit that ENOSPC lowers and free room restores;
- :mod:`~kvstore.tiers.disk_runner` -- batches of I/Os on the I/O threads,
  each answered by its deadline;
- :mod:`~kvstore.tiers.disk_files` -- one block file's system calls
  (temporary + rename, O_DIRECT, one vectored I/O);
- :mod:`~kvstore.tiers.disk_scan` -- the start-up scan that rebuilds the
  index from the files of an earlier life.

Contracts
---------
- Nothing here raises for a storage problem. A write that cannot be done
  (capacity, ENOSPC, I/O error, deadline) returns False: *not stored*,
  counted by reason. A read of a file that is missing, short, for another
  block or identity, of another format version, or fails its checksum
  returns False: a *miss*, counted by reason, and the file is retired to a spare.
  Wrong KV is never handed back.
- Every I/O keeps the runner's deadline and hands its buffer back through
  ``on_settled(ok)``, exactly once, possibly after its answer (see
  :mod:`~kvstore.tiers.disk_runner`). A write that completes late is still
  indexed; a read that completes late is still verified.
- ``write_many`` / ``read_many`` take a batch and give one answer per
  block, in order; ``write`` / ``read_into`` are batches of one.
- Files are reused: eviction renames the evicted block's file to a spare
  (``<identity>/spare/<n>.kvs``) inline -- a metadata operation; renaming
  later could move a newer file of the same block -- and the write that
  needed the room overwrites that spare (its blocks are allocated already)
  and renames it into place. A refused file becomes a spare the same way.
  Only with no spare left does a write create a file (temporary + rename).
  A file being read is not made a spare until the read is done.
- A block leaves the index only once its file is moved (or it must not be
  served any more). On a read-only file system eviction stops at the first
  file it cannot move -- that block stays indexed and readable, writes are
  *not stored* (``cannot_evict``, ``read_only``) -- and a refused file that
  cannot be moved stays counted until a later write's room-making moves
  it. So ``used_bytes`` is always the files on disk (blocks, spares, files
  being written), and once the file system is writable again the tier
  carries on with exact accounting.

Not thread-safe: drive it from one event loop; :meth:`DiskTier.snapshot_events`
may run on another thread.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import uuid
from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from kvstore.events import BlockStored, KVEvent, Medium
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_capacity import DiskIndex, Entry
from kvstore.tiers.disk_files import (
    FileLayout,
    aligned,
    direct_io_refusal,
    errno_name,
    overwrite_block_file,
    read_block_file,
    remove,
    write_block_file,
)
from kvstore.tiers.disk_format import ALIGN, SPARE_DIR, TEMP_SUFFIX, IntegrityError, file_name, shard_name, spare_name
from kvstore.tiers.disk_runner import BlockIo, IoRunner, Request, Settled, settled_nothing
from kvstore.tiers.disk_scan import scan
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.tier_events import MediumEvents

logger = logging.getLogger(__name__)

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_REFUSED_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)  # a read-only (or locked-down) file system


class DiskCounters:
    """Plain counters, read by the store's stats and metrics."""

    def __init__(self) -> None:
        self.not_stored: Counter[str] = Counter()  # reason -> blocks not written
        self.integrity_failures: Counter[str] = Counter()  # reason -> files refused (and removed)
        self.io_errors: Counter[str] = Counter()  # errno name -> failed I/Os
        self.deadline_expired: Counter[str] = Counter()  # "read" / "write" -> I/Os answered late
        self.scan_removed: Counter[str] = Counter()  # reason -> files removed by the start-up scan
        self.collisions = 0  # reads whose hash matched a file of other tokens
        self.evictions = 0


class DiskTier:
    """Block files under one cache identity's directory, LRU-evicted beyond ``capacity_bytes``."""

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
        self.file_bytes = self._layout.file_bytes
        self._index = DiskIndex(self.directory, capacity_bytes=capacity_bytes, file_bytes=self.file_bytes)
        self._runner = IoRunner(max_concurrent_io, deadline_s, self.counters.deadline_expired)
        self._fsync = fsync
        self._temp_names = itertools.count()
        self._temp_prefix = uuid.uuid4().hex[:8]  # this tier instance's: two on one directory never collide
        self._events = MediumEvents(Medium.STORAGE, identity.block_size)
        self._deletes_refused = False  # the last deletion failed (logged once per episode)
        # Prompts can be read back from KV, so the files are the tier user's alone: directories 0700
        # (tightened where an older version left them open), files 0600 (disk_files).
        _private_dir(self.directory, parents=True)
        for shard in range(256):
            _private_dir(self.directory / f"{shard:02x}")
        self.direct_io, self.io_mode = self._choose_io_mode(direct_io)
        _private_dir(self.directory / SPARE_DIR)
        found = scan(self.directory, self._layout, self._index.max_blocks)
        self.counters.scan_removed.update(found.removed)
        self.counters.io_errors.update(found.io_errors)
        for meta in found.kept:
            self._index.insert(meta)
            self._events.stored(meta)
        self._index.add_spares(found.spares)

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

    def path_of(self, block_hash: int) -> Path:
        return self.directory / shard_name(block_hash) / file_name(block_hash)

    def take_events(self) -> list[KVEvent]:
        return self._events.take()

    def snapshot_events(self) -> list[BlockStored]:
        """Every stored block as a BlockStored (medium STORAGE). Safe from another thread."""
        return self._events.snapshot(self._index.metas())

    # ---------------------------------------------------------------------- io

    async def write(self, meta: BlockMeta, payload: memoryview, on_settled: Settled = settled_nothing) -> bool:
        """Store ``payload`` as ``meta``'s file; True once it is in place (or already was).

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
        return await self._runner.run_batch(requests, self._plan_write, "write")

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
        return await self._runner.run_batch(requests, self._plan_read, "read")

    async def aclose(self) -> None:
        """Wait (up to one deadline) for I/O still running, then stop the I/O threads."""
        await self._runner.aclose()

    def close(self) -> None:
        """Stop the I/O threads without waiting (I/O already running finishes on its own)."""
        self._runner.close()

    # ------------------------------------------------------------------ writes

    def _plan_write(self, meta: BlockMeta, payload: memoryview, on_settled: Settled) -> BlockIo | bool:
        """A write's answer without I/O (True: stored already; False: not storable now), or its I/O."""
        block_hash = meta.block_hash
        if block_hash in self._index:
            self._index.touch(block_hash)
            return True
        if self._index.is_writing(block_hash):
            self.counters.not_stored["in_flight"] += 1
            return False
        room = self._index.make_room(self._retire)
        for spare in room.dropped:
            if not remove(self._spare_path(spare)):
                self._index.keep_spare(spare)
        for entry in room.evicted:
            self._events.removed(entry.meta)
            self.counters.evictions += 1
        if not room.fits:
            self.counters.not_stored["cannot_evict" if room.stuck else "capacity"] += 1
            return False
        self._index.start_write(block_hash, room.spare)
        final = self.path_of(block_hash)
        direct = self.direct_io and aligned(payload)
        if room.spare is not None:
            spare_path = self._spare_path(room.spare)
            job = partial(overwrite_block_file, spare_path, final, meta, payload, self._layout, direct, self._fsync)
        else:
            temp = final.with_name(f".{final.name}.{self._temp_prefix}-{next(self._temp_names)}{TEMP_SUFFIX}")
            job = partial(write_block_file, temp, final, meta, payload, self._layout, direct, self._fsync)
        return BlockIo(job, partial(self._settle_write, meta, on_settled, room.spare))

    def _settle_write(self, meta: BlockMeta, on_settled: Settled, spare: int | None, io: BlockIo) -> bool:
        ok = io.started and io.error is None
        try:
            # The write's own file first: a failed write into a spare leaves the spare where it was (it stays
            # a spare if its file is there); a failed new file's temporary is gone. Then what it means.
            left = not ok and spare is not None and os.path.exists(self._spare_path(spare))
            self._index.end_write(meta.block_hash, spare_left=left)
            if not io.started:
                self.counters.not_stored["timeout"] += 1
            elif isinstance(io.error, OSError):
                self._count_write_error(io.error)
            elif ok:
                self._index.insert(meta)
                self._events.stored(meta)
            return ok
        finally:
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

    def _plan_read(self, meta: BlockMeta, out: memoryview, on_settled: Settled) -> BlockIo | bool:
        """False for a block not stored, else its read's I/O."""
        entry = self._index.get(meta.block_hash)
        if entry is None:
            return False
        # Other tokens (or parent) under this hash: a collision if the file is intact -- or a header damaged
        # while the tier was down, which the start-up scan cannot tell (the checksum covers the payload). Read
        # it as what it claims to be: a damaged file is refused and removed like any other. Never a hit:
        # ``out`` is handed back with on_settled(False) either way.
        collision = entry.meta != meta
        stored = entry.meta
        direct = self.direct_io and aligned(out)
        job = partial(read_block_file, self.path_of(stored.block_hash), stored, out, direct, self._layout)
        self._index.start_read(stored.block_hash)
        return BlockIo(job, partial(self._settle_read, entry, on_settled, collision))

    def _settle_read(self, entry: Entry, on_settled: Settled, collision: bool, io: BlockIo) -> bool:
        """A read's answer; with ``collision`` an intact file is counted as a hash collision and still a miss."""
        ok = False
        self._index.end_read(entry.meta.block_hash)
        try:
            error = io.error
            if not io.started:
                pass
            elif isinstance(error, IntegrityError):
                self.counters.integrity_failures[error.reason] += 1
                logger.warning("disk tier: refused %s: %s", self.path_of(entry.meta.block_hash), error)
                self._forget(entry, unlink=True)
            elif isinstance(error, FileNotFoundError):
                self.counters.integrity_failures["missing"] += 1
                self._forget(entry, unlink=False)
            elif isinstance(error, OSError):
                self.counters.io_errors[errno_name(error)] += 1
                self._forget(entry, unlink=True)
            elif error is not None:
                pass  # a bug: raised by the runner once every I/O of the batch is settled
            elif collision:
                self.counters.collisions += 1
            else:
                # Evicted while it was being read, the file may be gone by now -- the bytes read were verified.
                if entry.meta.block_hash in self._index:
                    self._index.touch(entry.meta.block_hash)
                ok = True
            return ok
        finally:
            on_settled(ok)

    # ---------------------------------------------------------------- internal

    def _forget(self, entry: Entry, *, unlink: bool) -> None:
        """Stop serving ``entry`` (BlockRemoved) unless it is gone already (evicted) or a newer file of its
        block replaced it; with ``unlink`` retire its file to a spare -- kept counted as undeleted if refused."""
        if self._index.discard(entry):
            self._events.removed(entry.meta)
            if unlink:
                self._index.retire_file(entry, self._retire)

    def _spare_path(self, spare: int) -> Path:
        return self.directory / SPARE_DIR / spare_name(spare)

    def _retire(self, entry: Entry, spare: int) -> bool | None:
        """Rename ``entry``'s file to spare ``spare``: True done, None the file was gone, False refused
        (logged when refusals start and when they end)."""
        path = self.path_of(entry.meta.block_hash)
        try:
            os.replace(path, self._spare_path(spare))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if not self._deletes_refused:
                self._deletes_refused = True
                logger.warning(
                    "disk tier %s: could not move %s (%s; a read-only file system?): such blocks stay indexed "
                    "and counted, and moving them is retried before each write",
                    self.directory,
                    path,
                    exc,
                )
            return False
        if self._deletes_refused:
            self._deletes_refused = False
            logger.warning("disk tier %s: files can be moved again", self.directory)
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
