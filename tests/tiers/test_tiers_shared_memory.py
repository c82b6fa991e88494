"""SharedSlots: a real /dev/shm arena, mapped by name from a second (spawned) process, unlinked on close."""

from __future__ import annotations

import errno
import gc
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from tiers_helpers import arena_name, child_read_slot

from kvstore.tiers.errors import ArenaError
from kvstore.tiers.shared_memory import HEADER_BYTES, SharedSlots, reclaim_dead_arenas

SHM = "/dev/shm"


def test_create_attach_and_unlink_on_close() -> None:
    name = arena_name()
    owner = SharedSlots.create(name, 4, 8192, shm_dir=SHM, tag="identity-x")
    path = Path(SHM) / name
    assert path.stat().st_size == HEADER_BYTES + 4 * 8192
    assert owner.tensor.shape == (4, 8192) and owner.tensor.dtype == torch.uint8
    owner.tensor[2].fill_(7)
    other = SharedSlots.attach(name, shm_dir=SHM, expect_tag="identity-x")
    assert other.info == owner.info and other.info.tag == "identity-x"
    assert bytes(other.view(2)) == b"\x07" * 8192  # the same memory, no copy
    other.tensor[3, :3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert bytes(owner.view(3)[:3]) == b"\x01\x02\x03"
    other.close()
    assert path.exists()  # attachers never unlink
    owner.close()
    assert not path.exists() and not owner.mapped
    owner.close()  # idempotent


def test_views_keep_memory_alive_after_close() -> None:
    owner = SharedSlots.create(arena_name(), 2, 4096, shm_dir=SHM)
    row = owner.tensor[1]
    row.fill_(9)
    owner.close()
    assert not owner.path.exists() and owner.mapped
    assert int(row.sum()) == 9 * 4096  # still mapped: the view outlives the name
    del row
    gc.collect()
    owner.close()  # a second close unmaps once the views are gone
    assert not owner.mapped
    with pytest.raises(ArenaError, match="closed"):
        owner.view(0)


def test_second_process_maps_the_arena_by_name() -> None:
    name = arena_name()
    with SharedSlots.create(name, 3, 4096, shm_dir=SHM) as owner:
        block = os.urandom(4096)
        owner.tensor[1] = torch.frombuffer(bytearray(block), dtype=torch.uint8)
        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            seen = pool.apply(child_read_slot, (name, SHM, 1, b"from-child"))
        assert seen == block  # the child read what this process wrote
        assert bytes(owner.view(0)[:10]) == b"from-child"  # and this process sees what it wrote


def test_attach_errors() -> None:
    with pytest.raises(ArenaError, match="is the tier actor"):
        SharedSlots.attach(arena_name(), shm_dir=SHM)
    with pytest.raises(ArenaError, match="letters, digits"):
        SharedSlots.attach("../etc/passwd", shm_dir=SHM)
    with SharedSlots.create(arena_name(), 1, 4096, shm_dir=SHM, tag="a") as owner:
        with pytest.raises(ArenaError, match="another cache identity"):
            SharedSlots.attach(owner.name, shm_dir=SHM, expect_tag="b")
        with pytest.raises(ArenaError, match="in use by another process"):
            SharedSlots.create(owner.name, 1, 4096, shm_dir=SHM)
    foreign = Path(SHM) / arena_name()
    foreign.write_bytes(b"not an arena" * 400)
    try:
        with pytest.raises(ArenaError, match="bad magic"):
            SharedSlots.attach(foreign.name, shm_dir=SHM)
    finally:
        foreign.unlink()


def test_arenas_of_dead_owners_are_reclaimed() -> None:
    same, other = arena_name(), arena_name()
    context = multiprocessing.get_context("spawn")
    for name in (same, other):
        process = context.Process(target=_create_and_die, args=(name,))
        process.start()
        process.join(30)
        assert process.exitcode == 0 and (Path(SHM) / name).exists()  # left behind by a killed owner
    with SharedSlots.create(arena_name(), 1, 4096, shm_dir=SHM) as alive:
        assert not (Path(SHM) / other).exists() and not (Path(SHM) / same).exists()  # swept on create
        assert reclaim_dead_arenas(Path(SHM)) == []  # a live owner's arena stays
        assert alive.path.exists()
    process = context.Process(target=_create_and_die, args=(same,))
    process.start()
    process.join(30)
    with SharedSlots.create(same, 2, 4096, shm_dir=SHM) as reused:  # the dead owner's name is free again
        assert reused.num_slots == 2


def _create_and_die(name: str) -> None:
    slots = SharedSlots.create(name, 1, 4096, shm_dir=SHM)
    slots._finalizer.detach()  # type: ignore[union-attr]  # simulate a crash: no clean-up runs
    os._exit(0)


def test_too_small_shm_fails_at_creation(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    name = arena_name()
    with pytest.raises(ArenaError, match="shm-size"):
        SharedSlots.create(name, 4, 4096, shm_dir=SHM)
    assert not (Path(SHM) / name).exists()


def test_a_dead_owners_control_socket_files_go_with_its_arena() -> None:
    """A tier killed with its process group leaves its arena and its control socket file; the next start on the
    node reclaims the arena under another name (a new node id), and must take the socket file with it."""
    dead, orphan = arena_name(), arena_name()
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=_create_and_die, args=(dead,))
    process.start()
    process.join(30)
    shm = Path(SHM)
    dead_socket, orphan_socket = shm / f"{dead}.0123456789ab.ctl", shm / f"{orphan}.0123456789ab.ctl"
    for path in (dead_socket, orphan_socket):
        path.touch()
    with SharedSlots.create(arena_name(), 1, 4096, shm_dir=SHM) as alive:
        live_socket = shm / f"{alive.path.name}.0123456789ab.ctl"
        live_socket.touch()
        try:
            reclaim_dead_arenas(shm)
            assert not (shm / dead).exists() and not dead_socket.exists() and not orphan_socket.exists()
            assert live_socket.exists()  # a live tier's socket stays
        finally:
            live_socket.unlink()
