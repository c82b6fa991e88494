"""The disk tier's start-up scan: which block files of an earlier life to keep, so a restart keeps the cache.

- Temporaries are removed: a write that never reached its rename (a crash)
  is not a block.
- A file whose name, place, size or header is not that of a block of this
  cache identity is removed, counted by reason: it can never be served.
- Only headers are read. Payload checksums are verified on every read
  instead: reading every payload would make a start take as long as reading
  the whole disk tier.
- Files are kept oldest modification first (next to be evicted), so the LRU
  order survives a restart as well as modification times tell it; the
  oldest beyond the capacity in force are removed.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk_files import FileLayout, errno_name, read_header_meta, remove
from kvstore.tiers.disk_format import (
    SPARE_DIR,
    SPARE_SUFFIX,
    SUFFIX,
    TEMP_SUFFIX,
    IntegrityError,
    file_name,
    shard_name,
)

logger = logging.getLogger(__name__)


class ScanResult(NamedTuple):
    kept: list[BlockMeta]  # oldest modification first
    removed: Counter[str]  # reason -> files removed
    io_errors: Counter[str]  # errno name -> files that could not be checked (left in place, not indexed)
    spares: list[int]  # ids of the spare files kept (retired block files, sized right)


def scan(directory: Path, layout: FileLayout, max_blocks: int) -> ScanResult:
    """Check every file in ``directory``'s shard folders; keep at most ``max_blocks``, the newest."""
    removed: Counter[str] = Counter()
    io_errors: Counter[str] = Counter()
    found: list[tuple[int, BlockMeta]] = []
    for shard in sorted(directory.iterdir()):
        if not shard.is_dir() or shard.name == SPARE_DIR:
            continue
        with os.scandir(shard) as listing:
            for item in listing:
                if item.name.endswith(TEMP_SUFFIX):
                    remove(Path(item.path))
                    removed["temporary"] += 1
                    continue
                if not item.name.endswith(SUFFIX) or not item.is_file(follow_symlinks=False):
                    continue
                try:
                    meta = _check_file(Path(item.path), item.stat().st_size, shard.name, layout)
                except IntegrityError as exc:
                    remove(Path(item.path))
                    removed[exc.reason] += 1
                    continue
                except OSError as exc:
                    io_errors[errno_name(exc)] += 1
                    continue
                found.append((item.stat().st_mtime_ns, meta))
    found.sort(key=lambda pair: pair[0])
    keep = min(len(found), max_blocks)
    for _, meta in found[: len(found) - keep]:
        remove(directory / shard_name(meta.block_hash) / file_name(meta.block_hash))
        removed["over_capacity"] += 1
    spares = _scan_spares(directory / SPARE_DIR, layout, max_blocks - keep, removed)
    if found or removed or spares:
        logger.info(
            "disk tier %s: %d blocks and %d spares kept, removed %s", directory, keep, len(spares), dict(removed)
        )
    return ScanResult([meta for _, meta in found[len(found) - keep :]], removed, io_errors, spares)


def _scan_spares(spare_dir: Path, layout: FileLayout, room: int, removed: Counter[str]) -> list[int]:
    """Spare files named and sized right, at most ``room`` of them; the rest are removed."""
    spares: list[int] = []
    if not spare_dir.is_dir():
        return spares
    with os.scandir(spare_dir) as listing:
        for item in listing:
            stem = item.name[: -len(SPARE_SUFFIX)] if item.name.endswith(SPARE_SUFFIX) else ""
            good = stem.isdigit() and item.is_file(follow_symlinks=False) and item.stat().st_size == layout.file_bytes
            if good and len(spares) < room:
                spares.append(int(stem))
            else:
                remove(Path(item.path))
                removed["spare" if good else "bad_spare"] += 1
    return spares


def _check_file(path: Path, size: int, shard: str, layout: FileLayout) -> BlockMeta:
    """The block ``path`` holds; raises IntegrityError if it is not where, or what, its name says."""
    stem = path.name[: -len(SUFFIX)]
    try:
        named = int(stem, 16)
    except ValueError:
        raise IntegrityError("bad_name", f"{path.name} is not a block file name") from None
    if path.name != file_name(named) or shard != shard_name(named):
        raise IntegrityError("bad_name", f"{path} is not where block {named:#x} belongs")
    if size != layout.file_bytes:
        raise IntegrityError("bad_length", f"{path} is {size} bytes, expected {layout.file_bytes}")
    meta = read_header_meta(path, layout)
    if meta.block_hash != named:
        raise IntegrityError("wrong_hash", f"{path.name} holds block {meta.block_hash:#x}")
    return meta
