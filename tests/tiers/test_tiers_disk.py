"""DiskTier on real slab files: round trips, runs, every integrity refusal, torn writes, restart scan,
capacity, full disk, deadlines."""

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
import kvstore.tiers.disk_format as disk_format
from kvstore.errors import ConfigError
from kvstore.events import BlockRemoved, BlockStored
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_format import FORMAT_VERSION, header_len, slab_name
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.identity import CacheIdentity

FILE_BYTES = header_len(IDENTITY.block_size) + IDENTITY.block_bytes  # one slot
HLEN = header_len(IDENTITY.block_size)


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


class Slot:
    """One stored block's slot in its slab file, read and damaged behind the tier's back."""

    def __init__(self, tier: DiskTier, block_hash: int) -> None:
        self.path, self.offset = tier.location_of(block_hash)

    def read(self) -> bytearray:
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            return bytearray(fh.read(FILE_BYTES))

    def write(self, raw: bytes | bytearray, at: int = 0) -> None:
        with self.path.open("r+b") as fh:
            fh.seek(self.offset + at)
            fh.write(raw)

    def header_zeroed(self) -> bool:
        return not any(self.read()[:HLEN])


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count calls of ``disk_files.<name>`` (the vectored write / read loop): one per run."""
    real = getattr(files_module, name)
    calls: list[int] = []

    def counted(fd: int, views: list[memoryview], offset: int = 0) -> Any:
        calls.append(len(views) // 2)
        return real(fd, views, offset)

    monkeypatch.setattr(files_module, name, counted)
    return calls


def test_round_trip_on_the_real_disk(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        assert tier.io_mode in ("O_DIRECT",) or tier.io_mode.startswith("buffered (the file system")
        metas, views = payloads(3)
        settled = Settles()
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view, settled)
        assert settled.calls == [True, True, True]
        # One slab, grown a slot at a time, the blocks in write order.
        assert tier.slab_paths() == [tier.directory / slab_name(0)]
        assert [tier.location_of(m.block_hash) for m in metas] == [
            (tier.directory / slab_name(0), i * FILE_BYTES) for i in range(3)
        ]
        assert tier.path_of(metas[0].block_hash).stat().st_size == 3 * FILE_BYTES == tier.disk_bytes
        assert tier.lru_hashes() == [m.block_hash for m in metas]
        out = out_buffer()
        assert await tier.read_into(metas[0], out, settled)
        assert bytes(out) == bytes(views[0]) and settled.calls[-1] is True
        assert tier.lru_hashes() == [metas[1].block_hash, metas[2].block_hash, metas[0].block_hash]
        assert await tier.write(metas[1], views[1])  # already stored: True, no second copy
        assert [type(e) for e in tier.take_events()] == [BlockStored] * 3
        # With no publisher (events off), the store discards what was recorded without building events.
        more, more_views = payloads(4)
        assert await tier.write(more[3], more_views[3])
        assert tier.discard_events() == 1 and tier.take_events() == []
        with pytest.raises(KeyError):
            tier.location_of(12345)
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_a_batch_moves_as_runs_of_consecutive_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of writes takes consecutive slots and goes out as one vectored write per run; a batch of
    reads is sorted by slot and comes back the same way, each block still checked (and answered) alone."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=16)
        metas, views = payloads(7)
        writes, reads = counting(monkeypatch, "write_all"), counting(monkeypatch, "read_full")
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:5], views[:5], strict=True)]))
        assert writes == [5]  # five blocks, one pwritev
        outs = [out_buffer() for _ in range(5)]
        order = [3, 0, 4, 1, 2]  # requests out of slot order: still one run
        answers = await tier.read_many([(metas[i], outs[n], Settles()) for n, i in enumerate(order)])
        assert answers == [True] * 5 and reads == [5]
        assert [bytes(outs[n]) for n in range(5)] == [bytes(views[i]) for i in order]
        tier._run_blocks = 2  # runs are cut at a length: several I/Os in flight
        writes.clear()
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[5:], views[5:], strict=True)]))
        reads.clear()
        assert all(await tier.read_many([(m, out_buffer(), Settles()) for m in metas[:5]]))
        assert writes == [2] and sorted(reads) == [1, 2, 2]
        # A damaged block in the middle of a run is refused alone.
        Slot(tier, metas[2].block_hash).write(b"\xff", at=FILE_BYTES - 1)
        tier._run_blocks = 16
        answers = await tier.read_many([(m, out_buffer(), Settles()) for m in metas[:5]])
        assert answers == [True, True, False, True, True]
        assert dict(tier.counters.integrity_failures) == {"bad_checksum": 1}
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


def _flip(offset: int) -> Callable[[Slot, Slot], None]:
    def corrupt(slot: Slot, other: Slot) -> None:
        raw = slot.read()
        slot.write(bytes([raw[offset] ^ 0x01]), at=offset)

    return corrupt


def _truncate(slot: Slot, other: Slot) -> None:
    os.truncate(slot.path, slot.offset + FILE_BYTES - 100)


def _other_block(slot: Slot, other: Slot) -> None:
    slot.write(other.read())


def _other_version(slot: Slot, other: Slot) -> None:
    slot.write(struct.pack("<H", FORMAT_VERSION + 1), at=8)


def _other_identity(slot: Slot, other: Slot) -> None:
    slot.write(bytes(16), at=48)


def _torn(slot: Slot, other: Slot) -> None:
    """A write that got only as far as the header: another block's header over this block's old payload."""
    slot.write(other.read()[:HLEN])


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_flip(FILE_BYTES - 7), "bad_checksum"),  # a payload byte
        (_flip(64), "wrong_tokens"),  # a token: caught by the collision guard before the checksum
        (_flip(200), "bad_padding"),  # the header's zero padding (outside the checksum)
        (_flip(0), "bad_magic"),
        (_truncate, "short_read"),
        (_other_block, "wrong_hash"),
        (_other_version, "bad_version"),
        (_other_identity, "wrong_identity"),
        (_torn, "wrong_hash"),
    ],
    ids=[
        "flipped-payload-byte",
        "flipped-token",
        "flipped-padding-byte",
        "flipped-magic",
        "truncated",
        "slot-of-another-block",
        "format-version",
        "identity",
        "torn-write",
    ],
)
def test_integrity_failures_are_counted_misses_and_invalidated(
    tmp_path: Path, corrupt: Callable[[Slot, Slot], None], reason: str
) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(2)
        for meta, view in zip(metas[::-1], views[::-1], strict=True):  # the damaged block in the last slot
            assert await tier.write(meta, view)
        tier.take_events()
        slot = Slot(tier, metas[0].block_hash)
        corrupt(slot, Slot(tier, metas[1].block_hash))
        out = out_buffer()
        settled = Settles()
        assert not await tier.read_into(metas[0], out, settled)  # a miss, never an exception
        assert settled.calls == [False]  # the buffer's content must not be used
        assert dict(tier.counters.integrity_failures) == {reason: 1}
        assert metas[0].block_hash not in tier and slot.header_zeroed()  # no restart takes it up again
        assert tier.take_events() == [BlockRemoved(block_hashes=[metas[0].block_hash], medium="STORAGE")]
        assert not await tier.read_into(metas[0], out)  # stays a miss
        assert await tier.read_into(metas[1], out) and bytes(out) == bytes(views[1])  # the other block is fine
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_slab_removed_behind_the_tiers_back_is_a_miss_and_comes_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path)
        metas, views = payloads(2)
        assert await tier.write(metas[0], views[0])
        tier.path_of(metas[0].block_hash).unlink()
        assert not await tier.read_into(metas[0], out_buffer())
        assert dict(tier.counters.integrity_failures) == {"missing": 1}
        assert metas[0].block_hash not in tier
        assert await tier.write(metas[1], views[1])  # the slab is made again (0600), holes and all
        out = out_buffer()
        assert await tier.read_into(metas[1], out) and bytes(out) == bytes(views[1])
        tier.check_invariants()
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
    """A tier's first life, for the restart tests: ``count`` blocks written (slots 0, 1, ...), then closed."""

    async def first_run() -> tuple[list[BlockMeta], list[bytes]]:
        tier = new_tier(tmp_path)
        metas, views = payloads(count)
        for meta, view in zip(metas, views, strict=True):
            assert await tier.write(meta, view)
        await tier.aclose()
        return metas, [bytes(v) for v in views]

    return asyncio.run(first_run())


