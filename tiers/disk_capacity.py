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
- A block leaves the index only once its file is gone. Eviction deletes
  through the caller's ``delete``; a file that cannot be deleted (a
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
from collections import OrderedDict
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
    evicted: list[Entry]  # deleted (by the caller's ``delete``) and forgotten by the index
    stuck: bool  # a file that had to go could not be deleted (the file system refused)


class DiskIndex:
    """An LRU index of block files bounded in bytes, with the limit that ENOSPC lowers (module docstring)."""

    def __init__(self, directory: Path, *, capacity_bytes: int, file_bytes: int) -> None:
        assert capacity_bytes >= 0 and file_bytes > 0, "the disk tier checks its capacity"
        self.directory = directory  # whose file system ``statvfs`` is asked about
        self.capacity_bytes = capacity_bytes
        self.file_bytes = file_bytes
        self._limit = capacity_bytes
        self._index: OrderedDict[int, Entry] = OrderedDict()
        self._inflight: set[int] = set()  # hashes being written
        self._undeleted: dict[int, Entry] = {}  # out of the index, file still on disk: to delete
        self._generation = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes of the files on disk: the indexed ones and those not deleted yet."""
        return (len(self._index) + len(self._undeleted)) * self.file_bytes

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

    def start_write(self, block_hash: int) -> None:
        """Count a write in flight against the limit until :meth:`end_write`."""
        assert block_hash not in self._inflight and block_hash not in self._index, f"{block_hash:#x} written twice"
        self._inflight.add(block_hash)

    def end_write(self, block_hash: int) -> None:
        self._inflight.discard(block_hash)

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

    def make_room(self, delete: Callable[[Entry], bool]) -> Room:
        """Free room until one more file (beside those in flight) fits.

        First retries the undeleted files, then evicts least recently used
        blocks; ``delete(entry)`` removes a file, False if the file system
        refused. An entry whose file stays is kept (readable, next in line)
        and eviction stops there: the file system is refusing deletions.
        """
        if self._limit < self.capacity_bytes:
            self._regrow_limit()
        for block_hash, entry in list(self._undeleted.items()):
            # One being written again is replaced by its rename: deleting now could delete the new file.
            if block_hash not in self._inflight and delete(entry):
                del self._undeleted[block_hash]
        need = (len(self._inflight) + 1) * self.file_bytes
        evicted = []
        stuck = False
        while self._index and self.used_bytes + need > self._limit:
            block_hash, entry = next(iter(self._index.items()))
            if not delete(entry):
                stuck = True
                break
            with self._lock:
                del self._index[block_hash]
            evicted.append(entry)
        return Room(self.used_bytes + need <= self._limit, evicted, stuck)

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


def fs_room(directory: Path) -> int:
    """Bytes a new file may still take on ``directory``'s file system: 0 when it is out of space or inodes."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    if st.f_files and not st.f_favail:  # some file systems (btrfs) report no inode counts at all
        return 0
    return st.f_bavail * st.f_frsize
