"""Which blocks the disk tier holds, least recently used first, and how many bytes it may hold.

Contracts
---------
- The index never holds more than the limit in force: :meth:`DiskIndex.make_room`
  evicts least recently used blocks until one more write -- beside the ones
  already in flight, which will land -- fits.
- ENOSPC (or EDQUOT) lowers the limit to the bytes held (:meth:`DiskIndex.disk_full`),
  so later blocks replace the least recently used ones instead of failing
  one after another.
- While lowered, the limit grows back (up to the configured capacity) as soon
  as the file system reports room again: ``statvfs`` is asked before each
  write. Without that, a disk that filled up and later freed space kept the
  tier at what it held then -- after a while of failed writes, each evicting a
  block first, at nothing -- until a restart. And since room is asked for, a
  write that fails while the file system reports room (a quota, another
  writer) gives up no stored block for it.
- Every block file has one size, so bytes are counted in files.
- Each entry carries a generation that tells a file apart from a later file of
  the same block: a late answer about the old one must not drop the new one.
- Files are reused, not deleted: creating a file and allocating its blocks
  is what a small-block write costs most (docs/tiers.md). An evicted
  block's file is *retired* -- renamed to a spare -- and the next write
  overwrites a spare and renames it into place; only when no spare is left
  does a write create a file. Spares are files on disk, so they count in
  the bytes held, and a write that takes one needs no new room.
- A block leaves the index only once its file is gone. Eviction retires
  through the caller's ``retire``; a file that cannot be deleted (a
  read-only file system: EROFS, EACCES, EPERM) keeps its entry, readable
  and at the LRU head, so the next :meth:`DiskIndex.make_room` retries it.
  A file that must not be served any more (refused by its checksum) but
  cannot be deleted is kept aside as *undeleted*: out of the index, still
  counted in the bytes held, its deletion retried by every ``make_room``.
  So the bytes held are always the files on disk, read-only or not.

Mutations run on the tier's event loop; :meth:`DiskIndex.metas` may run on
another thread (the event publisher's snapshot), so index mutations and that
copy hold one lock.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from kvstore.tiers.blocks import BlockMeta

logger = logging.getLogger(__name__)


class Entry(NamedTuple):
    meta: BlockMeta
    generation: int  # tells a file apart from a later file of the same block


class Room(NamedTuple):
    """What :meth:`DiskIndex.make_room` did."""

    fits: bool  # one more file fits under the limit now
    evicted: list[Entry]  # retired (by the caller's ``retire``) and forgotten by the index
    stuck: bool  # a file that had to go could not be retired (the file system refused)
    spare: int | None  # the spare the write takes (then it needs no new room), or None: a new file
    dropped: list[int]  # spares beyond the limit (after ENOSPC lowered it): the caller deletes them


Retire = Callable[[Entry, int], bool | None]
"""Rename ``entry``'s file to spare ``id``: True when it is a spare now, None when the file was gone
already, False when the file system refused (the file stays where it is)."""


class DiskIndex:
    """An LRU index of block files bounded in bytes, with the limit that ENOSPC lowers (module docstring)."""

    def __init__(self, directory: Path, *, capacity_bytes: int, file_bytes: int) -> None:
        assert capacity_bytes >= 0 and file_bytes > 0, "the disk tier checks its capacity"
        self.directory = directory  # whose file system ``statvfs`` is asked about
        self.capacity_bytes = capacity_bytes
        self.file_bytes = file_bytes
        self._limit = capacity_bytes
        self._index: OrderedDict[int, Entry] = OrderedDict()
        self._inflight: set[int] = set()  # hashes being written (each a temporary or a taken spare on disk)
        self._undeleted: dict[int, Entry] = {}  # out of the index, file still on disk: to retire
        self._spares: list[int] = []  # ids of spare files, ready to be overwritten
        self._taken: dict[int, int] = {}  # hash being written -> the spare it overwrites
        self._next_spare = 0
        self._reading: Counter[int] = Counter()  # hash -> reads of its file in flight: not retired meanwhile
        self._generation = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the files on disk: indexed, not deleted yet, spare, and being written."""
        files = len(self._index) + len(self._undeleted) + len(self._spares) + len(self._inflight)
        return files * self.file_bytes

    @property
    def num_spares(self) -> int:
        return len(self._spares)

    def spare_ids(self) -> list[int]:
        return list(self._spares)

    @property
    def num_undeleted(self) -> int:
        """Files refused (no longer served) whose deletion the file system has refused so far."""
        return len(self._undeleted)

    @property
    def limit_bytes(self) -> int:
        """The capacity in force: the configured one, or less after the disk filled up."""
        return self._limit

    @property
    def max_blocks(self) -> int:
        """How many files fit under the limit in force."""
        return self._limit // self.file_bytes

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def get(self, block_hash: int) -> Entry | None:
        return self._index.get(block_hash)

    def lru_hashes(self) -> list[int]:
        """Stored block hashes, least recently used (next to be evicted) first."""
        return list(self._index)

    def metas(self) -> list[BlockMeta]:
        """Every stored block. Safe from another thread."""
        with self._lock:
            return [entry.meta for entry in self._index.values()]

    def is_writing(self, block_hash: int) -> bool:
        return block_hash in self._inflight

    # ---------------------------------------------------------------- mutation

    def start_read(self, block_hash: int) -> None:
        """A read of the block's file is in flight: until :meth:`end_read` the file is not made a spare
        (a spare is overwritten by the next write, under the reader)."""
        self._reading[block_hash] += 1

    def end_read(self, block_hash: int) -> None:
        self._reading[block_hash] -= 1
        if not self._reading[block_hash]:
            del self._reading[block_hash]

    def add_spares(self, ids: list[int]) -> None:
        """Spare files found on disk (the start-up scan)."""
        self._spares.extend(ids)
        self._next_spare = max([self._next_spare - 1, *ids]) + 1

    def start_write(self, block_hash: int, spare: int | None) -> None:
        """Count a write in flight (into ``spare``, taken by :meth:`make_room`, or a new file) until
        :meth:`end_write`."""
        assert block_hash not in self._inflight and block_hash not in self._index, f"{block_hash:#x} written twice"
        self._inflight.add(block_hash)
        if spare is not None:
            self._taken[block_hash] = spare

    def end_write(self, block_hash: int, *, spare_left: bool) -> None:
        """The write settled; ``spare_left``: it failed and the spare it took is still a spare file."""
        self._inflight.discard(block_hash)
        spare = self._taken.pop(block_hash, None)
        if spare is not None and spare_left:
            self._spares.append(spare)

    def insert(self, meta: BlockMeta) -> Entry:
        """Index ``meta``'s file as the most recently used block (it replaced any undeleted file of it)."""
        self._generation += 1
        entry = Entry(meta, self._generation)
        self._undeleted.pop(meta.block_hash, None)
        with self._lock:
            self._index[meta.block_hash] = entry
        return entry

    def touch(self, block_hash: int) -> None:
        with self._lock:
            self._index.move_to_end(block_hash)

    def discard(self, entry: Entry) -> bool:
        """Forget ``entry``; False (and nothing changed) if a newer file of its block replaced it."""
        block_hash = entry.meta.block_hash
        if self._index.get(block_hash) != entry:
            return False
        with self._lock:
            del self._index[block_hash]
        return True

    def keep_undeleted(self, entry: Entry) -> None:
        """``entry`` left the index (:meth:`discard`) but its file could not be deleted: count it until it is."""
        assert entry.meta.block_hash not in self._index, "an indexed block is not undeleted"
        self._undeleted[entry.meta.block_hash] = entry

    def make_room(self, retire: Retire) -> Room:
        """Room for one more write: a spare to overwrite, or room under the limit for a new file.

        First retries the undeleted files, then drops spares beyond the
        limit, then takes a spare, or fits a new file, or retires the least
        recently used block to a spare and takes that. An entry whose file
        the file system refuses to move is kept (readable, next in line) and
        eviction stops there.
        """
        if self._limit < self.capacity_bytes:
            self._regrow_limit()
        for block_hash, entry in list(self._undeleted.items()):
            # One being written again is replaced by its rename: moving it now could move the new file;
            # one being read is moved once the read is done.
            if block_hash not in self._inflight and block_hash not in self._reading:
                retired = retire(entry, self._next_spare)
                if retired is not False:
                    del self._undeleted[block_hash]
                if retired:
                    self._spares.append(self._next_spare)
                    self._next_spare += 1
        dropped = []
        while self._spares and self.used_bytes > self._limit:
            dropped.append(self._spares.pop())
        evicted: list[Entry] = []
        if self._spares:
            return Room(True, evicted, False, self._spares.pop(), dropped)
        while self.used_bytes + self.file_bytes > self._limit and self._index:
            block_hash, entry = next(iter(self._index.items()))
            if block_hash in self._reading:  # evicted now, its file retired once the read is done
                with self._lock:
                    del self._index[block_hash]
                evicted.append(entry)
                self.keep_undeleted(entry)
                continue
            retired = retire(entry, self._next_spare)
            if retired is False:
                return Room(False, evicted, True, None, dropped)
            with self._lock:
                del self._index[block_hash]
            evicted.append(entry)
            if retired:
                self._next_spare += 1
                return Room(True, evicted, False, self._next_spare - 1, dropped)
        return Room(self.used_bytes + self.file_bytes <= self._limit, evicted, False, None, dropped)

    def retire_file(self, entry: Entry, retire: Retire) -> None:
        """``entry`` left the index (:meth:`discard`): make its file a spare, or keep it undeleted if refused
        (or while a read of it is in flight)."""
        if entry.meta.block_hash in self._reading:
            self.keep_undeleted(entry)
            return
        retired = retire(entry, self._next_spare)
        if retired:
            self._spares.append(self._next_spare)
            self._next_spare += 1
        elif retired is False:
            self.keep_undeleted(entry)

    def keep_spare(self, spare: int) -> None:
        """A spare :meth:`make_room` dropped could not be deleted: it stays a spare."""
        self._spares.append(spare)

    def disk_full(self, exc: OSError) -> None:
        """A write failed with ENOSPC / EDQUOT: limit the tier to the bytes it holds."""
        held = self.used_bytes
        if self._limit == self.capacity_bytes and held < self._limit:
            logger.warning("disk tier %s is full (%s): limited to the %d bytes held", self.directory, exc, held)
        self._limit = min(self._limit, held)

    def _regrow_limit(self) -> None:
        """Take the configured capacity back as far as the file system has room again."""
        grown = min(self.capacity_bytes, self.used_bytes + fs_room(self.directory))
        if grown > self._limit:
            if grown == self.capacity_bytes:
                logger.warning("disk tier %s has room again: capacity back to %d bytes", self.directory, grown)
            self._limit = grown

    def check_invariants(self, block_size: int) -> None:
        """Assert index and accounting agree (``block_size``: tokens per block); raises AssertionError."""
        assert self.used_bytes <= self._limit, f"{self.used_bytes} bytes held, limit {self._limit}"
        assert self._limit <= self.capacity_bytes, f"limit {self._limit} above the capacity {self.capacity_bytes}"
        generations = [entry.generation for entry in self._index.values()]
        assert len(set(generations)) == len(generations), "two index entries share a generation"
        for block_hash, entry in self._index.items():
            assert entry.meta.block_hash == block_hash, f"entry {block_hash:#x} holds {entry.meta.block_hash:#x}"
            assert len(entry.meta.token_ids) == block_size
        for block_hash in self._inflight:
            assert block_hash not in self._index, f"block {block_hash:#x} is both stored and being written"
        for block_hash, entry in self._undeleted.items():
            assert block_hash not in self._index, f"block {block_hash:#x} is both stored and undeleted"
            assert entry.meta.block_hash == block_hash
        spares = [*self._spares, *self._taken.values()]
        assert len(set(spares)) == len(spares), "a spare file is counted twice"
        assert all(0 <= spare < self._next_spare for spare in spares), "a spare id was handed out twice"
        assert set(self._taken) <= self._inflight, "a spare is taken by no write"


def fs_room(directory: Path) -> int:
    """Bytes a new file may still take on ``directory``'s file system: 0 when it is out of space or inodes."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    if st.f_files and not st.f_favail:  # some file systems (btrfs) report no inode counts at all
        return 0
    return st.f_bavail * st.f_frsize
