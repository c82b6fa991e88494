"""TierStore scenarios on real shared memory and real files: spill, write-back to disk, promote, events, faults."""

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
    make_blocks,
    new_store,
    request_events,
    tier_config,
)

import kvstore.tiers.copy_engine as copy_module
import kvstore.tiers.disk_capacity as capacity_module
import kvstore.tiers.disk_files as files_module
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import BlockRemoved, BlockStored
from kvstore.metrics import render
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.copy_engine import CopyEngine
from kvstore.tiers.errors import ArenaMovedError, InvalidBlockError, LeaseError
from kvstore.tiers.metrics import TierCollector
from kvstore.tiers.shared_memory import SharedSlots
from kvstore.tiers.store import TierStore


def test_spill_to_cpu_evict_to_disk_and_read_back_byte_identical(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=4, disk_blocks=64)) as store:
            metas, data = make_blocks(12)
            assert await store.put(metas, data) == 12
            store.check_invariants()
            # The arena holds the last 4; the 8 before them were written back to disk on eviction.
            assert store.lookup(hashes(metas)) == (12, ("STORAGE",) * 8 + ("CPU",) * 4)
            assert store.cpu.lru_hashes() == hashes(metas[8:])
            # (in the order the concurrent writes finished)
            assert store.disk is not None and set(store.disk.lru_hashes()) == set(hashes(metas[:8]))
            got = await store.get(metas)
            assert got.num_blocks == 12 and torch.equal(got.data, data)  # every byte, every block
            assert got.media[:4] == ("STORAGE",) * 4
            stats = store.stats()
            assert stats.offload_bytes["spill"] == 12 * 4096 and stats.offload_bytes["disk_read"] >= 8 * 4096
            assert stats.usage_bytes["CPU"] == 4 * 4096 and stats.blocks["STORAGE"] >= 8
            store.check_invariants()

    asyncio.run(scenario())


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
        async with new_store(tier_config(tmp_path, cpu_blocks=8, disk_blocks=0)) as store:
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


def test_put_and_get_at_scattered_pool_rows_in_pipelined_chunks(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=6, disk_blocks=64)) as store:
            metas, data = make_blocks(10)
            pool = torch.zeros((20, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
            evicted = [17, 3, 11, 0, 19, 8, 5, 14, 2, 9]
            pool[evicted] = data
            assert await store.put(metas, pool, evicted) == 10  # chunks of 3, two in flight
            target = torch.zeros_like(pool)
            free = [1, 4, 6, 7, 10, 12, 13, 15, 16, 18]
            got = await store.get(metas, target, free)
            assert got.num_blocks == 10 and got.data is target
            assert torch.equal(target[free], data)
            assert not target[evicted].any()  # nothing else was written
            with pytest.raises(InvalidBlockError, match="row 20"):
                await store.put(metas[:1], pool, [20])
            with pytest.raises(InvalidBlockError, match="2 blocks but 1 rows"):
                await store.get(metas[:2], target, [0])
            with pytest.raises(InvalidBlockError, match="out tensor"):
                await store.get(metas[:1], None, [0])
            store.check_invariants()
            assert store.cpu.num_leased_slots == 0

    asyncio.run(scenario())


def test_a_failed_copy_releases_every_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("copy failed")

    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=8)) as store:
            metas, data = make_blocks(8)
            await store.put(metas[:4], data[:4])
            monkeypatch.setattr(copy_module, "_copy_runs", broken)
            with pytest.raises(RuntimeError, match="copy failed"):
                await store.put(metas[4:], data[4:])
            with pytest.raises(RuntimeError, match="copy failed"):
                await store.get(metas[:4])
            assert store.cpu.num_leased_slots == 0 and store.lookup(hashes(metas)).num_blocks == 4
            store.check_invariants()

    asyncio.run(scenario())


def test_leased_slots_are_not_reused_mid_copy(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=4, disk_blocks=64)) as store:
            metas, data = make_blocks(4)
            await store.put(metas, data)
            held = await store.acquire(metas[:2])  # a worker is copying these two out
            before = {g.slot: bytes(store.cpu.view(g.slot)) for g in held}
            more, more_data = make_blocks(6, first_token=1000, seed=1)
            stored = await store.put(more, more_data)  # pressure: only the 2 unleased slots can turn over
            assert stored == 6 and all(g.block_hash in store.cpu for g in held)
            assert {g.slot: bytes(store.cpu.view(g.slot)) for g in held} == before
            store.release([g.lease_id for g in held])
            store.check_invariants()

    asyncio.run(scenario())