class SlabSlot(Slot):
    """A slot by number, for a tier that is not running."""

    def __init__(self, directory: Path, slot: int) -> None:
        self.path, self.offset = directory / slab_name(0), slot * FILE_BYTES


def test_tokens_damaged_while_the_tier_was_down_are_refused_not_taken_for_a_collision(tmp_path: Path) -> None:
    """The scan checks headers, not checksums (that needs the payload): a token flipped while the tier was
    down is indexed with the wrong tokens. The first read must find the slot damaged -- counted as an
    integrity failure and dropped -- not call it a hash collision and keep it forever."""

    metas, contents = written_then_closed(tmp_path, 2)
    damaged = SlabSlot(tmp_path / IDENTITY.digest(), 0)
    _flip(64)(damaged, damaged)  # the first token

    async def second_run() -> None:
        tier = new_tier(tmp_path)
        assert set(tier.lru_hashes()) == {m.block_hash for m in metas} and not tier.counters.scan_removed
        assert not await tier.read_into(metas[0], out_buffer())
        assert dict(tier.counters.integrity_failures) == {"bad_checksum": 1} and tier.counters.collisions == 0
        assert damaged.header_zeroed() and metas[0].block_hash not in tier
        out = out_buffer()
        assert await tier.read_into(metas[1], out) and bytes(out) == contents[1]
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(second_run())


