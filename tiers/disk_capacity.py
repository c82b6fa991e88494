"""Which blocks the disk tier holds and in which slots, least recently used first, within a byte limit.

Data structures
---------------
- ``_index``: block hash -> :class:`Entry` (meta, generation, slot), in LRU
  order (least recently used first).
- ``_free``: the free slots of the slabs, sorted, so a batch takes the
  lowest ones and consecutive free slots become one run.
- ``_slots``: how many slots the slab files hold (slabs grow in slot order;
  the caller allocates the file space, :meth:`SlotIndex.add_slots` counts it).
- ``_writing``: block hash -> the slot a write in flight fills.
- ``_displaced``: slot -> the block evicted for the write now filling that
  slot. It is not served (the slot is being overwritten); if the write is
  refused before it touched the slot (a read-only file system, a deadline
  before it started) the block comes back, else it is gone for good --
  unless a later write is storing the same block again by then: stored
  again (in the index), it is not gone; still being written, it is gone
  only if that write fails (``_gone_unless_stored``: block hash -> its
  displaced entry, decided when that block's write settles).
- ``_reading``: slot -> reads in flight. ``_releasing``: slots out of the
  index with reads still in flight; free once the reads end.

Invariants (:meth:`SlotIndex.check_invariants`)
-----------------------------------------------
- Every slot below ``_slots`` is in exactly one place: indexed, written,
  displaced-and-written, releasing, or free. So a slot is never written
  while it is read, and never written by two writes at once.
- The slab bytes on disk (``_slots`` slots) never exceed the limit in force,
  except after an ENOSPC lowered it to them: then they equal it.
- Each entry carries a generation that tells one stored copy of a block
  apart from a later one: a late answer about the old copy must not drop the
  new one.

Capacity
--------
- ENOSPC (or EDQUOT) lowers the limit to the slab bytes held
  (:meth:`SlotIndex.disk_full`), so later blocks replace the least recently
  used ones instead of failing one after another.
- While lowered, the limit grows back (up to the configured capacity) as
  soon as the file system reports room again: ``statvfs`` is asked before a
  slab grows.

Mutations run on the tier's event loop; :meth:`SlotIndex.metas` may run on
another thread (the event publisher's snapshot), so index mutations and that
copy hold one lock.
"""

from __future__ import annotations

import bisect
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
    generation: int  # tells a stored copy apart from a later copy of the same block
    slot: int