def test_all_slots_leased_is_back_pressure_not_an_error(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=2)) as store:
            metas, data = make_blocks(2)
            await store.put(metas, data)
            held = await store.acquire(metas)
            more, _ = make_blocks(1, first_token=500)
            assert await store.reserve(more) == [None]
            assert store.stats().not_stored["CPU"] == {"no_free_slot": 1}
            store.release([g.lease_id for g in held])

    asyncio.run(scenario())


def test_admission_after_the_second_spill(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=4, admit_after_spills=2)) as store:
            metas, data = make_blocks(3)
            assert await store.put(metas, data) == 0
            assert store.stats().not_stored["CPU"] == {"not_admitted": 3}
            assert await store.put(metas[:2], data[:2]) == 2
            assert store.lookup(hashes(metas)) == (2, ("CPU", "CPU"))
            assert await store.put(metas[:2], data[:2]) == 0 and store.stats().duplicates == 2

    asyncio.run(scenario())


def test_write_through_puts_every_block_on_disk_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=8, disk_blocks=8, write_through=True)) as store:
            metas, data = make_blocks(3)
            await store.put(metas, data)
            assert store.disk is not None and set(store.disk.lru_hashes()) == set(hashes(metas))
            assert store.cpu.lru_hashes() == hashes(metas)
            store.check_invariants()

    asyncio.run(scenario())


def test_corrupt_disk_block_ends_the_hit_and_is_never_served(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)) as store:
            metas, data = make_blocks(6)
            await store.put(metas, data)  # 0..3 on disk, 4..5 in CPU
            assert store.disk is not None
            path = store.disk.path_of(metas[2].block_hash)
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(raw)
            got = await store.get(metas)
            assert got.num_blocks == 2 and torch.equal(got.data, data[:2])  # stops before the corrupt block
            stats = store.stats()
            assert stats.integrity_failures == {"bad_checksum": 1} and not path.exists()
            assert store.lookup(hashes(metas)).num_blocks == 2  # (in CPU or on disk, as promotion left them)
            store.check_invariants()

    asyncio.run(scenario())


def test_full_disk_degrades_spill_without_raising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)) as store:
            monkeypatch.setattr(files_module, "write_all", disk_full)
            monkeypatch.setattr(capacity_module, "fs_room", lambda directory: 0)  # statvfs agrees: no room
            metas, data = make_blocks(5)
            assert await store.put(metas, data) == 5  # every block reached the CPU tier
            assert store.lookup(hashes(metas)) == (0, ())  # the evicted ones could not be kept
            assert store.lookup(hashes(metas), start=3) == (2, ("CPU", "CPU"))
            stats = store.stats()
            # The first write-back hits ENOSPC; the tier then limits itself to what it holds (nothing), so
            # the next two are turned away before any I/O.
            assert stats.not_stored["STORAGE"] == {"disk_full": 1, "capacity": 2}
            assert stats.blocks["STORAGE"] == 0 and stats.capacity_bytes["STORAGE"] == 0
            store.check_invariants()
            monkeypatch.undo()  # room again: the next write-backs take the configured capacity back
            more, more_data = make_blocks(2, first_token=100)
            assert await store.put(more, more_data) == 2
            stats = store.stats()
            assert stats.blocks["STORAGE"] == 2 and stats.capacity_bytes["STORAGE"] == store.config.disk_capacity_bytes
            store.check_invariants()

    asyncio.run(scenario())


def test_restarted_store_serves_what_it_had_on_disk(tmp_path: Path) -> None:
    metas, data = make_blocks(6)
    config = tier_config(tmp_path, cpu_blocks=2, disk_blocks=64)

    async def first() -> None:
        async with new_store(config) as store:
            await store.put(metas, data)  # 0..3 written back, 4..5 only in CPU

    async def second() -> None:
        async with new_store(config) as store:
            assert store.lookup(hashes(metas)) == (4, ("STORAGE",) * 4)
            got = await store.get(metas)
            assert got.num_blocks == 4 and torch.equal(got.data, data[:4])

    asyncio.run(first())
    asyncio.run(second())


