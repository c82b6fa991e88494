"""DiskTier on real files: round trips, every integrity refusal, restart scan, capacity, full disk, deadlines."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiers_helpers import IDENTITY, ODD_IDENTITY, make_blocks

import kvstore.tiers.disk_capacity as capacity_module
import kvstore.tiers.disk_files as files_module
from kvstore.events import BlockRemoved, BlockStored
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_format import FORMAT_VERSION, file_name, header_len, shard_name
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.identity import CacheIdentity

FILE_BYTES = header_len(IDENTITY.block_size) + IDENTITY.block_bytes


def new_tier(root: Path, *, identity: CacheIdentity = IDENTITY, files: int = 16, **kw: Any) -> DiskTier:
    options: dict[str, Any] = {"deadline_s": 5.0, "max_concurrent_io": 4} | kw
    return DiskTier(root, identity, capacity_bytes=files * (header_len(4) + identity.block_bytes), **options)


def payloads(count: int, identity: CacheIdentity = IDENTITY, seed: int = 0) -> tuple[list[BlockMeta], list[memoryview]]:
    """Blocks and their KV in page-aligned buffers (what arena slots are)."""
    metas, data = make_blocks(count, identity=identity, seed=seed)
    views = []
    for row in data:
        buffer = memoryview(mmap.mmap(-1, identity.block_bytes))
        buffer[:] = row.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        views.append(buffer)
    return metas, views


def out_buffer(identity: CacheIdentity = IDENTITY) -> memoryview:
    return memoryview(mmap.mmap(-1, identity.block_bytes))


async def loop_until(predicate: Callable[[], bool], seconds: float = 2.0) -> None:
    """Let the event loop run until ``predicate`` holds or ``seconds`` pass (the caller then asserts)."""
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


class Settles:
    """Records on_settled calls."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __call__(self, ok: bool) -> None:
        self.calls.append(ok)


def test_round_trip_on_the_real_disk(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        assert tier.io_mode in ("O_DIRECT",) or tier.io_mode.startswith("buffered (the file system")
        metas, views = payloads(3)
        settled = Settles()
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view, settled)
        assert settled.calls == [True, True, True]
        assert tier.path_of(metas[0].block_hash).stat().st_size == FILE_BYTES
        assert tier.lru_hashes() == [m.block_hash for m in metas]
        out = out_buffer()
        assert await tier.read_into(metas[0], out, settled)
        assert bytes(out) == bytes(views[0]) and settled.calls[-1] is True
        assert tier.lru_hashes() == [metas[1].block_hash, metas[2].block_hash, metas[0].block_hash]
        assert await tier.write(metas[1], views[1])  # already stored: True, no second file
        assert [type(e) for e in tier.take_events()] == [BlockStored] * 3
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_buffered_when_direct_io_is_off(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path, direct_io=False)
        assert tier.io_mode == "buffered (tiers.disk_direct_io is off)" and not tier.direct_io
        metas, views = payloads(1)
        assert await tier.write(metas[0], views[0])
        out = out_buffer()
        assert await tier.read_into(metas[0], out) and bytes(out) == bytes(views[0])
        await tier.aclose()

    asyncio.run(scenario())


def test_buffered_path_for_blocks_that_are_not_page_multiples(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path, identity=ODD_IDENTITY)
        assert tier.io_mode == "buffered (block bytes 1024 are not a multiple of 4096)"
        metas, views = payloads(2, ODD_IDENTITY)
        assert await tier.write(metas[1], views[1])
        out = out_buffer(ODD_IDENTITY)
        assert await tier.read_into(metas[1], out) and bytes(out) == bytes(views[1])
        await tier.aclose()

    asyncio.run(scenario())