def test_restart_scan_keeps_intact_slots_and_frees_the_rest(tmp_path: Path) -> None:
    metas, contents = written_then_closed(tmp_path, 6)
    directory = tmp_path / IDENTITY.digest()
    _other_version(SlabSlot(directory, 1), SlabSlot(directory, 1))
    SlabSlot(directory, 2).write(bytes(HLEN))  # zeroed: a free slot, not damage
    _torn(SlabSlot(directory, 3), SlabSlot(directory, 0))  # block 0's header over block 3: a second copy of 0
    os.truncate(directory / slab_name(0), 5 * FILE_BYTES + 100)  # slot 5 torn off: the slab is cut to 5 slots
    (directory / slab_name(2)).write_bytes(bytes(FILE_BYTES))  # after a gap (no slab 1): removed
    (directory / "ab").mkdir()
    (directory / "ab" / "ab00000000000001.kvb").write_bytes(b"format 1")  # an old block file: removed
    stray = directory / "notes.txt"
    stray.write_text("not ours")

    async def second_run() -> None:
        tier = new_tier(tmp_path)
        # Block 0's later copy (slot 3, a higher write sequence) wins; block 4 is the newest.
        assert tier.lru_hashes() == [metas[0].block_hash, metas[4].block_hash]
        assert tier.location_of(metas[0].block_hash)[1] == 3 * FILE_BYTES
        assert dict(tier.counters.scan_removed) == {
            "bad_version": 1,
            "duplicate": 1,
            "slab_cut": 1,
            "slab_after_a_gap": 1,
            "old_format": 1,
        }
        assert not (directory / "ab").exists() and not (directory / slab_name(2)).exists()
        assert stray.exists()  # not ours: left alone
        assert tier.disk_bytes == 5 * FILE_BYTES and tier.used_bytes == 2 * FILE_BYTES
        events = tier.take_events()
        assert [e.block_hashes for e in events] == [[metas[i].block_hash] for i in (0, 4)]
        assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in events)
        out = out_buffer()
        assert await tier.read_into(metas[4], out) and bytes(out) == contents[4]
        # Block 0's copy in slot 3 has block 3's payload: refused on read, never served.
        assert not await tier.read_into(metas[0], out)
        assert dict(tier.counters.integrity_failures) == {"bad_checksum": 1}
        more, views = payloads(3, seed=1)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(more, views, strict=True)]))
        assert sorted(tier.location_of(m.block_hash)[1] // FILE_BYTES for m in more) == [0, 1, 2]  # free slots first
        assert tier.disk_bytes == 5 * FILE_BYTES  # no growth while slots are free
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(second_run())


def test_restart_scan_reads_headers_ahead_and_a_refused_hint_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scan asks for every kept slot's header ahead (posix_fadvise WILLNEED: the kernel reads them
    together instead of one round trip per pread); the hint is only a hint, so one the system refuses
    leaves the result as it was."""
    metas, _ = written_then_closed(tmp_path, 4)
    slab = tmp_path / IDENTITY.digest() / slab_name(0)
    kept = [m.block_hash for m in metas]
    hints: list[tuple[str, int, int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        hints.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    tier = new_tier(tmp_path)
    assert tier.lru_hashes() == kept
    assert hints == [(str(slab.resolve()), i * FILE_BYTES, HLEN, os.POSIX_FADV_WILLNEED) for i in range(4)]
    asyncio.run(tier.aclose())

    def refused(fd: int, offset: int, length: int, advice: int) -> None:
        raise OSError(errno.EINVAL, "no hints here")

    monkeypatch.setattr(os, "posix_fadvise", refused)
    again = new_tier(tmp_path)
    assert again.lru_hashes() == kept and not again.counters.io_errors and not again.counters.scan_removed
    again.check_invariants()
    asyncio.run(again.aclose())


def serves_then_closes(tier: DiskTier, metas: list[BlockMeta], contents: list[bytes]) -> None:
    """Each of ``metas`` reads back as its ``contents``; then the tier's invariants hold, and it is closed."""

    async def served() -> None:
        for meta, content in zip(metas, contents, strict=True):
            out = out_buffer()
            assert await tier.read_into(meta, out) and bytes(out) == content
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(served())


