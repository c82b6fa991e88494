"""The disk tier on a file system that turns read-only under it, then writable again.

The directory of the tier's files is made read-only for real where this
process may do so -- a read-only bind mount of the directory onto itself,
which refuses writes, renames and unlinks with EROFS even to root (a
``chmod`` would not stop root). Where mounting is not allowed (no
CAP_SYS_ADMIN), the same errno is injected instead at the tier's system-call
wrapper (:mod:`kvstore.tiers.disk_files`: ``os.open`` for writing, ``os.replace``,
``os.unlink``), and the test says which in its output. ``KVSTORE_TEST_INJECT_EROFS=1``
picks the injection even where mounting is allowed.

What must hold while it is read-only: no block leaves the index for a write
that cannot happen (the block evicted for it comes back: it stays readable
and is served), a slot refused by its checksum is no longer served, and the
slab bytes on disk are exactly what the tier accounts for. Once writable
again, the tier stores blocks -- the refused slot first -- and its
accounting is still exact.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import kvstore.tiers.disk_files as disk_files
from kvstore.events import BlockRemoved
from kvstore.hashing import BlockHasher
from kvstore.kv_layout import KVLayout
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.identity import CacheIdentity

IDENTITY = CacheIdentity(
    model="readonly-test",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=4),
    hash_algo="sha256_cbor",
    hash_seed="kvstore",
)
CAPACITY_FILES = 8


def blocks(count: int) -> tuple[list[BlockMeta], list[memoryview]]:
    """Chained blocks and their KV in page-aligned buffers (as arena slots are)."""
    hasher = BlockHasher(IDENTITY.hash_algo, IDENTITY.hash_seed, IDENTITY.block_size)
    tokens = list(range(count * IDENTITY.block_size))
    metas = BlockMeta.chain(hasher.hash_blocks(tokens), tokens, IDENTITY.block_size)
    generator = torch.Generator().manual_seed(7)
    views = []
    for _ in metas:
        view = memoryview(mmap.mmap(-1, IDENTITY.block_bytes))
        view[:] = torch.randint(0, 256, (IDENTITY.block_bytes,), dtype=torch.uint8, generator=generator).numpy()
        views.append(view)
    return metas, views


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True, timeout=10).returncode == 0


class _ReadOnlyOs:
    """``os`` as :mod:`kvstore.tiers.disk_files` sees it on a read-only file system: EROFS for every change."""

    def __init__(self) -> None:
        self._os = os

    def __getattr__(self, name: str) -> Any:
        return getattr(self._os, name)

    def open(self, path: Any, flags: int, *args: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))
        return self._os.open(path, flags, *args)

    def replace(self, src: Any, dst: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(src))

    def unlink(self, path: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system (injected)", str(path))


@contextmanager
def read_only(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``directory`` read-only until the block ends: a real bind mount where allowed, else injected EROFS."""
    mountable = os.geteuid() == 0 and not os.environ.get("KVSTORE_TEST_INJECT_EROFS")
    if mountable and _mount("--bind", str(directory), str(directory)):
        try:
            if not _mount("-o", "remount,bind,ro", str(directory)):
                pytest.skip("could not remount the bind mount read-only")
            probe = directory / f"probe-{uuid.uuid4().hex}"
            with pytest.raises(OSError) as refused:
                probe.touch()
            assert refused.value.errno == errno.EROFS
            yield "read-only bind mount"
        finally:
            _mount("-o", "remount,bind,rw", str(directory))
            subprocess.run(["umount", str(directory)], capture_output=True, timeout=10, check=True)
        return
    with monkeypatch.context() as patch:
        patch.setattr(disk_files, "os", _ReadOnlyOs())
        yield "EROFS injected at the disk tier's system calls"


def slab_bytes_on_disk(tier: DiskTier) -> int:
    """Bytes of every slab file: what the tier must account for."""
    return sum(path.stat().st_size for path in tier.directory.glob("*.kvslab"))


def flip_payload_byte(tier: DiskTier, block_hash: int) -> None:
    path, offset = tier.location_of(block_hash)
    with path.open("r+b") as fh:
        fh.seek(offset + tier.file_bytes - 1)
        last = fh.read(1)
        fh.seek(offset + tier.file_bytes - 1)
        fh.write(bytes([last[0] ^ 0xFF]))


def test_read_only_disk_keeps_its_entries_and_exact_accounting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    metas, views = blocks(CAPACITY_FILES + 4)
    held, newer = metas[:CAPACITY_FILES], metas[CAPACITY_FILES:]
    out = memoryview(mmap.mmap(-1, IDENTITY.block_bytes))

    async def scenario() -> str:
        tier = DiskTier(
            tmp_path / "disk",
            IDENTITY,
            capacity_bytes=CAPACITY_FILES * (IDENTITY.block_bytes + 4096),
            deadline_s=5.0,
            max_concurrent_io=4,
        )
        try:
            assert all(await tier.write_many([(m, v, lambda ok: None) for m, v in zip(held, views, strict=False)]))
            assert tier.num_blocks == CAPACITY_FILES and slab_bytes_on_disk(tier) == tier.disk_bytes
            flip_payload_byte(tier, held[0].block_hash)  # damaged: refused on read
            tier.take_events()

            with read_only(tier.directory, monkeypatch) as how:
                # Writes need room: the least recently used block is evicted for each, the write is refused
                # before it touches the slot, and the block comes back: nothing is stored, nothing is lost...
                for meta, view in zip(newer, views[CAPACITY_FILES:], strict=True):
                    assert not await tier.write(meta, view)
                assert tier.num_blocks == CAPACITY_FILES, "blocks still on disk left the index"
                assert tier.lru_hashes() == [m.block_hash for m in held] and tier.counters.evictions == 0
                # ... and every intact block on disk is served.
                for index, meta in enumerate(held[1:], start=1):
                    assert await tier.read_into(meta, out), f"block {index} is on disk but was not served"
                    assert bytes(out) == bytes(views[index])
                # The damaged slot is refused (never served); its header cannot be zeroed, and need not be.
                assert not await tier.read_into(held[0], out)
                assert held[0].block_hash not in tier
                assert slab_bytes_on_disk(tier) == tier.disk_bytes == tier.capacity_bytes, "accounting is off"
                assert tier.used_bytes == (CAPACITY_FILES - 1) * tier.file_bytes
                assert tier.take_events() == [BlockRemoved(block_hashes=[held[0].block_hash], medium="STORAGE")]
                assert dict(tier.counters.not_stored) == {"read_only": len(newer)}
                tier.check_invariants()

            # Writable again: the newer blocks are stored (the refused slot first), accounting is exact.
            for meta, view in zip(newer, views[CAPACITY_FILES:], strict=True):
                assert await tier.write(meta, view)
            assert tier.num_blocks == CAPACITY_FILES and tier.counters.evictions == len(newer) - 1
            assert tier.used_bytes == slab_bytes_on_disk(tier) == tier.disk_bytes == tier.capacity_bytes
            for meta in newer:
                assert await tier.read_into(meta, out)
            tier.check_invariants()
            return how
        finally:
            await tier.aclose()

    how = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    with capsys.disabled():
        print(f"\n[read-only disk: {how}]")
