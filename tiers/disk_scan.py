"""The disk tier's start-up scan: which slots of an earlier life hold blocks, so a restart keeps the cache.

- Slabs are taken in order while each earlier one is full (slots are handed
  out in order, so a gap means damage): a slab after a short one
  (``slab_after_a_gap``) and one too short to hold a whole slot
  (``slab_too_short``: empty, or cut inside its first slot) are removed. An entry with a slab's name that is not a
  regular file -- a symlink, dangling or not, a FIFO -- is removed
  (``not_a_file``: the link itself, never what it names), so no later write
  goes through it; a directory under a slab's name is logged and left. Files
  whose names are not a slab's are not the tier's: left alone.
- A capacity smaller than the slots found (the tier was restarted with less
  room) keeps the newest blocks, not the lowest slots: those beyond the cut
  are copied, header and payload as written, over the slots of the oldest
  blocks (``dropped_to_fit``) or free ones, then whatever lies beyond the
  capacity is cut off or removed. A copy that fails drops its block
  (``move_failed``). Each source stays until its copy is done, so a
  process crash part way loses no block that was kept (see :func:`_fit`).
- Each slot's header is read (one ``pread`` per slot, not the payload:
  reading every payload would make a start take as long as reading the
  whole tier; checksums are verified on every read instead). On a cold
  page cache each ``pread`` is a device round trip, so the headers of a
  slab and of the next one are first asked for with
  ``posix_fadvise(WILLNEED)`` (the kernel reads them ahead, many at once)
  and then read in order. 65,536 slots of 16 KiB blocks on the development
  VM's disk, caches dropped: 7.5 s one round trip at a time, 1.3 s
  prefetched (16 threads of plain ``pread`` took 2.7 s, held up by the
  GIL, and slowed a warm scan 0.6 -> 1.1 s; prefetching costs a warm
  scan 0.6 -> 0.7 s). A slot whose
  header is not that of a block of this cache identity is free, counted by
  reason (``bad_magic`` when its header is not a block's at all: damage,
  or a file that was never a slab). A never-written slot (zeros) or an
  invalidated one is simply free, not counted.
- The same block in two slots (an evicted copy that was not overwritten yet,
  and a later one) keeps the later write.
- Blocks are kept oldest write first (next to be evicted), so the LRU order
  survives a restart as well as write order tells it.
- Files of format version 1 (one file per block, spares, temporaries) are
  removed, and their 256 shard folders with them.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_files import FileLayout, errno_name, open_slab, read_header_at, remove
from kvstore.tiers.disk_format import OLD_SUFFIXES, IntegrityError, slab_name, slab_number, slots_per_slab

logger = logging.getLogger(__name__)


class ScanResult(NamedTuple):
    slots: int  # slots in the slab files kept
    kept: list[tuple[BlockMeta, int]]  # (block, slot), oldest write first
    removed: Counter[str]  # reason -> slots or files dropped
    io_errors: Counter[str]  # errno name -> slabs that could not be read (their slots are free)
    next_sequence: int  # one past the newest write sequence found


def scan(directory: Path, layout: FileLayout, max_slots: int) -> ScanResult:
    """Check every slab in ``directory``; keep at most ``max_slots`` slots of slabs, and the newest blocks in them."""
    removed: Counter[str] = Counter()
    io_errors: Counter[str] = Counter()
    _remove_old_format(directory, removed)
    per_slab = slots_per_slab(layout.file_bytes)
    slabs: dict[int, int] = {}  # slab -> its size in bytes
    with os.scandir(directory) as listing:
        for item in listing:
            number = slab_number(item.name)
            if number is None:
                continue  # not a slab's name: not ours, left alone
            if item.is_file(follow_symlinks=False):
                slabs[number] = item.stat(follow_symlinks=False).st_size
            else:  # a symlink (never followed: the tier would write through it), a directory, a FIFO...
                if _remove_entry(Path(item.path)):
                    removed["not_a_file"] += 1
    slots = 0  # slots of the slabs in order from the first, each earlier one full
    present: list[_Slab] = []  # in slab order
    for number in sorted(slabs):
        path = directory / slab_name(number)
        whole = min(slabs[number] // layout.file_bytes, per_slab)
        if number * per_slab != slots or whole == 0:
            removed["slab_after_a_gap" if number * per_slab != slots else "slab_too_short"] += 1
            remove(path)
            continue
        present.append(_Slab(path, slots, whole, slabs[number]))
        slots += whole
    found = _read_headers(present, layout, removed, io_errors)
    if slots > max_slots:  # a smaller capacity than the last life's: the newest blocks move into the slots kept
        found = _fit(found, present, max_slots, layout, removed)
    for slab in present:
        keep = max(0, min(slab.whole, max_slots - slab.first_slot))
        if keep == 0:
            removed["slab_beyond_capacity"] += 1
            remove(slab.path)
        elif keep * layout.file_bytes != slab.size:
            _cut(slab.path, keep * layout.file_bytes, removed)  # a torn growth, or a smaller capacity
    slots = min(slots, max_slots)
    ordered = sorted(found.values(), key=lambda item: item[0])
    kept = [(meta, slot) for _, meta, slot in ordered]
    next_sequence = ordered[-1][0] + 1 if ordered else 0
    if kept or removed:
        logger.info("disk tier %s: %d slots, %d blocks kept, removed %s", directory, slots, len(kept), dict(removed))
    return ScanResult(slots, kept, removed, io_errors, next_sequence)


class _Slab(NamedTuple):
    path: Path
    first_slot: int
    whole: int  # whole slots in the file
    size: int  # bytes


Found = dict[int, tuple[int, BlockMeta, int]]  # hash -> (write sequence, meta, slot)


def _read_headers(present: list[_Slab], layout: FileLayout, removed: Counter[str], io_errors: Counter[str]) -> Found:
    """The blocks in the slots of ``present``: each hash once, its latest write (an earlier copy is a duplicate)."""
    found: Found = {}
    if present:
        _prefetch(present[0].path, present[0].whole, layout)
    for position, (path, first_slot, count, _) in enumerate(present):
        if position + 1 < len(present):  # the next slab's headers come in while this one's are read
            _prefetch(present[position + 1].path, present[position + 1].whole, layout)
        read = _read_slab(path, count, layout)
        if isinstance(read, OSError):
            io_errors[errno_name(read)] += 1
            continue
        held, damaged = read
        removed.update(damaged)
        for index, meta, sequence in held:
            earlier = found.get(meta.block_hash)
            if earlier is not None:
                removed["duplicate"] += 1
                if earlier[0] > sequence:
                    continue
            found[meta.block_hash] = (sequence, meta, first_slot + index)
    return found


def _fit(found: Found, present: list[_Slab], max_slots: int, layout: FileLayout, removed: Counter[str]) -> Found:
    """The newest ``max_slots`` blocks of ``found``, each in a slot below ``max_slots``: those beyond it are copied
    (header and payload, as written) into the slots of older blocks or free ones; the older blocks are dropped
    (``dropped_to_fit``). A copy that fails drops its block (``move_failed``).

    Safe against a process crash without a sync: the copy's source stays until the caller cuts its slab off,
    so a scan after a crash finds the block there again (a copy torn on its way in has the same write
    sequence, loses to the source as a duplicate, and is overwritten or fails its checksum if ever read). A
    power cut may lose moved blocks whose copies were not yet on the device; their checksums keep them from
    ever being served wrong.
    """
    oldest_first = sorted(found.values(), key=lambda item: item[0])
    cut = max(0, len(oldest_first) - max_slots)
    dropped, chosen = oldest_first[:cut], oldest_first[cut:]  # chosen oldest first: moved blocks keep their order
    removed["dropped_to_fit"] += len(dropped)
    staying = {slot for _, _, slot in chosen if slot < max_slots}
    targets = iter(slot for slot in range(max_slots) if slot not in staying)
    slab_of = {slab.first_slot + index: (slab.path, index) for slab in present for index in range(slab.whole)}
    fitted: Found = {}
    moved = 0
    for sequence, meta, slot in chosen:
        if slot < max_slots:
            fitted[meta.block_hash] = (sequence, meta, slot)
            continue
        target = next(targets)
        try:
            _copy_slot(slab_of[slot], slab_of[target], layout.file_bytes)
        except OSError as exc:
            logger.warning("could not move block %#x from slot %d to %d: %s", meta.block_hash, slot, target, exc)
            removed["move_failed"] += 1
            continue
        fitted[meta.block_hash] = (sequence, meta, target)
        moved += 1
    logger.info(
        "disk tier: capacity down to %d slots: %d blocks moved into them, %d dropped", max_slots, moved, len(dropped)
    )
    return fitted


def _copy_slot(source: tuple[Path, int], target: tuple[Path, int], file_bytes: int) -> None:
    """Copy one slot (header and payload) to another, in the same or another slab. Raises OSError."""
    src = open_slab(source[0], os.O_RDONLY)
    try:
        data = os.pread(src, file_bytes, source[1] * file_bytes)
    finally:
        os.close(src)
    if len(data) != file_bytes:
        raise OSError(errno.EIO, f"slot read back {len(data)} of {file_bytes} bytes")
    dst = open_slab(target[0], os.O_WRONLY)
    try:
        if os.pwrite(dst, data, target[1] * file_bytes) != file_bytes:
            raise OSError(errno.EIO, "short write")
    finally:
        os.close(dst)


def _prefetch(path: Path, count: int, layout: FileLayout) -> None:
    """Ask the kernel to read the headers of a slab's first ``count`` slots ahead (best effort)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = open_slab(path, os.O_RDONLY)
    except OSError:
        return  # _read_slab meets and counts it
    try:
        for index in range(count):
            os.posix_fadvise(fd, index * layout.file_bytes, layout.header_len, os.POSIX_FADV_WILLNEED)
    except OSError as exc:  # a hint only: the reads still happen
        logger.debug("readahead hint for %s failed: %s", path, exc)
    finally:
        os.close(fd)