class SlotIndex:
    """Blocks in the slots of slab files, LRU-ordered and bounded in bytes (module docstring)."""

    def __init__(self, directory: Path, *, capacity_bytes: int, slot_bytes: int) -> None:
        assert capacity_bytes >= 0 and slot_bytes > 0, "the disk tier checks its capacity"
        self.directory = directory  # whose file system ``statvfs`` is asked about
        self.capacity_bytes = capacity_bytes
        self.slot_bytes = slot_bytes
        self._limit = capacity_bytes
        self._index: OrderedDict[int, Entry] = OrderedDict()
        self._free: list[int] = []
        self._slots = 0
        self._writing: dict[int, int] = {}
        self._displaced: dict[int, Entry] = {}
        self._gone_unless_stored: dict[int, Entry] = {}
        self._reading: Counter[int] = Counter()
        self._releasing: set[int] = set()
        self._generation = 0
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_slots(self) -> int:
        """Slots the slab files hold."""
        return self._slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots in use: blocks stored, being written, and out of the index but still read."""
        return (self._slots - len(self._free)) * self.slot_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the slab files on disk."""
        return self._slots * self.slot_bytes

    @property
    def limit_bytes(self) -> int:
        """The capacity in force: the configured one, or less after the disk filled up."""
        return self._limit

    @property
    def max_slots(self) -> int:
        """How many slots fit under the limit in force."""
        return self._limit // self.slot_bytes

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
        return block_hash in self._writing

    # ------------------------------------------------------------ start-up

    def load(self, slots: int, kept: list[tuple[BlockMeta, int]]) -> None:
        """What the start-up scan found: ``slots`` slots on disk and ``kept`` blocks (oldest first) in them."""
        self._slots = slots
        used = set()
        for meta, slot in kept:
            self.insert(meta, slot)
            used.add(slot)
        self._free = [slot for slot in range(slots) if slot not in used]

    # ---------------------------------------------------------------- writes

    def take_free(self, count: int, avoid: Callable[[int], bool] | None = None) -> list[int]:
        """Up to ``count`` free slots, the lowest first, leaving out those ``avoid`` names."""
        if avoid is None:
            taken = self._free[:count]
            del self._free[:count]
            return taken
        taken = []
        for slot in self._free:
            if len(taken) == count:
                break
            if not avoid(slot):
                taken.append(slot)
        if taken:
            left = set(taken)
            self._free = [slot for slot in self._free if slot not in left]
        return taken

    def slots_to_grow(self, count: int) -> int:
        """How many of ``count`` new slots fit under the limit (grown back first, if the disk has room)."""
        if self._limit < self.capacity_bytes:
            self._regrow_limit()
        return max(0, min(count, self.max_slots - self._slots))

    def add_slots(self, count: int) -> list[int]:
        """The slab files now hold ``count`` more slots: they are the caller's to fill."""
        new = list(range(self._slots, self._slots + count))
        self._slots += count
        return new

    def evict(self, count: int, avoid: Callable[[int], bool] | None = None) -> tuple[list[int], list[Entry]]:
        """Up to ``count`` slots of the least recently used blocks, for writes: each block is displaced
        (not served) until its slot's write settles (:meth:`end_write`). Blocks being read are evicted
        too -- their slots free once the reads end -- and answered as ``gone``, along with the slots.
        Blocks in slots ``avoid`` names are passed over (they keep their place in the LRU)."""
        chosen: list[Entry] = []
        found = 0
        for entry in self._index.values():
            if found == count:
                break
            if avoid is not None and avoid(entry.slot):
                continue
            chosen.append(entry)
            found += entry.slot not in self._reading
        slots: list[int] = []
        gone: list[Entry] = []
        for entry in chosen:
            with self._lock:
                del self._index[entry.meta.block_hash]
            if entry.slot in self._reading:
                self._releasing.add(entry.slot)
                gone.append(entry)
                continue
            self._displaced[entry.slot] = entry
            slots.append(entry.slot)
        return slots, gone

    def start_write(self, block_hash: int, slot: int) -> None:
        assert block_hash not in self._writing and block_hash not in self._index, f"{block_hash:#x} written twice"
        self._writing[block_hash] = slot

    def end_write(self, meta: BlockMeta, *, stored: bool, untouched: bool) -> tuple[Entry | None, list[Entry]]:
        """The write of ``meta`` settled: ``stored`` in its slot, or not (``untouched``: the slot was not
        written at all). Returns (the new entry or None, the blocks now gone for good: the one this write
        displaced, and -- when this write failed -- this block's own earlier copy if its slot was overwritten
        while this write ran)."""
        slot = self._writing.pop(meta.block_hash)
        victim = self._displaced.pop(slot, None)
        earlier = self._gone_unless_stored.pop(meta.block_hash, None)
        if victim is not None:
            again = victim.meta.block_hash
            if again in self._writing:  # being stored again elsewhere: gone only if that write fails
                self._gone_unless_stored[again] = victim
            if again in self._index or again in self._writing:
                victim = None
        if stored:
            return self.insert(meta, slot), [victim] if victim is not None else []
        gone = [earlier] if earlier is not None else []
        if untouched and victim is not None:  # its bytes are still in the slot: it comes back, next in line
            with self._lock:
                self._index[victim.meta.block_hash] = victim
                self._index.move_to_end(victim.meta.block_hash, last=False)
            return None, gone
        bisect.insort(self._free, slot)
        return None, [*gone, *([victim] if victim is not None else [])]

    def insert(self, meta: BlockMeta, slot: int) -> Entry:
        """Index ``meta`` in ``slot`` as the most recently used block."""
        self._generation += 1
        entry = Entry(meta, self._generation, slot)
        with self._lock:
            self._index[meta.block_hash] = entry
        return entry

    # ----------------------------------------------------------------- reads

    def touch(self, block_hash: int) -> None:
        with self._lock:
            self._index.move_to_end(block_hash)

    def start_read(self, slot: int) -> None:
        """A read of ``slot`` is in flight: until :meth:`end_read` the slot is not written."""
        self._reading[slot] += 1

    def end_read(self, slot: int) -> None:
        self._reading[slot] -= 1
        if not self._reading[slot]:
            del self._reading[slot]
            if slot in self._releasing:
                self._releasing.discard(slot)
                bisect.insort(self._free, slot)

    def discard(self, entry: Entry) -> bool:
        """Stop serving ``entry`` and free its slot (once no read of it is in flight); False (and nothing
        changed) if it is gone already or a newer copy of its block replaced it."""
        block_hash = entry.meta.block_hash
        if self._index.get(block_hash) != entry:
            return False
        with self._lock:
            del self._index[block_hash]
        if entry.slot in self._reading:
            self._releasing.add(entry.slot)
        else:
            bisect.insort(self._free, entry.slot)
        return True

    def drop_all(self) -> list[Entry]:
        """The slab files are gone (their directory was removed): stop serving every stored block, free its
        slot (once no read of it is in flight), and stop counting the free slots at the top, so the slabs are
        made again from there. Slots a write or read in flight holds stay counted until it settles. Returns
        the blocks dropped."""
        with self._lock:
            gone = list(self._index.values())
            self._index.clear()
        freed = []
        for entry in gone:
            if entry.slot in self._reading:
                self._releasing.add(entry.slot)
            else:
                freed.append(entry.slot)
        self._free = sorted(self._free + freed)
        while self._free and self._free[-1] == self._slots - 1:
            self._free.pop()
            self._slots -= 1
        return gone

    # -------------------------------------------------------------- capacity

    def disk_full(self, exc: OSError) -> None:
        """A slab could not grow (ENOSPC / EDQUOT): limit the tier to the slab bytes it holds."""
        held = self.disk_bytes
        if self._limit == self.capacity_bytes and held < self._limit:
            logger.warning("disk tier %s is full (%s): limited to the %d bytes held", self.directory, exc, held)
        self._limit = min(self._limit, held)

    def _regrow_limit(self) -> None:
        """Take the configured capacity back as far as the file system has room again."""
        grown = min(self.capacity_bytes, self.disk_bytes + fs_room(self.directory))
        if grown > self._limit:
            if grown == self.capacity_bytes:
                logger.warning("disk tier %s has room again: capacity back to %d bytes", self.directory, grown)
            self._limit = grown

    def check_invariants(self, block_size: int) -> None:
        """Assert index and accounting agree (``block_size``: tokens per block); raises AssertionError."""
        assert self.disk_bytes <= self._limit, f"{self.disk_bytes} slab bytes, limit {self._limit}"
        assert self._limit <= self.capacity_bytes, f"limit {self._limit} above the capacity {self.capacity_bytes}"
        generations = [entry.generation for entry in self._index.values()]
        assert len(set(generations)) == len(generations), "two index entries share a generation"
        for block_hash, entry in self._index.items():
            assert entry.meta.block_hash == block_hash, f"entry {block_hash:#x} holds {entry.meta.block_hash:#x}"
            assert len(entry.meta.token_ids) == block_size
        for block_hash in self._writing:
            assert block_hash not in self._index, f"block {block_hash:#x} is both stored and being written"
        places = [
            *(entry.slot for entry in self._index.values()),
            *self._writing.values(),
            *self._releasing,
            *self._free,
        ]
        assert len(places) == len(set(places)), "a slot is in two places at once"
        assert sorted(places) == list(range(self._slots)), "a slot is lost or out of range"
        assert self._free == sorted(self._free), "the free list is out of order"
        assert set(self._displaced) <= set(self._writing.values()), "a displaced block whose slot no write fills"
        assert set(self._gone_unless_stored) <= set(self._writing), "a removal waiting on a write not in flight"
        for slot in self._writing.values():
            assert slot not in self._reading, f"slot {slot} is written while it is read"


def fs_room(directory: Path) -> int:
    """Bytes a new file may still take on ``directory``'s file system: 0 when it is out of space or inodes."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    if st.f_files and not st.f_favail:  # some file systems (btrfs) report no inode counts at all
        return 0
    return st.f_bavail * st.f_frsize
