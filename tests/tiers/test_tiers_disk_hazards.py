"""DiskTier against what it meets on a real file system besides its own slabs: links and other files under
slab names, its directory removed under it, slabs it cannot grow or write, bad configuration."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_tiers_disk import FILE_BYTES, Settles, new_tier, out_buffer, payloads
from tiers_helpers import IDENTITY

import kvstore.tiers.disk_format as disk_format
from kvstore.deploy.config import load_config
from kvstore.errors import ConfigError
from kvstore.events import BlockRemoved
from kvstore.tiers.config import TierConfig
from kvstore.tiers.disk_format import slab_name

PRECIOUS = b"a user's file, not the tier's\n" * 8


def test_links_and_other_entries_under_slab_names_are_removed_never_followed(tmp_path: Path) -> None:
    """A symlink under a slab's name -- to a user's file, or dangling -- would have the kernel write slab data
    through it. The scan removes every slab-named entry that is not a regular file (``not_a_file``), the link
    itself and never what it names, and the tier then writes its own slabs."""
    directory = tmp_path / IDENTITY.digest()
    directory.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_bytes(PRECIOUS)
    (directory / slab_name(0)).symlink_to(precious)
    elsewhere = tmp_path / "elsewhere.kvslab"
    (directory / slab_name(1)).symlink_to(elsewhere)  # dangling
    os.mkfifo(directory / slab_name(2))  # would block an open for writing

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        assert dict(tier.counters.scan_removed) == {"not_a_file": 3} and tier.num_blocks == 0
        assert sorted(os.listdir(directory)) == [] and precious.read_bytes() == PRECIOUS
        metas, views = payloads(3)
        assert await tier.write_many([(m, v, Settles()) for m, v in zip(metas, views, strict=True)]) == [True] * 3
        slab = directory / slab_name(0)
        assert not slab.is_symlink() and slab.stat().st_size == 3 * FILE_BYTES
        assert precious.read_bytes() == PRECIOUS and not elsewhere.exists()
        out = out_buffer()
        assert await tier.read_into(metas[2], out) and bytes(out) == bytes(views[2])
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_a_slab_swapped_for_a_link_while_running_is_refused_not_written_through(tmp_path: Path) -> None:
    """A slab replaced by a symlink behind the running tier's back: reads and writes open it with O_NOFOLLOW,
    so they fail (ELOOP) -- a miss and *not stored* -- and the linked file is never touched."""
    precious = tmp_path / "precious.txt"
    precious.write_bytes(PRECIOUS)

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(3)
        assert await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:2], views[:2], strict=True)])
        slab = tier.directory / slab_name(0)
        slab.unlink()
        slab.symlink_to(precious)
        tier.take_events()
        assert not await tier.read_into(metas[0], out_buffer())  # a miss, the block dropped
        assert dict(tier.counters.io_errors) == {"ELOOP": 1} and metas[0].block_hash not in tier
        assert not await tier.write(metas[2], views[2])  # into the slot block 0 left free
        assert dict(tier.counters.not_stored) == {"io_error": 1}
        assert dict(tier.counters.io_errors) == {"ELOOP": 2}
        assert precious.read_bytes() == PRECIOUS and slab.is_symlink()
        assert tier.lru_hashes() == [metas[1].block_hash]
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def removed_hashes(events: list[Any]) -> list[int]:
    return [h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes]


def test_the_directory_removed_while_running_is_made_again_and_its_blocks_dropped(tmp_path: Path) -> None:
    """``rm -rf`` of the identity directory under a running tier: the write that meets ENOENT is *not stored*,
    the directory is made again (0700), every block of the slabs that went with it is dropped and published as
    removed, ``disk_bytes`` falls to what is on disk, and the next writes store blocks again."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(7)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:4], views[:4], strict=True)]))
        tier.take_events()
        shutil.rmtree(tier.directory)
        settled = Settles()
        assert not await tier.write(metas[4], views[4], settled)  # into block 0's slot: the slab is gone
        assert settled.calls == [False]
        assert dict(tier.counters.not_stored) == {"io_error": 1} and dict(tier.counters.io_errors) == {"ENOENT": 1}
        assert tier.directory.is_dir() and tier.directory.stat().st_mode & 0o777 == 0o700
        assert tier.num_blocks == 0 and tier.disk_bytes == 0 == tier.used_bytes
        assert sorted(removed_hashes(tier.take_events())) == sorted(m.block_hash for m in metas[:4])
        assert dict(tier.counters.integrity_failures) == {"missing": 3}  # block 0 was evicted for the write
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[4:], views[4:], strict=True)]))
        assert (tier.directory / slab_name(0)).stat().st_size == 3 * FILE_BYTES == tier.disk_bytes
        for meta, view in zip(metas[4:], views[4:], strict=True):
            out = out_buffer()
            assert await tier.read_into(meta, out) and bytes(out) == bytes(view)
        assert dict(tier.counters.not_stored) == {"io_error": 1}
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_the_directory_removed_before_a_slab_grows_or_a_read_loses_only_its_blocks(tmp_path: Path) -> None:
    """The directory gone when a slab must grow: it is made again and the growth done there, so that write is
    stored; gone under a read: a miss, and the tier starts over the same way."""

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(5)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:2], views[:2], strict=True)]))
        tier.take_events()
        shutil.rmtree(tier.directory)
        assert await tier.write(metas[2], views[2])  # slab 0 grows in the directory made again
        assert tier.lru_hashes() == [metas[2].block_hash] and tier.disk_bytes == FILE_BYTES
        assert (tier.directory / slab_name(0)).stat().st_size == FILE_BYTES
        assert sorted(removed_hashes(tier.take_events())) == sorted(m.block_hash for m in metas[:2])
        assert not tier.counters.not_stored and dict(tier.counters.integrity_failures) == {"missing": 2}
        shutil.rmtree(tier.directory)
        assert not await tier.read_into(metas[2], out_buffer())
        assert tier.num_blocks == 0 and tier.disk_bytes == 0 and tier.directory.is_dir()
        assert dict(tier.counters.integrity_failures) == {"missing": 3}
        assert await tier.write(metas[3], views[3])
        out = out_buffer()
        assert await tier.read_into(metas[3], out) and bytes(out) == bytes(views[3])
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_a_slab_that_cannot_grow_is_counted_by_the_file_systems_reason_not_capacity(tmp_path: Path) -> None:
    """A directory (with a file in it) where slab 0 must go: the scan leaves it -- not the tier's to delete --
    and the slab cannot grow (EISDIR). The blocks are *not stored* for an I/O error, not for capacity (the
    tier is empty); each batch tries the growth again, so once the directory is gone writes are stored."""
    directory = tmp_path / IDENTITY.digest()
    (directory / slab_name(0)).mkdir(parents=True)
    (directory / slab_name(0) / "notes.txt").write_text("someone's")

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        assert not tier.counters.scan_removed and (directory / slab_name(0) / "notes.txt").exists()
        metas, views = payloads(3)
        requests = [(m, v, Settles()) for m, v in zip(metas[:2], views[:2], strict=True)]
        assert await tier.write_many(requests) == [False, False]
        assert dict(tier.counters.not_stored) == {"io_error": 2} and dict(tier.counters.io_errors) == {"EISDIR": 1}
        assert await tier.write_many(requests) == [False, False]
        assert dict(tier.counters.not_stored) == {"io_error": 4} and dict(tier.counters.io_errors) == {"EISDIR": 2}
        assert tier.disk_bytes == 0 and tier.limit_bytes == tier.capacity_bytes
        shutil.rmtree(directory / slab_name(0))
        assert await tier.write_many(requests) == [True, True]
        assert (directory / slab_name(0)).stat().st_size == 2 * FILE_BYTES == tier.disk_bytes
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize(("code", "reason"), [(errno.EIO, "io_error"), (errno.EACCES, "read_only")])
def test_a_growth_the_device_refuses_is_not_stored_for_that_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, reason: str
) -> None:
    """EIO or EACCES from ``posix_fallocate`` (a failing device, a locked-down file system; running as root,
    the real ones cannot be made here): the blocks left without a slot are *not stored* for that reason, the
    limit stays (only ENOSPC / EDQUOT mean full), and the growth is undone."""

    def refused(*args: Any) -> None:
        raise OSError(code, os.strerror(code))

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(3)
        assert await tier.write(metas[0], views[0])
        monkeypatch.setattr(os, "posix_fallocate", refused)
        requests = [(m, v, Settles()) for m, v in zip(metas[1:], views[1:], strict=True)]
        assert await tier.write_many(requests) == [True, False]  # block 0 evicted for one of them
        assert dict(tier.counters.not_stored) == {reason: 1}
        assert dict(tier.counters.io_errors) == {errno.errorcode[code]: 1}
        assert tier.limit_bytes == tier.capacity_bytes and tier.disk_bytes == FILE_BYTES
        assert (tier.directory / slab_name(0)).stat().st_size == FILE_BYTES
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize(("value", "got"), [("", "got empty"), ("cache/kv", "got relative \\('cache/kv'\\)")])
def test_disk_dir_must_be_absolute(value: str, got: str) -> None:
    """The tier actor runs in Ray's working directory: ``tiers.disk_dir = ""`` wrote the cache there, and a
    relative path resolved against it, not against the user's. Both are refused, naming the field."""
    with pytest.raises(ConfigError, match=f"config field tiers: disk_dir must be an absolute path, {got}"):
        load_config(overrides=[f"tiers.disk_dir={value}"])
    with pytest.raises(ValueError, match="disk_dir must be an absolute path"):
        TierConfig(disk_dir=value)
    assert load_config(overrides=["tiers.disk_dir=/var/cache/kv"]).tiers.disk_dir == "/var/cache/kv"
    assert TierConfig().disk_dir is None