def _read_slab(
    path: Path, count: int, layout: FileLayout
) -> tuple[list[tuple[int, BlockMeta, int]], Counter[str]] | OSError:
    """The headers of a slab's first ``count`` slots: (slot index, block, write sequence) of each that holds a
    block of this identity, and the damaged ones counted by reason; or the OSError that stopped the read."""
    held: list[tuple[int, BlockMeta, int]] = []
    damaged: Counter[str] = Counter()
    try:
        fd = open_slab(path, os.O_RDONLY)
        try:
            for index in range(count):
                try:
                    header = read_header_at(fd, index * layout.file_bytes, layout)
                except IntegrityError as exc:  # free, counted: not zeros (never written, invalidated)
                    damaged[exc.reason] += 1
                    continue
                if header is not None:
                    held.append((index, *header))
        finally:
            os.close(fd)
    except OSError as exc:
        return exc
    return held, damaged


def _cut(path: Path, nbytes: int, removed: Counter[str]) -> None:
    """Cut a slab back to its whole slots under the capacity (a torn growth, a smaller capacity)."""
    try:
        fd = open_slab(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        removed["slab_cut"] += 1
    except OSError as exc:
        logger.warning("could not cut %s to %d bytes: %s", path, nbytes, exc)


def _remove_entry(path: Path) -> bool:
    """Remove a slab-named entry that is not a regular file -- a link itself (never what it names), a FIFO,
    a socket -- and True once it is gone. A directory (format 1's folders are cleared before) is not the
    tier's to delete: logged and left (False), the slab of that name then cannot grow and writes that need
    it are *not stored* (``io_error``)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove %s (not a slab file): %s", path, exc)
        return False
    return True


def _remove_old_format(directory: Path, removed: Counter[str]) -> None:
    """Format 1's block files, spares and temporaries, and their folders once empty."""
    for folder in sorted(directory.iterdir()):
        if not folder.is_dir() or folder.is_symlink():
            continue
        with os.scandir(folder) as listing:
            for item in listing:
                old = item.name.endswith(OLD_SUFFIXES) and item.is_file(follow_symlinks=False)
                if old and remove(Path(item.path)):
                    removed["old_format"] += 1
        try:
            folder.rmdir()
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                logger.warning("could not remove %s: %s", folder, exc)
