"""TierStore scenarios on real shared memory and real files: spill, write-back to disk, promote, events, faults.

Blocks go in and out the way a worker moves them -- a TierLink over an in-process client, copying between a
pool tensor and the arena under leases -- or through the store's lease calls themselves.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from prometheus_client import CollectorRegistry
from tiers_helpers import (
    IDENTITY,
    all_events,
    arena_name,
    hashes,
    linked_tier,
    make_blocks,
    new_store,
    promote_all,
    request_events,
    spill_all,
    tier_config,
)

import kvstore.tiers.copy_engine as copy_module
import kvstore.tiers.disk_capacity as capacity_module
import kvstore.tiers.disk_files as files_module
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import BlockRemoved, BlockStored
from kvstore.metrics import render
from kvstore.tiers.blocks import BlockMeta, check_blocks, check_tokens
from kvstore.tiers.copy_engine import CopyEngine
from kvstore.tiers.errors import ArenaMovedError, InvalidBlockError, LeaseError, TierUnavailableError
from kvstore.tiers.metrics import TierCollector
from kvstore.tiers.shared_memory import SharedSlots
from kvstore.tiers.store import TierStore


def test_spill_to_cpu_evict_to_disk_and_read_back_byte_identical(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=4, disk_blocks=64)) as (client, link):
        store = client.store
        metas, data = make_blocks(12)
        assert spill_all(link, metas, data) == 12
        client.check_invariants()
        # The arena holds the last 4; the 8 before them were written back to disk on eviction.
        assert client.lookup(hashes(metas)) == (12, ("STORAGE",) * 8 + ("CPU",) * 4)
        assert store.cpu.lru_hashes() == hashes(metas[8:])
        # (in the order the concurrent writes finished)
        assert store.disk is not None and set(store.disk.lru_hashes()) == set(hashes(metas[:8]))
        promoted, got = promote_all(link, metas)
        assert len(promoted.block_ids) == 12 and torch.equal(got, data)  # every byte, every block
        assert promoted.media[:4] == ("STORAGE",) * 4
        stats = client.stats()
        assert stats.offload_bytes["spill"] == 12 * 4096 and stats.offload_bytes["disk_read"] >= 8 * 4096
        assert stats.usage_bytes["CPU"] == 4 * 4096 and stats.blocks["STORAGE"] >= 8
        client.check_invariants()


def test_worker_flow_through_the_arena_mapped_by_name(tmp_path: Path) -> None:
    """What a worker on the node does: map the arena, copy with its own engine, lease through the store."""

    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=8, disk_blocks=64)) as store:
            info = store.arena_info
            assert info.tag == IDENTITY.digest() and info.slot_bytes == IDENTITY.block_bytes
            arena = SharedSlots.attach(info.name, shm_dir=info.shm_dir, expect_tag=IDENTITY.digest())
            engine = CopyEngine(arena.tensor, num_threads=2, pin=False)
            metas, data = make_blocks(6)
            pool = torch.zeros((16, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
            pool[[3, 9, 4, 12, 0, 7]] = data
            # spill pool blocks 3, 9, 4, 12, 0, 7 (metas 0..5)
            grants = await store.reserve(metas)
            assert all(g is not None and g.medium == "CPU" for g in grants)
            slots = [g.slot for g in grants if g is not None]
            await asyncio.wrap_future(engine.spill(pool, [3, 9, 4, 12, 0, 7], slots))
            assert await store.commit([g.lease_id for g in grants if g is not None]) == 6
            assert store.lookup(hashes(metas), start=2) == (4, ("CPU",) * 4)
            # promote metas 2..5 into fresh pool rows 13, 14, 15, 1
            held = await store.acquire(metas[2:])
            assert [g.block_hash for g in held] == hashes(metas[2:])
            await asyncio.wrap_future(engine.promote([g.slot for g in held], pool, [13, 14, 15, 1]))
            store.release([g.lease_id for g in held])
            assert torch.equal(pool[[13, 14, 15, 1]], data[2:])
            assert store.stats().hits == {"CPU": 4}
            engine.close()
            arena.close()
            store.check_invariants()

    asyncio.run(scenario())


def test_leases_name_the_arena_incarnation_the_caller_mapped(tmp_path: Path) -> None:
    """A restarted tier re-creates its arena under the same name: a worker still mapping the old one gets no lease."""

    async def scenario() -> None:
        metas, _ = make_blocks(2)
        async with new_store(tier_config(tmp_path, cpu_blocks=8, disk_blocks=1)) as store:
            first = store.arena_info.incarnation
            grants = await store.reserve(metas[:1], first)
            assert await store.commit([g.lease_id for g in grants if g is not None]) == 1
            with pytest.raises(ArenaMovedError, match="remap"):
                await store.reserve(metas[1:], first ^ 1)
            with pytest.raises(ArenaMovedError):
                await store.acquire(metas[:1], first ^ 1)
            held = await store.acquire(metas[:1], first)
            store.release([g.lease_id for g in held])
            assert store.stats().blocks["CPU"] == 1  # the refused calls leased and stored nothing
            store.check_invariants()

    asyncio.run(scenario())
    # The same name created twice (what a restarted tier actor does): two incarnations.
    one = SharedSlots.create("kvstore-test-incarnation", 2, 64, shm_dir=str(tmp_path), prefault=False)
    incarnation = one.incarnation
    assert SharedSlots.attach("kvstore-test-incarnation", shm_dir=str(tmp_path)).incarnation == incarnation
    one.close()
    two = SharedSlots.create("kvstore-test-incarnation", 2, 64, shm_dir=str(tmp_path), prefault=False)
    assert two.info.incarnation != incarnation
    two.close()


def test_a_failed_copy_releases_every_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("copy failed")

    with linked_tier(tier_config(tmp_path, cpu_blocks=8)) as (client, link):
        metas, data = make_blocks(8)
        spill_all(link, metas[:4], data[:4])
        monkeypatch.setattr(copy_module, "_copy_pairs", broken)
        monkeypatch.setattr(copy_module, "_copy_pairs_native", broken)  # the compiled kernel's path
        with pytest.raises(RuntimeError, match="copy failed"):
            spill_all(link, metas[4:], data[4:])
        with pytest.raises(RuntimeError, match="copy failed"):
            promote_all(link, metas[:4])
        assert client.store.cpu.num_leased_slots == 0 and client.lookup(hashes(metas)).num_blocks == 4
        client.check_invariants()


def test_leased_slots_are_not_reused_mid_copy(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=4, disk_blocks=64)) as (client, link):
        store = client.store
        metas, data = make_blocks(4)
        spill_all(link, metas, data)
        held = client.acquire(metas[:2])  # a worker is copying these two out
        before = {g.slot: bytes(store.cpu.view(g.slot)) for g in held}
        more, more_data = make_blocks(6, first_token=1000, seed=1)
        # Pressure: only the 2 unleased slots can turn over, so another worker's evictions spill two at a time.
        stored = sum(link.spill(more[i : i + 2], more_data, [i, i + 1]) for i in range(0, 6, 2))
        assert stored == 6 and all(g.block_hash in store.cpu for g in held)
        assert {g.slot: bytes(store.cpu.view(g.slot)) for g in held} == before
        client.release([g.lease_id for g in held])
        client.check_invariants()


def test_all_slots_leased_is_back_pressure_not_an_error(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=2)) as (client, link):
        metas, data = make_blocks(2)
        spill_all(link, metas, data)
        held = client.acquire(metas)
        more, more_data = make_blocks(1, first_token=500)
        assert client.reserve(more) == [None]
        assert spill_all(link, more, more_data) == 0  # a worker's spill skips the block; nothing waits
        assert client.stats().not_stored["CPU"] == {"no_free_slot": 2}
        client.release([g.lease_id for g in held])


def test_admission_after_the_second_spill(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=4, admit_after_spills=2)) as (client, link):
        metas, data = make_blocks(3)
        assert spill_all(link, metas, data) == 0
        assert client.stats().not_stored["CPU"] == {"not_admitted": 3}
        assert spill_all(link, metas[:2], data[:2]) == 2
        assert client.lookup(hashes(metas)) == (2, ("CPU", "CPU"))
        assert spill_all(link, metas[:2], data[:2]) == 0 and client.stats().duplicates == 2


def test_a_batch_with_a_block_twice_or_one_held_grants_the_others_in_place(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=8)) as (client, _link):
        metas, _ = make_blocks(4)
        a, b, c, d = metas
        grants = client.reserve([a, b, a])  # the second a is the same block earlier in this batch
        assert [g is not None for g in grants] == [True, True, False]
        assert [g.block_hash for g in grants if g is not None] == [a.block_hash, b.block_hash]
        assert client.stats().duplicates == 1
        client.commit([g.lease_id for g in grants if g is not None])
        grants = client.reserve([c, a, d])  # a is held now: skipped, its neighbours granted in their places
        assert [g.block_hash if g is not None else None for g in grants] == [c.block_hash, None, d.block_hash]
        assert client.stats().duplicates == 2
        client.commit([g.lease_id for g in grants if g is not None])
        assert client.lookup(hashes(metas)).num_blocks == 4
        client.check_invariants()


def test_write_through_puts_every_block_on_disk_at_once(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=8, disk_blocks=8, write_through=True)) as (client, link):
        store = client.store
        metas, data = make_blocks(3)
        spill_all(link, metas, data)
        assert store.disk is not None and set(store.disk.lru_hashes()) == set(hashes(metas))
        assert store.cpu.lru_hashes() == hashes(metas)
        client.check_invariants()


def test_corrupt_disk_block_ends_the_hit_and_is_never_served(tmp_path: Path) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)) as (client, link):
        store = client.store
        metas, data = make_blocks(6)
        spill_all(link, metas, data)  # 0..3 on disk, 4..5 in CPU
        assert store.disk is not None
        path, offset = store.disk.location_of(metas[2].block_hash)
        last = offset + store.disk.file_bytes - 1  # the slot's last payload byte
        raw = bytearray(path.read_bytes())
        raw[last] ^= 0xFF
        path.write_bytes(raw)
        promoted, got = promote_all(link, metas)
        assert len(promoted.block_ids) == 2 and torch.equal(got, data[:2])  # stops before the corrupt block
        stats = client.stats()
        assert stats.integrity_failures == {"bad_checksum": 1} and metas[2].block_hash not in store.disk
        assert client.lookup(hashes(metas)).num_blocks == 2  # (in CPU or on disk, as promotion left them)
        client.check_invariants()


def test_full_disk_degrades_spill_without_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with linked_tier(tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)) as (client, link):
        monkeypatch.setattr(os, "posix_fallocate", disk_full)  # no slab can grow
        monkeypatch.setattr(files_module, "write_all", disk_full)
        monkeypatch.setattr(capacity_module, "fs_room", lambda directory: 0)  # statvfs agrees: no room
        metas, data = make_blocks(5)
        # One block a call, as a worker's evictions come: from the third on, each writes one block back.
        stored = sum(link.spill([meta], data, [row]) for row, meta in enumerate(metas))
        assert stored == 5  # every block reached the CPU tier
        assert client.lookup(hashes(metas)) == (0, ())  # the evicted ones could not be kept
        assert client.lookup(hashes(metas), start=3) == (2, ("CPU", "CPU"))
        stats = client.stats()
        # The first write-back's slab cannot grow (ENOSPC): the tier limits itself to what it holds (nothing),
        # so each write-back is turned away before any I/O.
        assert stats.not_stored["STORAGE"] == {"disk_full": 3}
        assert stats.blocks["STORAGE"] == 0 and stats.capacity_bytes["STORAGE"] == 0
        client.check_invariants()
        monkeypatch.undo()  # room again: the next write-backs take the configured capacity back
        more, more_data = make_blocks(2, first_token=100)
        assert spill_all(link, more, more_data) == 2
        stats = client.stats()
        assert stats.blocks["STORAGE"] == 2
        assert stats.capacity_bytes["STORAGE"] == client.store.config.disk_capacity_bytes
        client.check_invariants()


def test_restarted_store_serves_what_it_had_on_disk(tmp_path: Path) -> None:
    metas, data = make_blocks(6)
    config = tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)
    with linked_tier(config) as (_, link):
        spill_all(link, metas, data)  # 0..3 written back, 4..5 only in CPU
    with linked_tier(config) as (client, link):
        assert client.lookup(hashes(metas)) == (4, ("STORAGE",) * 4)
        promoted, got = promote_all(link, metas)
        assert len(promoted.block_ids) == 4 and torch.equal(got, data[:4])


def test_events_cover_both_media_with_tokens_and_parents(tmp_path: Path, events_config: EventsConfig) -> None:
    config = tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)
    with linked_tier(config, events=events_config) as (client, link):
        endpoints = client.event_endpoints()
        assert endpoints is not None and endpoints.endpoint is not None and endpoints.replay_endpoint is not None
        metas, data = make_blocks(3)
        spill_all(link, metas, data)
        assert client.store.flush_events()
        events = all_events(endpoints.replay_endpoint)
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        # The 2-slot arena takes blocks 0 and 1 in one chunk; making room for block 2 writes block 0 back to
        # disk before block 2 is granted its slot.
        assert [(e.medium, e.block_hashes[0]) for e in stored] == [
            ("CPU", metas[0].block_hash),
            ("CPU", metas[1].block_hash),
            ("STORAGE", metas[0].block_hash),
            ("CPU", metas[2].block_hash),
        ]
        assert [(e.medium, e.block_hashes) for e in removed] == [("CPU", [metas[0].block_hash])]
        first_on_disk = stored[2]
        assert first_on_disk.token_ids == list(metas[0].token_ids) and first_on_disk.parent_block_hash is None
        assert stored[3].parent_block_hash == metas[1].block_hash and stored[3].block_size == 4
        snapshot = request_events(endpoints.replay_endpoint, b"snapshot")
        seen = {(e.medium, e.block_hashes[0]) for _, batch in snapshot for e in batch.events}
        assert seen == {
            ("CPU", metas[1].block_hash),
            ("CPU", metas[2].block_hash),
            ("STORAGE", metas[0].block_hash),
        }


def test_restart_publishes_what_the_scan_found(tmp_path: Path, events_config: EventsConfig) -> None:
    config = tier_config(tmp_path, cpu_blocks=1, disk_blocks=64)
    metas, data = make_blocks(3)
    with linked_tier(config) as (_, link):
        spill_all(link, metas, data)

    async def scenario() -> None:
        async with new_store(config, events=events_config) as store:
            assert store.event_endpoints.replay_endpoint is not None and store.flush_events()
            events = all_events(store.event_endpoints.replay_endpoint)
            assert {(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)} == {
                ("STORAGE", m.block_hash) for m in metas[:2]
            }

    asyncio.run(scenario())


def test_metrics_names_and_values(tmp_path: Path, arena_books: str) -> None:
    with linked_tier(tier_config(tmp_path, cpu_blocks=2, disk_blocks=8)) as (client, link):
        metas, data = make_blocks(3)
        spill_all(link, metas, data)
        promote_all(link, metas[2:])
        registry = CollectorRegistry()
        registry.register(TierCollector(client.stats, "n0"))
        text = render(registry).decode()
        for line in (
            'kvstore_tier_usage_bytes{medium="CPU",node="n0"} 8192.0',
            'kvstore_tier_hits_total{medium="CPU",node="n0"} 1.0',
            'kvstore_offload_bytes_total{direction="spill",node="n0"} 12288.0',
            'kvstore_offload_bytes_total{direction="disk_write",node="n0"} 4096.0',
            'kvstore_offload_seconds_count{direction="spill",node="n0"} 2.0',  # a commit per arena-sized chunk: 2, 1
            'kvstore_offload_bytes_total{direction="promote",node="n0"} 4096.0',
            'kvstore_offload_seconds_count{direction="promote",node="n0"} 1.0',
            'kvstore_tier_evictions_total{medium="CPU",node="n0"} 1.0',
        ):
            assert line in text, line
        assert 'kvstore_tier_usage_bytes{medium="STORAGE",node="n0"}' in text


def test_callers_mistakes_raise_typed_errors(tmp_path: Path, arena_books: str) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=4)) as store:
            metas, _ = make_blocks(2)
            with pytest.raises(InvalidBlockError, match="3 tokens"):
                await store.reserve([BlockMeta(metas[0].block_hash, None, (1, 2, 3))])
            with pytest.raises(InvalidBlockError, match="64-bit"):
                await store.reserve([BlockMeta(-1, None, (1, 2, 3, 4))])  # type: ignore[arg-type]
            with pytest.raises(InvalidBlockError, match="expected BlockMeta, got tuple"):  # after a good block
                await store.reserve([metas[1], (metas[0].block_hash, None, (1, 2, 3, 4))])  # type: ignore[list-item]
            assert store.cpu.num_free_slots == 4 and store.cpu.lease_ids() == []  # nothing reserved
            with pytest.raises(InvalidBlockError, match="token id"):
                await store.acquire([BlockMeta(metas[0].block_hash, None, (1, 2, 3, -4))])
            grants = await store.reserve(metas[:1])
            grant = grants[0]
            assert grant is not None
            with pytest.raises(LeaseError, match="999 is unknown"):
                store.release([999])
            await store.commit([grant.lease_id])
            with pytest.raises(LeaseError, match="unknown or already released"):
                await store.commit([grant.lease_id])
            held = await store.acquire(metas[:1])
            with pytest.raises(LeaseError, match="read lease"):
                await store.commit([held[0].lease_id])
            with pytest.raises(LeaseError, match="twice"):
                store.release([held[0].lease_id, held[0].lease_id])
            store.release([held[0].lease_id])
            with pytest.raises(ValueError, match="start"):
                store.lookup(hashes(metas), start=-1)
            store.check_invariants()

    asyncio.run(scenario())


def test_acquire_checks_the_tokens_of_unmatched_blocks_before_any_lease(tmp_path: Path) -> None:
    """A promotion skips the token-range pass for blocks equal to stored ones (checked when stored); a bad
    block after a matched prefix still raises, and before the prefix is leased."""

    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=4)) as store:
            metas, _ = make_blocks(3)
            grants = await store.reserve(metas[:2])
            await store.commit([grant.lease_id for grant in grants if grant is not None])
            bad = BlockMeta(metas[2].block_hash, metas[2].parent_hash, (*metas[2].token_ids[:-1], -1))
            before = store.cpu.lru_hashes()
            with pytest.raises(InvalidBlockError, match="token id"):
                await store.acquire([*metas[:2], bad])
            assert store.cpu.num_leased_slots == 0 and store.cpu.lru_hashes() == before  # nothing changed
            held = await store.acquire(metas)  # the good third block is a miss, not an error
            assert len(held) == 2
            store.release([grant.lease_id for grant in held])
            store.check_invariants()

    asyncio.run(scenario())


def test_cpu_capacity_below_one_block_is_a_config_error(tmp_path: Path) -> None:
    config = tier_config(tmp_path, cpu_blocks=1)
    with pytest.raises(ConfigError, match="smaller than one block"):
        TierStore(msgspec.structs.replace(config, cpu_capacity_bytes=4095), IDENTITY, arena_name=arena_name())


def test_close_unlinks_the_arena(tmp_path: Path) -> None:
    async def scenario() -> str:
        store = new_store(tier_config(tmp_path, cpu_blocks=2))
        path = os.path.join(store.arena_info.shm_dir, store.arena_info.name)
        assert os.path.exists(path)
        await store.aclose()
        await store.aclose()
        return path

    assert not os.path.exists(asyncio.run(scenario()))


def test_calls_racing_or_after_close_find_the_tier_unavailable_not_a_lease_error(tmp_path: Path) -> None:
    """A commit queued behind the close (its leases dropped with the arena) says the tier is gone."""

    async def scenario() -> None:
        store = new_store(tier_config(tmp_path, cpu_blocks=4, disk_blocks=16))
        metas, _ = make_blocks(3)
        grants = await store.reserve(metas[:2], store.arena_info.incarnation)
        held = await store.reserve(metas[2:], store.arena_info.incarnation)
        ids = [grant.lease_id for grant in grants if grant is not None]
        assert len(ids) == 2
        closing = asyncio.ensure_future(store.aclose())
        await asyncio.sleep(0)  # the close has begun (it waits for the disk) when the commit runs
        with pytest.raises(TierUnavailableError, match="closed"):
            await store.commit(ids)
        await closing
        with pytest.raises(TierUnavailableError, match="closed"):
            store.release([grant.lease_id for grant in held if grant is not None])
        with pytest.raises(TierUnavailableError, match="closed"):
            store.lookup(hashes(metas))
        with pytest.raises(TierUnavailableError, match="closed"):
            await store.reserve(metas, store.arena_info.incarnation)
        with pytest.raises(TierUnavailableError, match="closed"):
            await store.acquire(metas, store.arena_info.incarnation)

    asyncio.run(scenario())


@pytest.mark.parametrize("token", [-1, -(1 << 63), 1 << 63, (1 << 64) - 1, 1 << 70])
def test_check_blocks_rejects_token_ids_outside_the_range_at_any_position(token: int) -> None:
    metas, _ = make_blocks(6)
    assert all(meta.token_ids for meta in metas)
    check_blocks(metas, IDENTITY.block_size)
    top = BlockMeta(metas[0].block_hash, None, (0, 1, 2, (1 << 63) - 1))  # the largest id is in range
    check_blocks([top], IDENTITY.block_size)
    for position in (0, 3, 5):
        meta = metas[position]
        bad = BlockMeta(meta.block_hash, meta.parent_hash, (*meta.token_ids[:-1], token))
        with pytest.raises(InvalidBlockError, match="token id"):
            check_blocks([*metas[:position], bad, *metas[position + 1 :]], IDENTITY.block_size)
        with pytest.raises(InvalidBlockError, match="token id"):
            check_tokens([bad], IDENTITY.block_size)


def test_an_acquire_cancelled_during_its_disk_read_leaves_no_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while it waits for a disk read (its caller gone), an acquire releases the CPU hits it had
    leased; the read, when it settles, leaves its block cached and unleased."""
    import threading
    import time

    import kvstore.tiers.disk as disk_module

    real_read_run = disk_module.read_run
    reading = threading.Event()

    def slow_read(*args: Any, **kwargs: Any) -> Any:
        reading.set()
        time.sleep(0.5)
        return real_read_run(*args, **kwargs)

    async def scenario() -> None:
        store = new_store(tier_config(tmp_path, cpu_blocks=4, disk_blocks=16))
        metas, _ = make_blocks(6)
        for meta in metas:  # the first two end up on disk only, the last four in CPU
            await store.commit([grant.lease_id for grant in await store.reserve([meta]) if grant is not None])
        monkeypatch.setattr(disk_module, "read_run", slow_read)
        task = asyncio.create_task(store.acquire([metas[5], metas[0]]))
        while not reading.is_set():
            await asyncio.sleep(0.01)
        assert store.cpu.num_leased_slots >= 1  # the CPU hit, and the slot the read fills
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while store.cpu.num_leased_slots and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert store.cpu.num_leased_slots == 0
        store.check_invariants()
        await store.aclose()

    asyncio.run(scenario())