def test_events_cover_both_media_with_tokens_and_parents(tmp_path: Path, events_config: EventsConfig) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=2, disk_blocks=64), events=events_config) as store:
            endpoints = store.event_endpoints
            assert endpoints.endpoint is not None and endpoints.replay_endpoint is not None
            metas, data = make_blocks(3)
            await store.put(metas, data)
            assert store.flush_events()
            events = all_events(endpoints.replay_endpoint)
            stored = [e for e in events if isinstance(e, BlockStored)]
            removed = [e for e in events if isinstance(e, BlockRemoved)]
            # A 2-slot arena spills one block per chunk, two in flight: making room for block 2 writes
            # block 0 back to disk while block 1 is still being copied in.
            assert [(e.medium, e.block_hashes[0]) for e in stored] == [
                ("CPU", metas[0].block_hash),
                ("STORAGE", metas[0].block_hash),
                ("CPU", metas[1].block_hash),
                ("CPU", metas[2].block_hash),
            ]
            assert [(e.medium, e.block_hashes) for e in removed] == [("CPU", [metas[0].block_hash])]
            first_on_disk = stored[1]
            assert first_on_disk.token_ids == list(metas[0].token_ids) and first_on_disk.parent_block_hash is None
            assert stored[3].parent_block_hash == metas[1].block_hash and stored[3].block_size == 4
            snapshot = request_events(endpoints.replay_endpoint, b"snapshot")
            seen = {(e.medium, e.block_hashes[0]) for _, batch in snapshot for e in batch.events}
            assert seen == {
                ("CPU", metas[1].block_hash),
                ("CPU", metas[2].block_hash),
                ("STORAGE", metas[0].block_hash),
            }

    asyncio.run(scenario())


def test_restart_publishes_what_the_scan_found(tmp_path: Path, events_config: EventsConfig) -> None:
    config = tier_config(tmp_path, cpu_blocks=1, disk_blocks=64)
    metas, data = make_blocks(3)

    async def scenario() -> None:
        async with new_store(config) as store:
            await store.put(metas, data)
        async with new_store(config, events=events_config) as store:
            assert store.event_endpoints.replay_endpoint is not None and store.flush_events()
            events = all_events(store.event_endpoints.replay_endpoint)
            assert {(e.medium, e.block_hashes[0]) for e in events if isinstance(e, BlockStored)} == {
                ("STORAGE", m.block_hash) for m in metas[:2]
            }

    asyncio.run(scenario())


def test_metrics_names_and_values(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=2, disk_blocks=8)) as store:
            metas, data = make_blocks(3)
            await store.put(metas, data)
            await store.get(metas[2:])
            registry = CollectorRegistry()
            registry.register(TierCollector(store.stats))
            text = render(registry).decode()
            for line in (
                'kvstore_tier_usage_bytes{medium="CPU"} 8192.0',
                'kvstore_tier_hits_total{medium="CPU"} 1.0',
                'kvstore_offload_bytes_total{direction="spill"} 12288.0',
                'kvstore_offload_bytes_total{direction="disk_write"} 4096.0',
                'kvstore_offload_seconds_count{direction="spill"} 3.0',  # one commit per 1-block chunk
                'kvstore_tier_evictions_total{medium="CPU"} 1.0',
            ):
                assert line in text, line
            assert 'kvstore_tier_usage_bytes{medium="STORAGE"}' in text

    asyncio.run(scenario())


def test_callers_mistakes_raise_typed_errors(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with new_store(tier_config(tmp_path, cpu_blocks=4)) as store:
            metas, data = make_blocks(2)
            with pytest.raises(InvalidBlockError, match="2 blocks but the tensor has 1 rows"):
                await store.put(metas, data[:1])
            with pytest.raises(InvalidBlockError, match="bytes"):
                await store.put(metas, torch.zeros((2, 10)))
            with pytest.raises(InvalidBlockError, match="3 tokens"):
                await store.reserve([BlockMeta(metas[0].block_hash, None, (1, 2, 3))])
            with pytest.raises(InvalidBlockError, match="64-bit"):
                await store.reserve([BlockMeta(-1, None, (1, 2, 3, 4))])  # type: ignore[arg-type]
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