def test_restart_with_a_smaller_capacity_keeps_the_newest_blocks(tmp_path: Path) -> None:
    """A smaller capacity keeps the slots that still fit, filled with the newest blocks: those beyond the cut are
    copied over older ones (which a cut would keep otherwise), LRU order and contents intact."""
    metas, contents = written_then_closed(tmp_path, 4)  # slots 0..3, oldest first
    slab = tmp_path / IDENTITY.digest() / slab_name(0)
    smaller = new_tier(tmp_path, files=2)
    assert smaller.lru_hashes() == [metas[2].block_hash, metas[3].block_hash]
    assert [smaller.location_of(m.block_hash)[1] // FILE_BYTES for m in metas[2:]] == [0, 1]
    assert dict(smaller.counters.scan_removed) == {"dropped_to_fit": 2, "slab_cut": 1}
    assert smaller.disk_bytes == 2 * FILE_BYTES and slab.stat().st_size == 2 * FILE_BYTES

    serves_then_closes(smaller, metas[2:], contents[2:])
    assert not smaller.counters.integrity_failures
    again = new_tier(tmp_path, files=2)  # the same capacity again: nothing moves, nothing is dropped
    assert again.lru_hashes() == [metas[2].block_hash, metas[3].block_hash] and not again.counters.scan_removed
    asyncio.run(again.aclose())


@pytest.mark.parametrize(
    ("files", "kept", "removed"),
    [(3, [3, 4, 5], {"slab_cut": 1, "slab_beyond_capacity": 1}), (4, [2, 3, 4, 5], {"slab_beyond_capacity": 1})],
)
def test_a_smaller_capacity_moves_blocks_across_slabs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: int, kept: list[int], removed: dict[str, int]
) -> None:
    """Two slots a slab, six blocks in three slabs: the newest that no longer fit move into the earlier slabs'
    slots of the oldest (those still in place stay there), and the slabs beyond the capacity go."""
    monkeypatch.setattr(disk_format, "SLAB_TARGET_BYTES", 2 * FILE_BYTES)
    metas, contents = written_then_closed(tmp_path, 6)
    directory = tmp_path / IDENTITY.digest()
    assert sorted(path.name for path in directory.iterdir()) == [slab_name(n) for n in range(3)]
    smaller = new_tier(tmp_path, files=files)
    assert smaller.lru_hashes() == [metas[i].block_hash for i in kept]

    def place(slot: int) -> tuple[str, int]:
        return slab_name(slot // 2), slot % 2 * FILE_BYTES

    found = {i: (path.name, offset) for i in kept for path, offset in [smaller.location_of(metas[i].block_hash)]}
    assert all(found[i] == place(i) for i in kept if i < files)  # still in place: not moved
    assert sorted(found.values()) == sorted(place(slot) for slot in range(files))  # the rest moved into the slots kept
    assert dict(smaller.counters.scan_removed) == {"dropped_to_fit": 6 - files, **removed}
    assert smaller.disk_bytes == files * FILE_BYTES

    serves_then_closes(smaller, [metas[i] for i in kept], [contents[i] for i in kept])


def test_a_block_that_cannot_be_moved_to_fit_is_dropped_not_served_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metas, contents = written_then_closed(tmp_path, 4)

    def refused(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "pwrite", refused)
    smaller = new_tier(tmp_path, files=3)  # block 3 (slot 3) must move into block 0's slot, and cannot
    assert smaller.lru_hashes() == [metas[1].block_hash, metas[2].block_hash]
    assert dict(smaller.counters.scan_removed) == {"dropped_to_fit": 1, "move_failed": 1, "slab_cut": 1}
    monkeypatch.undo()

    async def served() -> None:
        out = out_buffer()
        assert await smaller.read_into(metas[2], out) and bytes(out) == contents[2]
        assert metas[0].block_hash not in smaller and metas[3].block_hash not in smaller
        more, views = payloads(1, seed=3)
        assert await smaller.write(more[0], views[0])  # slot 0, free now, is taken first
        assert smaller.location_of(more[0].block_hash)[1] == 0
        smaller.check_invariants()
        await smaller.aclose()

    asyncio.run(served())


def test_lru_eviction_beyond_capacity(tmp_path: Path) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path, files=2)
        metas, views = payloads(3)
        assert await tier.write(metas[0], views[0])
        assert await tier.write(metas[1], views[1])
        evicted_slot = tier.location_of(metas[1].block_hash)
        assert await tier.read_into(metas[0], out_buffer())  # 0 is now the most recently used
        tier.take_events()
        assert await tier.write(metas[2], views[2])
        assert tier.lru_hashes() == [metas[0].block_hash, metas[2].block_hash]
        assert tier.location_of(metas[2].block_hash) == evicted_slot  # written over the evicted block
        removed, stored = tier.take_events()
        assert removed == BlockRemoved(block_hashes=[metas[1].block_hash], medium="STORAGE")
        assert isinstance(stored, BlockStored) and stored.block_hashes == [metas[2].block_hash]
        assert tier.used_bytes == 2 * FILE_BYTES == tier.disk_bytes and tier.counters.evictions == 1
        await tier.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("capacity", [0, FILE_BYTES - 1])