def _flip(offset: int) -> Callable[[Path, Path], None]:
    def corrupt(path: Path, other: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x01
        path.write_bytes(raw)

    return corrupt


def _truncate(path: Path, other: Path) -> None:
    os.truncate(path, FILE_BYTES - 100)


def _other_block(path: Path, other: Path) -> None:
    path.write_bytes(other.read_bytes())


def _other_version(path: Path, other: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:10] = struct.pack("<H", FORMAT_VERSION + 1)
    path.write_bytes(raw)


def _other_identity(path: Path, other: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[48:64] = bytes(16)
    path.write_bytes(raw)


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_flip(FILE_BYTES - 7), "bad_checksum"),  # a payload byte
        (_flip(64), "wrong_tokens"),  # a token: caught by the collision guard before the checksum
        (_flip(200), "bad_padding"),  # the header's zero padding (outside the checksum)
        (_truncate, "short_read"),
        (_other_block, "wrong_hash"),
        (_other_version, "bad_version"),
        (_other_identity, "wrong_identity"),
    ],
    ids=[
        "flipped-payload-byte",
        "flipped-token",
        "flipped-padding-byte",
        "truncated",
        "header-of-another-hash",
        "format-version",
        "identity",
    ],
)
def test_integrity_failures_are_counted_misses_and_removed(
    tmp_path: Path, corrupt: Callable[[Path, Path], None], reason: str
) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(2)
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view)
        tier.take_events()
        path = tier.path_of(metas[0].block_hash)
        corrupt(path, tier.path_of(metas[1].block_hash))
        out = out_buffer()
        settled = Settles()
        assert not await tier.read_into(metas[0], out, settled)  # a miss, never an exception
        assert settled.calls == [False]  # the buffer's content must not be used
        assert dict(tier.counters.integrity_failures) == {reason: 1}
        assert not path.exists() and metas[0].block_hash not in tier
        assert tier.take_events() == [BlockRemoved(block_hashes=[metas[0].block_hash], medium="STORAGE")]
        assert not await tier.read_into(metas[0], out)  # stays a miss
        assert await tier.read_into(metas[1], out) and bytes(out) == bytes(views[1])  # the other block is fine
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_file_removed_behind_the_tiers_back_is_a_miss(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(1)
        assert await tier.write(metas[0], views[0])
        tier.path_of(metas[0].block_hash).unlink()
        assert not await tier.read_into(metas[0], out_buffer())
        assert dict(tier.counters.integrity_failures) == {"missing": 1}
        assert metas[0].block_hash not in tier
        await tier.aclose()

    asyncio.run(scenario())


def test_collision_on_disk_is_a_miss(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(1)
        assert await tier.write(metas[0], views[0])
        impostor = BlockMeta(metas[0].block_hash, None, (7, 7, 7, 7))
        assert not await tier.read_into(impostor, out_buffer())
        assert tier.counters.collisions == 1 and metas[0].block_hash in tier  # the file is fine for its own tokens
        await tier.aclose()

    asyncio.run(scenario())


def written_then_closed(tmp_path: Path, count: int) -> tuple[list[BlockMeta], list[bytes]]:
    """A tier's first life, for the restart tests: ``count`` blocks written, then the tier closed."""

    async def first_run() -> tuple[list[BlockMeta], list[bytes]]:
        tier = new_tier(tmp_path)
        metas, views = payloads(count)
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view)
        await tier.aclose()
        return metas, [bytes(v) for v in views]

    return asyncio.run(first_run())


def test_tokens_damaged_while_the_tier_was_down_are_refused_not_taken_for_a_collision(tmp_path: Path) -> None:
    """The scan checks headers, not checksums (that needs the payload): a token flipped while the tier was
    down is indexed with the wrong tokens. The first read must find the file damaged -- counted as an
    integrity failure and removed -- not call it a hash collision and keep it forever."""

    metas, contents = written_then_closed(tmp_path, 2)
    directory = tmp_path / IDENTITY.digest()
    damaged = directory / shard_name(metas[0].block_hash) / file_name(metas[0].block_hash)
    _flip(64)(damaged, damaged)  # the first token

    async def second_run() -> None:
        tier = new_tier(tmp_path)
        assert set(tier.lru_hashes()) == {m.block_hash for m in metas} and not tier.counters.scan_removed
        assert not await tier.read_into(metas[0], out_buffer())
        assert dict(tier.counters.integrity_failures) == {"bad_checksum": 1} and tier.counters.collisions == 0
        assert not damaged.exists() and metas[0].block_hash not in tier
        out = out_buffer()
        assert await tier.read_into(metas[1], out) and bytes(out) == contents[1]
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(second_run())


def test_restart_scan_keeps_valid_files_and_removes_the_rest(tmp_path: Path) -> None:
    metas, contents = written_then_closed(tmp_path, 5)
    directory = tmp_path / IDENTITY.digest()
    path_of = {m.block_hash: directory / shard_name(m.block_hash) / file_name(m.block_hash) for m in metas}
    for age, meta in enumerate(metas):  # distinct mtimes: the scan orders the LRU by them
        stamp = time.time() - 100 + age
        os.utime(path_of[meta.block_hash], (stamp, stamp))
    temporary = path_of[metas[0].block_hash].with_name(".leftover.kvb.1234.tmp")
    temporary.write_bytes(b"half a block")
    _other_version(path_of[metas[1].block_hash], path_of[metas[1].block_hash])
    _truncate(path_of[metas[2].block_hash], path_of[metas[2].block_hash])
    stray = directory / "notes.txt"
    stray.write_text("not ours")

    async def second_run() -> None:
        tier = new_tier(tmp_path)
        assert tier.lru_hashes() == [metas[0].block_hash, metas[3].block_hash, metas[4].block_hash]
        assert dict(tier.counters.scan_removed) == {"temporary": 1, "bad_version": 1, "bad_length": 1}
        assert not temporary.exists() and not path_of[metas[1].block_hash].exists()
        assert stray.exists()  # not a block file: left alone
        events = tier.take_events()
        assert [e.block_hashes for e in events] == [[metas[i].block_hash] for i in (0, 3, 4)]
        assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in events)
        out = out_buffer()
        assert await tier.read_into(metas[3], out) and bytes(out) == contents[3]
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(second_run())


