"""KVTensorPool: block-major layout, whole-block copies, sizing by memory budget."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvstore.kv_layout import KVLayout
from kvstore.workers.kv_tensor_pool import KVTensorPool

SMALL = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
MiB = 2**20


def test_bytes_per_block_matches_llama3_8b() -> None:
    llama = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
    assert llama.bytes_per_block == 2 * MiB
    assert llama.blocks_for_budget(10 * 1024 * MiB) == 5120


def test_memory_budget_sizes_the_pool() -> None:
    per_block = 2 * 4 * 2 * 8 * 4 * 3  # K and V x block_size x kv_heads x head_dim x fp32 bytes x layers
    assert SMALL.bytes_per_block == per_block
    pool = KVTensorPool.from_memory_budget(SMALL, 10 * per_block + per_block - 1)
    assert pool.num_blocks == 10
    assert pool.nbytes == 10 * per_block == pool.kv.numel() * pool.kv.element_size()
    with pytest.raises(ValueError, match="holds no block"):
        KVTensorPool.from_memory_budget(SMALL, per_block - 1)


def test_layout_is_block_major_and_each_block_is_one_contiguous_span() -> None:
    pool = KVTensorPool(SMALL, 5)
    assert pool.kv.shape == (5, 3, 2, 4, 2, 8)
    assert pool.kv.is_contiguous()
    base = pool.kv.data_ptr()
    for block_id in range(5):
        view = pool.block_view(block_id)
        assert view.is_contiguous()
        assert view.data_ptr() == base + block_id * SMALL.bytes_per_block
        assert view.numel() * view.element_size() == SMALL.bytes_per_block


def test_block_view_and_layer_view_alias_the_pool() -> None:
    pool = KVTensorPool(SMALL, 4)
    pool.block_view(2)[1, 0].fill_(7.0)  # layer 1, K of block 2
    assert torch.all(pool.layer(1)[2, 0] == 7.0)
    assert torch.all(pool.layer(1)[2, 1] == 0.0)
    assert int((pool.kv == 7.0).sum()) == 4 * 2 * 8


def test_read_write_round_trip_in_any_block_order() -> None:
    pool = KVTensorPool(SMALL, 8)
    data = torch.randn(3, *SMALL.block_shape)
    pool.write_blocks([6, 1, 4], data)
    assert torch.equal(pool.read_blocks([6, 1, 4]), data)
    assert torch.equal(pool.read_blocks([4]), data[2:])
    assert torch.equal(pool.block_view(1), data[1])
    untouched = [0, 2, 3, 5, 7]
    assert torch.count_nonzero(pool.read_blocks(untouched)) == 0


def test_read_is_a_copy_and_out_buffers_are_filled() -> None:
    pool = KVTensorPool(SMALL, 4)
    pool.write_blocks([3], torch.ones(1, *SMALL.block_shape))
    copy = pool.read_blocks([3])
    pool.write_blocks([3], torch.zeros(1, *SMALL.block_shape))
    assert torch.all(copy == 1.0)
    out = torch.full((2, *SMALL.block_shape), -1.0)
    pool.write_blocks([0], torch.full((1, *SMALL.block_shape), 5.0))
    assert pool.read_blocks([0, 3], out=out) is out
    assert torch.all(out[0] == 5.0) and torch.all(out[1] == 0.0)
    with pytest.raises(ValueError, match="out must be"):
        pool.read_blocks([0], out=out)


def test_writes_convert_dtype_and_reject_bad_shapes_and_ids() -> None:
    half = KVTensorPool(msgspec.structs.replace(SMALL, dtype="float16"), 2)
    half.write_blocks([1], torch.full((1, *SMALL.block_shape), 0.5, dtype=torch.float64))
    assert half.block_view(1).dtype == torch.float16 and torch.all(half.block_view(1) == 0.5)
    with pytest.raises(ValueError, match="shape"):
        half.write_blocks([0, 1], torch.zeros(1, *SMALL.block_shape))
    with pytest.raises(IndexError, match="out of range"):
        half.read_blocks([2])
    with pytest.raises(IndexError, match="out of range"):
        half.block_view(-1)


def test_close_releases_memory() -> None:
    pool = KVTensorPool(SMALL, 2)
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.read_blocks([0])
    assert "closed" in repr(pool)


@pytest.mark.gpu
def test_pool_on_cuda_round_trips_through_pinned_host_memory() -> None:
    pool = KVTensorPool(SMALL, 4, "cuda")
    data = torch.randn(2, *SMALL.block_shape)
    pool.write_blocks([3, 0], data)
    host = torch.empty(2, *SMALL.block_shape).pin_memory()
    pool.read_blocks([3, 0], out=host)
    assert torch.equal(host, data)
