"""Paged attention against dense attention, and the model's determinism under chunking and batching."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvstore.kv_layout import KVLayout
from kvstore.workers.attention import SequenceSlice, build_metadata, paged_attention
from kvstore.workers.config import WorkerConfig
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.model import DecoderModel
from kvstore.workers.model_runner import ModelRunner
from kvstore.workers.model_source import describe_model, load_model

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal GQA attention over one whole sequence: q [n, H, d], k/v [n, h, d]."""
    groups = HEADS // KV_HEADS
    keys = k.repeat_interleave(groups, 1).transpose(0, 1)
    values = v.repeat_interleave(groups, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True).transpose(0, 1)


def test_paged_attention_equals_dense_attention_across_chunks_and_scattered_blocks() -> None:
    torch.manual_seed(0)
    lengths = [13, 1, 9]  # a sequence split in steps: 13 tokens (prefill), then 1 (decode), then 9 (a chunk)
    total = sum(lengths)
    q, k, v = torch.randn(total, HEADS, DIM), torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    pool = KVTensorPool(
        KVLayout(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK, dtype="float32"), 16
    )
    table = [11, 3, 14, 0, 7, 9]  # deliberately out of order
    out = torch.empty(total, HEADS, DIM)
    start = 0
    for n in lengths:
        part = SequenceSlice(list(range(n)), start, table)
        meta = build_metadata([part], BLOCK, torch.device("cpu"))
        rows = slice(start, start + n)
        out[rows] = paged_attention(q[rows], k[rows], v[rows], pool.layer(0), meta)
        start += n
    torch.testing.assert_close(out, dense_causal(q, k, v))


def test_batched_decode_equals_each_sequence_alone() -> None:
    torch.manual_seed(1)
    pool = KVTensorPool(
        KVLayout(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK, dtype="float32"), 32
    )
    lengths = [5, 12, 1, 8]
    tables = [[0, 1], [2, 3, 4, 5], [6], [7, 8, 9]]
    # Fill each sequence's context, then decode one token for all of them in one batch.
    for n, table in zip(lengths, tables, strict=True):
        ctx = SequenceSlice(list(range(n - 1)), 0, table) if n > 1 else None
        if ctx is not None:
            meta = build_metadata([ctx], BLOCK, torch.device("cpu"))
            paged_attention(torch.randn(n - 1, HEADS, DIM), torch.randn(n - 1, KV_HEADS, DIM),
                            torch.randn(n - 1, KV_HEADS, DIM), pool.layer(0), meta)  # fmt: skip
    slices = [SequenceSlice([0], n - 1, table) for n, table in zip(lengths, tables, strict=True)]
    q, k, v = torch.randn(4, HEADS, DIM), torch.randn(4, KV_HEADS, DIM), torch.randn(4, KV_HEADS, DIM)
    batched = paged_attention(q, k, v, pool.layer(0), build_metadata(slices, BLOCK, torch.device("cpu")))
    for i, part in enumerate(slices):
        alone = paged_attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], pool.layer(0),
                                build_metadata([part], BLOCK, torch.device("cpu")))  # fmt: skip
        torch.testing.assert_close(batched[i : i + 1], alone)


def test_metadata_rejects_short_block_tables_and_empty_slices() -> None:
    with pytest.raises(ValueError, match="need 3 blocks"):
        build_metadata([SequenceSlice([1, 2, 3], 6, [0, 1])], BLOCK, torch.device("cpu"))
    with pytest.raises(ValueError, match="no tokens"):
        build_metadata([SequenceSlice([], 0, [0])], BLOCK, torch.device("cpu"))


def toy(config: WorkerConfig) -> DecoderModel:
    return load_model(describe_model(config, torch.device("cpu")), torch.device("cpu"))


def test_weights_depend_only_on_seed_and_shape() -> None:
    config = WorkerConfig(device="cpu")
    a, b, c = toy(config), toy(config), toy(WorkerConfig(device="cpu", seed=1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


def greedy(runner: ModelRunner, prompt: list[int], chunks: list[int], table: list[int], steps: int) -> list[int]:
    """Prefill ``prompt`` in the given chunk sizes, then decode ``steps`` tokens, one sequence alone."""
    tokens, start, out = list(prompt), 0, []
    for n in chunks:
        token = int(runner.execute([SequenceSlice(tokens[start : start + n], start, table)])[0].argmax())
        start += n
    for _ in range(steps):
        out.append(token)
        tokens.append(token)
        token = int(runner.execute([SequenceSlice(tokens[start : start + 1], start, table)])[0].argmax())
        start += 1
    return out


def test_output_is_independent_of_prefill_chunking_and_block_placement() -> None:
    runner = ModelRunner(WorkerConfig(device="cpu"), num_blocks=64, block_size=16, device=torch.device("cpu"))
    prompt = [random.Random(3).randrange(512) for _ in range(100)]
    whole = greedy(runner, prompt, [100], list(range(8)), 12)
    assert greedy(runner, prompt, [37, 1, 62], [40, 9, 33, 20, 8, 61, 12, 50], 12) == whole
    assert greedy(runner, prompt, [16] * 6 + [4], list(range(56, 64)), 12) == whole
    assert len(set(whole)) > 1  # the toy model does not collapse to one token