@pytest.mark.parametrize("size", [0, 100, FILE_BYTES - 1])
def test_a_slab_too_short_for_one_slot_is_removed_as_such(tmp_path: Path, size: int) -> None:
    """An empty slab, or one cut inside its first slot, is removed as ``slab_too_short`` (it is not beyond the
    capacity); the slab after it then follows a gap."""
    directory = tmp_path / IDENTITY.digest()
    directory.mkdir()
    (directory / slab_name(0)).write_bytes(os.urandom(size))
    metas, views = payloads(1)

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        assert dict(tier.counters.scan_removed) == {"slab_too_short": 1}
        assert os.listdir(directory) == [] and tier.disk_bytes == 0
        assert await tier.write(metas[0], views[0]) and tier.disk_bytes == FILE_BYTES
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())


def test_a_slab_of_foreign_bytes_is_counted_not_silently_adopted_and_other_names_are_left_alone(
    tmp_path: Path,
) -> None:
    """A slab full of random bytes: every slot's header is not a block's, counted ``bad_magic`` (a slot of
    zeros, never written, is free and not counted); its slots are free and reused. Files whose names are not
    a slab's (five digits, another suffix) are not the tier's: the scan leaves them as they are."""
    directory = tmp_path / IDENTITY.digest()
    directory.mkdir()
    (directory / slab_name(0)).write_bytes(os.urandom(3 * FILE_BYTES) + bytes(FILE_BYTES))
    foreign = {"junk.bin": os.urandom(1000), "00001.kvslab": os.urandom(FILE_BYTES), "000001.kvslab.bak": b"x"}
    for name, content in foreign.items():
        (directory / name).write_bytes(content)

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=8)
        assert dict(tier.counters.scan_removed) == {"bad_magic": 3}
        assert tier.num_blocks == 0 and tier.disk_bytes == 4 * FILE_BYTES and tier.used_bytes == 0
        metas, views = payloads(4)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas, views, strict=True)]))
        assert tier.disk_bytes == 4 * FILE_BYTES  # the four free slots, no growth
        out = out_buffer()
        assert await tier.read_into(metas[1], out) and bytes(out) == bytes(views[1])
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())
    assert {name: (directory / name).read_bytes() for name in foreign} == foreign


@contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """``path`` made read-only for real: mode 0400, and immutable (``chattr +i``) where the tests run as root,
    whom modes do not stop; skips the test where neither holds on this file system."""
    path.chmod(0o400)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    try:
        try:
            os.close(os.open(path, os.O_WRONLY))
        except PermissionError:
            pass
        else:
            pytest.skip("cannot make a file unwritable here (root, without chattr +i)")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o600)


def test_one_slab_the_tier_cannot_write_does_not_stop_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two slots a slab, the tier full across two slabs, slab 0 unwritable. The first write evicts slab 0's LRU
    block, is refused before touching it (*not stored*, ``read_only``) and the block comes back at the head of
    the LRU. Later writes keep away from slab 0 for a while, evicting slab 1's blocks instead -- rather than
    picking the same block and being refused again, batch after batch -- and slab 0's blocks stay served."""
    monkeypatch.setattr(disk_format, "SLAB_TARGET_BYTES", 2 * FILE_BYTES)

    async def scenario() -> None:
        tier = new_tier(tmp_path, files=4)
        metas, views = payloads(7)
        assert all(await tier.write_many([(m, v, Settles()) for m, v in zip(metas[:4], views[:4], strict=True)]))
        assert [tier.path_of(m.block_hash).name for m in metas[:4]] == [slab_name(0)] * 2 + [slab_name(1)] * 2
        with unwritable(tier.directory / slab_name(0)):
            assert not await tier.write(metas[4], views[4])
            assert dict(tier.counters.not_stored) == {"read_only": 1} and tier.counters.evictions == 0
            assert await tier.write(metas[5], views[5])
            assert await tier.write(metas[6], views[6])
            assert dict(tier.counters.not_stored) == {"read_only": 1}
            assert tier.lru_hashes() == [metas[i].block_hash for i in (0, 1, 5, 6)]
            assert [tier.path_of(metas[i].block_hash).name for i in (5, 6)] == [slab_name(1)] * 2
            for i in (0, 1, 5, 6):
                out = out_buffer()
                assert await tier.read_into(metas[i], out) and bytes(out) == bytes(views[i])
        tier.check_invariants()
        await tier.aclose()

    asyncio.run(scenario())