def test_restart_with_a_smaller_capacity_keeps_the_newest(tmp_path: Path) -> None:
    async def scenario() -> list[BlockMeta]:
        tier = new_tier(tmp_path)
        metas, views = payloads(4)
        for age, (meta, view) in enumerate(zip(metas, views, strict=True)):
            assert await tier.write(meta, view)
            os.utime(tier.path_of(meta.block_hash), (1_000_000 + age, 1_000_000 + age))
        await tier.aclose()
        return metas

    metas = asyncio.run(scenario())
    smaller = new_tier(tmp_path, files=2)
    assert smaller.lru_hashes() == [metas[2].block_hash, metas[3].block_hash]
    assert smaller.counters.scan_removed["over_capacity"] == 2
    asyncio.run(smaller.aclose())


def test_lru_eviction_beyond_capacity(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path, files=2)
        metas, views = payloads(3)
        assert await tier.write(metas[0], views[0])
        assert await tier.write(metas[1], views[1])
        assert await tier.read_into(metas[0], out_buffer())  # 0 is now the most recently used
        tier.take_events()
        assert await tier.write(metas[2], views[2])
        assert tier.lru_hashes() == [metas[0].block_hash, metas[2].block_hash]
        assert not tier.path_of(metas[1].block_hash).exists()
        removed, stored = tier.take_events()
        assert removed == BlockRemoved(block_hashes=[metas[1].block_hash], medium="STORAGE")
        assert isinstance(stored, BlockStored) and stored.block_hashes == [metas[2].block_hash]
        assert tier.used_bytes == 2 * FILE_BYTES and tier.counters.evictions == 1
        await tier.aclose()

    asyncio.run(scenario())