def test_capacity_below_one_slot_is_refused_and_leaves_the_slabs_alone(tmp_path: Path, capacity: int) -> None:
    """A capacity below one slot can store nothing, and its scan would remove every slab of an earlier life:
    refused with a ConfigError naming the setting before anything on disk is touched."""
    metas, contents = written_then_closed(tmp_path, 2)
    slab = tmp_path / IDENTITY.digest() / slab_name(0)
    before = slab.read_bytes()
    with pytest.raises(ConfigError, match=rf"tiers\.disk_capacity_bytes \({capacity}\) is smaller than one disk slot"):
        DiskTier(tmp_path, IDENTITY, capacity_bytes=capacity, deadline_s=5.0, max_concurrent_io=2)
    assert slab.read_bytes() == before and sorted(os.listdir(slab.parent)) == [slab_name(0)]
    serves_then_closes(new_tier(tmp_path), metas, contents)


def _fallocate_fails(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    def full(*args: Any) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "posix_fallocate", full)


def test_full_disk_stops_growth_and_the_tier_replaces_its_lru_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC when a slab grows: the limit falls to the slab bytes held, writes evict the least recently
    used blocks and succeed; once the file system has room again the configured capacity is back."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=8)
        metas, views = payloads(5)
        assert await tier.write(metas[0], views[0])
        assert await tier.write(metas[1], views[1])
        # The file system is full: slabs cannot grow and statvfs reports no room.
        _fallocate_fails(monkeypatch, errno.ENOSPC)
        monkeypatch.setattr(capacity_module, "fs_room", lambda directory: 0)
        settled = Settles()
        assert await tier.write(metas[2], views[2], settled)  # no exception: the LRU block makes room
        assert settled.calls == [True] and not tier.counters.not_stored
        assert tier.limit_bytes == 2 * FILE_BYTES == tier.disk_bytes  # what it holds
        assert tier.path_of(metas[1].block_hash).stat().st_size == 2 * FILE_BYTES  # the failed growth is undone
        assert tier.lru_hashes() == [metas[1].block_hash, metas[2].block_hash] and tier.counters.evictions == 1
        # The file system has room again: the configured capacity is back, the slab grows, nothing is evicted.
        monkeypatch.undo()
        monkeypatch.setattr(capacity_module, "fs_room", lambda directory: 100 * FILE_BYTES)
        assert await tier.write(metas[3], views[3])
        assert tier.limit_bytes == tier.capacity_bytes == 8 * FILE_BYTES
        assert tier.lru_hashes() == [metas[1].block_hash, metas[2].block_hash, metas[3].block_hash]
        assert tier.disk_bytes == 3 * FILE_BYTES
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_full_disk_with_nothing_to_evict_is_not_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        tier = new_tier(tmp_path, files=8)
        metas, views = payloads(2)
        _fallocate_fails(monkeypatch, errno.EDQUOT)
        assert await tier.write_many([(m, v, Settles()) for m, v in zip(metas, views, strict=True)]) == [False] * 2
        assert dict(tier.counters.not_stored) == {"disk_full": 2} and tier.limit_bytes == 0
        assert tier.slab_paths() == [] and not (tier.directory / slab_name(0)).exists()
        monkeypatch.undo()
        assert await tier.write(metas[0], views[0])  # statvfs reports room: the capacity is back
        assert tier.limit_bytes == tier.capacity_bytes and tier.num_blocks == 1
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_a_write_the_file_system_refuses_gives_up_no_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EROFS opening the slab: the slot was never touched, so the block evicted for the write comes back (at
    the head of the LRU) and stays readable; the write is not stored (``read_only``)."""
    real_open = files_module.os.open

    def read_only(path: Any, flags: int, *args: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=2)
        metas, views = payloads(3)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:2], views[:2], strict=True)]))
        tier.take_events()
        monkeypatch.setattr(files_module.os, "open", read_only)
        assert not await tier.write(metas[2], views[2])
        assert dict(tier.counters.not_stored) == {"read_only": 1} and tier.counters.evictions == 0
        assert tier.lru_hashes() == [metas[0].block_hash, metas[1].block_hash] and tier.take_events() == []
        out = out_buffer()
        assert await tier.read_into(metas[0], out) and bytes(out) == bytes(views[0])
        monkeypatch.undo()
        assert await tier.write(metas[2], views[2])  # writable again: evicts the LRU block for real
        assert tier.lru_hashes() == [metas[0].block_hash, metas[2].block_hash] and tier.counters.evictions == 1
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
        # Room for two blocks: the third in one batch is refused up front, since every earlier one is in flight.
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
        Slot(tier, metas[1].block_hash).write(b"garbage")
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
        assert tier.counters.integrity_failures == {"bad_magic": 1} and tier.counters.collisions == 1
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

    def second_hangs(*args: Any) -> int:  # the batch's second run hangs (one I/O thread: in order)
        nonlocal calls
        calls += 1
        if calls == 2:
            release.wait(10)
        return real_read_full(*args)

    async def scenario() -> None:
        tier = new_tier(tmp_path, deadline_s=0.3, max_concurrent_io=1)
        stored, stored_views = payloads(5)
        for meta, view in zip(stored, stored_views, strict=True):
            assert await tier.write(meta, view)
        metas, views = stored[::2], stored_views[::2]  # slots 0, 2, 4: three runs
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
        stored, views = payloads(3)
        for meta, view in zip(stored, views, strict=True):
            assert await tier.write(meta, view)
        metas = stored[::2]  # slots 0 and 2: two runs
        monkeypatch.setattr(files_module, "read_full", first_breaks)
        settles = [Settles(), Settles()]
        with pytest.raises(RuntimeError, match="a bug"):
            await tier.read_many([(m, out_buffer(), s) for m, s in zip(metas, settles, strict=True)])
        assert [s.calls for s in settles] == [[False], [True]]  # every buffer handed back before the raise
        assert len(tier.lru_hashes()) == 3  # a bug is not a damaged slot: nothing removed
        await tier.aclose()

    asyncio.run(scenario())


def test_evicted_slots_are_reused_in_place(tmp_path: Path) -> None:
    """A write into a full tier overwrites the evicted blocks' slots: the slab does not grow, no file is
    created, and a batch evicting consecutive slots writes them as one run again."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=3)
        metas, views = payloads(6)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:3], views[:3], strict=True)]))
        places = [tier.location_of(m.block_hash) for m in metas[:3]]
        inode = os.stat(places[0][0]).st_ino
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[3:], views[3:], strict=True)]))
        assert [tier.location_of(m.block_hash) for m in metas[3:]] == places
        assert os.stat(places[0][0]).st_ino == inode and tier.disk_bytes == 3 * FILE_BYTES
        assert tier.lru_hashes() == [m.block_hash for m in metas[3:]] and tier.counters.evictions == 3
        assert [p.name for p in tier.directory.iterdir()] == [slab_name(0)]
        for meta, view in zip(metas[3:], views[3:], strict=True):
            out = out_buffer()
            assert await tier.read_into(meta, out) and bytes(out) == bytes(view)
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_a_refused_slot_is_not_taken_up_by_a_restart_and_is_reused(tmp_path: Path) -> None:
    async def first_life() -> list[BlockMeta]:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(2)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas, views, strict=True)]))
        _flip(FILE_BYTES - 1)(Slot(tier, metas[0].block_hash), Slot(tier, metas[0].block_hash))
        assert not await tier.read_into(metas[0], out_buffer())  # refused: its header is zeroed
        assert tier.used_bytes == FILE_BYTES and tier.disk_bytes == 2 * FILE_BYTES
        await tier.aclose()
        return metas

    metas = asyncio.run(first_life())

    async def second_life() -> None:
        tier = new_tier(tmp_path, files=4)
        assert not tier.counters.scan_removed  # a zeroed header is a free slot, not damage
        assert tier.lru_hashes() == [metas[1].block_hash] and tier.used_bytes == FILE_BYTES
        more, views = payloads(3, seed=1)
        assert await tier.write(more[2], views[2])
        assert tier.location_of(more[2].block_hash)[1] == 0  # the freed slot, reused
        assert tier.disk_bytes == 2 * FILE_BYTES
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(second_life())


