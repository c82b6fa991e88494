"""CopyEngine: run coalescing, thread splitting, correctness of batched spills and promotions, CUDA path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tiers_helpers import IDENTITY, arena_name

from kvstore.tiers.copy_engine import CopyEngine, Run, block_rows, coalesce, split_runs
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.shared_memory import SharedSlots


@pytest.fixture
def slots() -> Iterator[SharedSlots]:
    arena = SharedSlots.create(arena_name(), 64, IDENTITY.block_bytes, prefault=False)
    yield arena
    arena.close()


def test_coalesce_and_split() -> None:
    assert coalesce([3, 4, 5, 9, 1, 2], [0, 1, 2, 3, 7, 8]) == [Run(3, 0, 3), Run(9, 3, 1), Run(1, 7, 2)]
    runs = [Run(0, 10, 5), Run(20, 0, 1)]
    assert split_runs(runs, 2) == [[Run(0, 10, 3)], [Run(3, 13, 2), Run(20, 0, 1)]]
    assert split_runs(runs, 1) == [runs]
    assert split_runs([Run(0, 0, 1)], 4) == [[Run(0, 0, 1)]]


def test_block_rows_views_without_copying() -> None:
    pool = torch.zeros((3, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
    rows = block_rows(pool, IDENTITY.block_bytes)
    assert rows.shape == (3, 4096) and rows.data_ptr() == pool.data_ptr()
    with pytest.raises(InvalidBlockError, match="4096"):
        block_rows(torch.zeros((3, 100)), IDENTITY.block_bytes)
    with pytest.raises(InvalidBlockError, match="contiguous"):
        block_rows(pool.transpose(1, 2), IDENTITY.block_bytes)
    with pytest.raises(InvalidBlockError, match="with blocks"):
        block_rows(torch.zeros((0, 2048), dtype=torch.float16), IDENTITY.block_bytes)


def test_spill_and_promote_scattered_batches(slots: SharedSlots) -> None:
    engine = CopyEngine(slots.tensor, num_threads=3, pin=False)
    try:
        pool = torch.randn((400, *IDENTITY.layout.block_shape)).to(IDENTITY.torch_dtype)  # > 1 MiB: split over threads
        generator = torch.Generator().manual_seed(1)
        blocks = torch.randperm(400, generator=generator)[:64].tolist()
        arena_slots = torch.randperm(64, generator=generator).tolist()
        engine.spill(pool, blocks, arena_slots).result(timeout=10)
        for block, slot in zip(blocks, arena_slots, strict=True):
            assert bytes(slots.view(slot)) == pool[block].view(-1).view(torch.uint8).numpy().tobytes()
        target = torch.zeros_like(pool)
        engine.promote(arena_slots, target, list(range(64))).result(timeout=10)
        assert torch.equal(target[:64], pool[blocks])
        assert not target[64:].any()
    finally:
        engine.close()


@pytest.mark.parametrize("pool_blocks", [100, 400])  # 400 blocks > 1 MiB: the threads' path; 100: copied inline
def test_runs_of_neighbours_and_a_new_pool_each_call(slots: SharedSlots, pool_blocks: int) -> None:
    """Runs (rows and slots advancing together) mixed with scattered pairs, through both paths; a second
    pool tensor -- of the same shape, then another one reshaped -- is copied from its own rows."""
    engine = CopyEngine(slots.tensor, num_threads=2, pin=False)
    try:
        generator = torch.Generator().manual_seed(2)
        blocks = [5, 6, 7, 40, 2, 3, 90, 91, 92, 93, 11]
        arena_slots = [10, 11, 12, 0, 30, 31, 50, 51, 52, 53, 63]
        for round_ in range(3):
            pool = torch.randn((pool_blocks, *IDENTITY.layout.block_shape), generator=generator)
            pool = pool.to(IDENTITY.torch_dtype)
            if round_ == 2:  # the same bytes per block, viewed with another shape
                pool = pool.view(pool_blocks, -1)
            order = [row for row in torch.randperm(pool_blocks, generator=generator).tolist() if row not in blocks][:16]
            engine.spill(pool, blocks + order, arena_slots + list(range(13, 29))).result(timeout=10)
            target = torch.zeros_like(pool)
            engine.promote(arena_slots + list(range(13, 29)), target, blocks + order).result(timeout=10)
            rows = blocks + order
            assert torch.equal(target[rows], pool[rows])
            untouched = [row for row in range(pool_blocks) if row not in set(rows)]
            assert not target[untouched].any()
    finally:
        engine.close()


def test_bad_batches_raise_before_copying(slots: SharedSlots) -> None:
    engine = CopyEngine(slots.tensor, num_threads=1, pin=False)
    pool = torch.zeros((4, *IDENTITY.layout.block_shape), dtype=IDENTITY.torch_dtype)
    try:
        with pytest.raises(InvalidBlockError, match="destination row 64"):
            engine.spill(pool, [0], [64])
        with pytest.raises(InvalidBlockError, match="source row 4"):
            engine.spill(pool, [4], [0])
        with pytest.raises(InvalidBlockError, match="2 source rows but 1"):
            engine.promote([0, 1], pool, [0])
        assert engine.spill(pool, [], []).result(timeout=1) is None
    finally:
        engine.close()


@pytest.mark.gpu
def test_cuda_spill_and_promote_through_pinned_arena(slots: SharedSlots) -> None:
    engine = CopyEngine(slots.tensor, num_threads=1, pin=True)
    try:
        assert engine.pinned and slots.tensor.is_pinned()
        pool = torch.randn((32, *IDENTITY.layout.block_shape), device="cuda").to(IDENTITY.torch_dtype)
        engine.spill(pool, [5, 6, 7, 30], [0, 1, 2, 3]).result(timeout=10)
        back = torch.zeros_like(pool)
        engine.promote([3, 0], back, [0, 1]).result(timeout=10)
        assert torch.equal(back[0], pool[30]) and torch.equal(back[1], pool[5])
    finally:
        engine.close()