def test_capacity_below_one_file_stores_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = DiskTier(tmp_path, IDENTITY, capacity_bytes=FILE_BYTES - 1, deadline_s=5.0, max_concurrent_io=2)
        metas, views = payloads(1)
        settled = Settles()
        assert not await tier.write(metas[0], views[0], settled)
        assert settled.calls == [False] and dict(tier.counters.not_stored) == {"capacity": 1}
        assert tier.num_blocks == 0
        await tier.aclose()

    asyncio.run(scenario())


def test_enospc_degrades_to_not_stored_and_shrinks_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write_all = files_module.write_all

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=8)
        metas, views = payloads(5)
        assert await tier.write(metas[0], views[0])
        assert await tier.write(metas[1], views[1])

        def disk_full(*args: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        # The file system is full: writes fail and statvfs reports no room.
        monkeypatch.setattr(files_module, "write_all", disk_full)
        monkeypatch.setattr(capacity_module, "fs_room", lambda directory: 0)
        settled = Settles()
        assert not await tier.write(metas[2], views[2], settled)  # no exception reaches the caller
        assert settled.calls == [False]
        assert dict(tier.counters.not_stored) == {"disk_full": 1}
        assert tier.limit_bytes == 2 * FILE_BYTES  # what it holds
        assert list(tier.path_of(metas[2].block_hash).parent.glob("*.tmp")) == []  # the temporary is gone
        monkeypatch.setattr(files_module, "write_all", real_write_all)
        assert await tier.write(metas[3], views[3])  # room is made by evicting the LRU block
        assert tier.lru_hashes() == [metas[1].block_hash, metas[3].block_hash]
        assert tier.limit_bytes == 2 * FILE_BYTES
        # The file system has room again: the configured capacity is back, nothing is evicted.
        monkeypatch.setattr(capacity_module, "fs_room", lambda directory: 100 * FILE_BYTES)
        assert await tier.write(metas[4], views[4])
        assert tier.limit_bytes == tier.capacity_bytes == 8 * FILE_BYTES
        assert tier.lru_hashes() == [metas[1].block_hash, metas[3].block_hash, metas[4].block_hash]
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_enospc_while_the_file_system_reports_room_evicts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC that statvfs does not show (a quota, a competing writer that freed up): failed writes are counted,
    and no stored block is given up for them."""

    def disk_full(*args: Any) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=8)
        metas, views = payloads(6)
        for meta, view in zip(metas[:3], views[:3], strict=True):
            assert await tier.write(meta, view)
        monkeypatch.setattr(files_module, "write_all", disk_full)
        for meta, view in zip(metas[3:], views[3:], strict=True):
            assert not await tier.write(meta, view)
        assert dict(tier.counters.not_stored) == {"disk_full": 3} and tier.counters.evictions == 0
        assert tier.lru_hashes() == [m.block_hash for m in metas[:3]]
        assert tier.limit_bytes == 3 * FILE_BYTES  # what it held at the last failure
        monkeypatch.undo()
        assert await tier.write(metas[3], views[3])  # statvfs reports room: the capacity is back
        assert tier.limit_bytes == tier.capacity_bytes and tier.num_blocks == 4
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_other_write_errors_are_counted_by_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(1)
        monkeypatch.setattr(files_module, "write_all", broken)
        assert not await tier.write(metas[0], views[0])
        assert dict(tier.counters.not_stored) == {"io_error": 1} and dict(tier.counters.io_errors) == {"EIO": 1}
        assert tier.limit_bytes == tier.capacity_bytes
        await tier.aclose()

    asyncio.run(scenario())


def test_write_deadline_answers_in_time_and_settles_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write_all = files_module.write_all
    release = threading.Event()

    def stuck(*args: Any) -> None:  # runs on an I/O thread: a disk that hangs
        release.wait(10)
        real_write_all(*args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, deadline_s=0.2, max_concurrent_io=1)
        metas, views = payloads(2)
        monkeypatch.setattr(files_module, "write_all", stuck)
        first, second = Settles(), Settles()
        started = time.monotonic()
        results = await asyncio.gather(tier.write(metas[0], views[0], first), tier.write(metas[1], views[1], second))
        assert results == [False, False] and time.monotonic() - started < 1.0
        assert first.calls == []  # it is being written: the buffer is still in use
        assert second.calls == [False]  # queued behind it: abandoned, its buffer handed back at once
        assert dict(tier.counters.deadline_expired) == {"write": 2}
        release.set()
        await loop_until(lambda: bool(first.calls and second.calls))
        assert first.calls == [True]  # it was writing: finished late, and kept
        assert second.calls == [False]  # settled once only
        assert tier.lru_hashes() == [metas[0].block_hash]
        assert tier.counters.not_stored["timeout"] == 1
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_read_deadline_is_a_miss_and_the_buffer_is_handed_back_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_read_full = files_module.read_full
    release = threading.Event()

    def slow(*args: Any) -> int:
        release.wait(10)
        return real_read_full(*args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, deadline_s=0.2)
        metas, views = payloads(1)
        assert await tier.write(metas[0], views[0])
        monkeypatch.setattr(files_module, "read_full", slow)
        out, settled = out_buffer(), Settles()
        assert not await tier.read_into(metas[0], out, settled)
        assert settled.calls == [] and tier.counters.deadline_expired["read"] == 1
        release.set()
        await loop_until(lambda: bool(settled.calls))
        assert settled.calls == [True] and bytes(out) == bytes(views[0])
        assert metas[0].block_hash in tier  # a slow read is not a corrupt file
        await tier.aclose()

    asyncio.run(scenario())


def test_a_block_evicted_while_it_is_read_is_still_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another batch's write evicts the block a read has open: the bytes read were verified, so the read is a hit
    (it used to raise KeyError, touching an index entry that was gone). The file being read is not reused for the
    write (a spare is overwritten: the reader would read another block), so the next block is evicted for it, and
    the file becomes a spare once the read is done."""
    real_read_full = files_module.read_full
    reading, release = threading.Event(), threading.Event()

    def held(*args: Any) -> int:
        reading.set()
        release.wait(10)
        return real_read_full(*args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=2)
        metas, views = payloads(3)
        assert await tier.write_many([(metas[i], views[i], Settles()) for i in range(2)]) == [True, True]
        monkeypatch.setattr(files_module, "read_full", held)
        out, settled = out_buffer(), Settles()
        read = asyncio.create_task(tier.read_into(metas[0], out, settled))
        await loop_until(reading.is_set)
        assert await tier.write(metas[2], views[2])  # the tier is full: evicts the LRU block, the one being read
        assert tier.lru_hashes() == [metas[2].block_hash] and tier.counters.evictions == 2
        assert tier.used_bytes == 2 * FILE_BYTES == tier.capacity_bytes  # the file being read still counts
        release.set()
        assert await read and settled.calls == [True] and bytes(out) == bytes(views[0])
        assert await tier.write(metas[0], views[0])  # the read file is retired now, and reused
        assert tier.lru_hashes() == [metas[2].block_hash, metas[0].block_hash]
        assert tier.used_bytes == 2 * FILE_BYTES and tier.num_blocks == 2
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_wrong_sized_buffers_are_caller_errors(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, _ = payloads(1)
        with pytest.raises(InvalidBlockError):
            await tier.write(metas[0], memoryview(bytearray(10)))
        with pytest.raises(InvalidBlockError):
            await tier.read_into(metas[0], memoryview(bytes(IDENTITY.block_bytes)))  # read-only
        await tier.aclose()

    asyncio.run(scenario())


def test_reads_leave_access_times_alone_and_work_where_noatime_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_NOATIME keeps reads from dirtying inodes; where the kernel refuses it (not the file's owner)
    the read goes on without it."""
    if not getattr(os, "O_NOATIME", 0):
        pytest.skip("this platform has no O_NOATIME")

    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(2)
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view)
        path = tier.path_of(metas[0].block_hash)
        stale = time.time() - 3600
        os.utime(path, (stale, stale))  # older than mtime: relatime would update it on the next read
        out = out_buffer()
        assert await tier.read_into(metas[0], out) and bytes(out) == bytes(views[0])
        assert os.stat(path).st_atime == pytest.approx(stale, abs=1.0)

        real_open, refused = os.open, []

        def no_noatime(file: Any, flags: int, *args: Any) -> int:
            if flags & os.O_NOATIME:
                refused.append(file)
                raise PermissionError(errno.EPERM, "not the owner")
            return real_open(file, flags, *args)

        monkeypatch.setattr(os, "open", no_noatime)
        out = out_buffer()
        assert await tier.read_into(metas[1], out) and bytes(out) == bytes(views[1])
        assert refused == [tier.path_of(metas[1].block_hash)]
        monkeypatch.setattr(os, "open", real_open)
        await tier.aclose()

    asyncio.run(scenario())


def test_batches_answer_each_block_in_order(tmp_path: Path) -> None:
    """write_many / read_many: one answer per request, in request order, whatever each one's fate."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=3)
        metas, views = payloads(5)
        settles = [Settles() for _ in range(6)]
        answers = await tier.write_many(
            [
                (metas[0], views[0], settles[0]),
                (metas[1], views[1], settles[1]),
                (metas[0], views[0], settles[2]),  # the same block again, while the first is being written
                (metas[2], views[2], settles[3]),
            ]
        )
        assert answers == [True, True, False, True]
        assert [s.calls for s in settles[:4]] == [[True], [True], [False], [True]]
        assert tier.counters.not_stored == {"in_flight": 1}
        assert await tier.write_many([(metas[1], views[1], settles[4])]) == [True]  # already stored
        # Room for three files: the fourth in one batch is refused up front, since every earlier one is in flight.
        tier2 = new_tier(tmp_path / "small", files=2)
        assert await tier2.write_many([(m, v, Settles()) for m, v in zip(metas[:3], views[:3], strict=True)]) == [
            True,
            True,
            False,
        ]
        assert tier2.counters.not_stored == {"capacity": 1}
        await tier2.aclose()

        outs = [out_buffer() for _ in range(4)]
        impostor = BlockMeta(metas[2].block_hash, None, (9, 9, 9, 9))
        tier.path_of(metas[1].block_hash).write_bytes(b"garbage")
        reads = [Settles() for _ in range(4)]
        answers = await tier.read_many(
            [
                (metas[0], outs[0], reads[0]),  # intact
                (metas[1], outs[1], reads[1]),  # damaged: a miss, removed
                (metas[3], outs[2], reads[2]),  # never stored
                (impostor, outs[3], reads[3]),  # another block's hash
            ]
        )
        assert answers == [True, False, False, False]
        assert [r.calls for r in reads] == [[True], [False], [False], [False]]
        assert bytes(outs[0]) == bytes(views[0])
        assert tier.counters.integrity_failures == {"short_read": 1} and tier.counters.collisions == 1
        assert tier.lru_hashes() == [metas[2].block_hash, metas[0].block_hash]
        assert await tier.read_many([]) == [] and await tier.write_many([]) == []
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_batch_deadline_answers_finished_now_abandons_queued_and_settles_running_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_read_full = files_module.read_full
    release = threading.Event()
    calls = 0

    def second_hangs(*args: Any) -> int:  # the batch's second read hangs (one I/O thread: in order)
        nonlocal calls
        calls += 1
        if calls == 2:
            release.wait(10)
        return real_read_full(*args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, deadline_s=0.3, max_concurrent_io=1)
        metas, views = payloads(3)
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view)
        monkeypatch.setattr(files_module, "read_full", second_hangs)
        outs = [out_buffer() for _ in range(3)]
        settles = [Settles() for _ in range(3)]
        started = time.monotonic()
        answers = await tier.read_many(list(zip(metas, outs, settles, strict=True)))
        assert answers == [True, False, False] and time.monotonic() - started < 2.0
        assert settles[0].calls == [True] and bytes(outs[0]) == bytes(views[0])  # done before the deadline
        assert settles[1].calls == []  # still being read into: the buffer is not handed back yet
        assert settles[2].calls == [False] and not any(bytes(outs[2]))  # queued: abandoned, untouched
        assert tier.counters.deadline_expired == {"read": 2}
        release.set()
        await loop_until(lambda: bool(settles[1].calls))
        assert settles[1].calls == [True] and bytes(outs[1]) == bytes(views[1])  # verified, late
        assert calls == 2  # the abandoned read never ran
        assert [s.calls for s in settles] == [[True], [True], [False]]  # each settled exactly once
        await tier.aclose()

    asyncio.run(scenario())


def test_a_bug_in_an_io_is_raised_after_every_io_in_the_batch_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_read_full = files_module.read_full
    calls = 0

    def first_breaks(*args: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug, not a storage error")
        return real_read_full(*args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, max_concurrent_io=1)
        metas, views = payloads(2)
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view)
        monkeypatch.setattr(files_module, "read_full", first_breaks)
        settles = [Settles(), Settles()]
        with pytest.raises(RuntimeError, match="a bug"):
            await tier.read_many([(m, out_buffer(), s) for m, s in zip(metas, settles, strict=True)])
        assert [s.calls for s in settles] == [[False], [True]]  # every buffer handed back before the raise
        assert len(tier.lru_hashes()) == 2  # a bug is not a damaged file: nothing removed
        await tier.aclose()

    asyncio.run(scenario())


def test_evicted_files_are_reused_not_deleted(tmp_path: Path) -> None:
    """A write into a full tier overwrites the evicted block's file (renamed to a spare, then into place): no new
    file is created, so no blocks are allocated, and the bytes held stay the files on disk."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=3)
        metas, views = payloads(6)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:3], views[:3], strict=True)]))
        inodes = {os.stat(tier.path_of(m.block_hash)).st_ino for m in metas[:3]}
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[3:], views[3:], strict=True)]))
        assert {os.stat(tier.path_of(m.block_hash)).st_ino for m in metas[3:]} == inodes
        assert tier.lru_hashes() == [m.block_hash for m in metas[3:]] and tier.counters.evictions == 3
        assert not any(tier.path_of(m.block_hash).exists() for m in metas[:3])
        assert list(tier.directory.glob("spare/*")) == [] and tier.used_bytes == 3 * FILE_BYTES
        for meta, view in zip(metas[3:], views[3:], strict=True):
            out = out_buffer()
            assert await tier.read_into(meta, out) and bytes(out) == bytes(view)
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_spares_survive_a_restart_and_are_reused(tmp_path: Path) -> None:
    """A refused file becomes a spare; a restart keeps spares of the right size (and removes others), and the
    next write reuses one instead of creating a file."""

    async def first_life() -> list[BlockMeta]:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(2)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas, views, strict=True)]))
        _flip(FILE_BYTES - 1)(tier.path_of(metas[0].block_hash), tier.path_of(metas[1].block_hash))
        assert not await tier.read_into(metas[0], out_buffer())  # refused: its file is now a spare
        assert len(list(tier.directory.glob("spare/*"))) == 1 and tier.used_bytes == 2 * FILE_BYTES
        (tier.directory / "spare" / "99999999.kvs").write_bytes(b"short")  # not a spare: removed at start
        await tier.aclose()
        return metas

    metas = asyncio.run(first_life())

    async def second_life() -> None:
        tier = new_tier(tmp_path, files=4)
        assert tier.counters.scan_removed["bad_spare"] == 1
        assert tier.lru_hashes() == [metas[1].block_hash] and tier.used_bytes == 2 * FILE_BYTES
        (spare,) = tier.directory.glob("spare/*")
        inode = spare.stat().st_ino
        more, views = payloads(3, seed=1)
        assert await tier.write(more[2], views[2])
        assert os.stat(tier.path_of(more[2].block_hash)).st_ino == inode  # the spare, reused
        assert list(tier.directory.glob("spare/*")) == [] and tier.used_bytes == 2 * FILE_BYTES
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(second_life())