@pytest.mark.parametrize("second", ["stored", "failed before", "failed after"])
def test_a_block_written_again_while_its_slot_is_overwritten_is_removed_only_if_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    """Write 1 (C) evicts A and is slow; meanwhile write 2 stores A again in another slot (evicting B). When
    write 1 settles A is not gone: no BlockRemoved A. If write 2 fails -- before write 1 settles, or after
    -- A is gone, and removed then: the events a subscriber sees always end where the index does."""
    import kvstore.tiers.disk as disk_module

    real_write_run = disk_module.write_run
    first_gate, second_gate = threading.Event(), threading.Event()

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=2, direct_io=False)
        (a, b, c), views = payloads(3)
        assert all(await tier.write_many([(a, views[0], Settles()), (b, views[1], Settles())]))
        tier.take_events()

        def write_run(path: Any, offset: int, blocks: Any, *args: Any) -> None:
            if blocks[0].meta.block_hash == c.block_hash:
                assert first_gate.wait(10)
            elif second != "stored":
                assert second_gate.wait(10)
                raise OSError(errno.EIO, "Input/output error")
            real_write_run(path, offset, blocks, *args)

        monkeypatch.setattr(disk_module, "write_run", write_run)
        first = asyncio.create_task(tier.write(c, views[2]))  # evicts A (the LRU block) and waits at its gate
        await loop_until(lambda: a.block_hash not in tier.lru_hashes())
        again = asyncio.create_task(tier.write(a, views[0]))  # A again: evicts B
        (first_gate if second == "failed after" else second_gate).set()
        done, _ = await asyncio.wait([first, again], return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        first_gate.set()
        second_gate.set()
        assert await first and await again is (second == "stored")
        held: set[int] = set()
        for event in tier.take_events():
            (held.add if isinstance(event, BlockStored) else held.discard)(event.block_hashes[0])
        assert held == set(tier.lru_hashes())
        assert held == ({a.block_hash, c.block_hash} if second == "stored" else {c.block_hash})
        assert tier.counters.evictions == (1 if second == "stored" else 2)  # B; and A, when its new copy failed
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())
