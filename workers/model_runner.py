"""Runs one scheduler step on the model: tensors in, next-token logits out.

The runner owns the model and the KV tensor pool it reads and writes. It
knows nothing of requests or scheduling: it takes the step's slices
(:class:`kvstore.workers.attention.SequenceSlice`), writes their K/V into the pool
and returns, per slice, the logits after its last position. The caller
samples the slices that reached the end of their sequence and ignores the
rest (prefill chunks that did not).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.workers.attention import SequenceSlice, build_metadata
from kvstore.workers.config import WorkerConfig
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.model_source import describe_model, load_model
from kvstore.workers.model_spec import ServedModel


class ModelRunner:
    """One model plus its paged KV pool on one device. Not thread-safe: the worker's step loop drives it.

    ``served`` says what the model is (name, vocabulary, context limit, eos
    ids, KV layout and dtype: :class:`~kvstore.workers.model_spec.ServedModel`).
    Construction loads the weights (ConfigError for an unusable model).
    """

    def __init__(self, config: WorkerConfig, *, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.device = device
        self.block_size = block_size
        self.served: ServedModel = describe_model(config, device)
        self.model = load_model(self.served, device)
        self.kv_pool = KVTensorPool(self.served.kv_layout(block_size), num_blocks, device)

    @torch.inference_mode()
    def execute(self, slices: Sequence[SequenceSlice]) -> torch.Tensor:
        """Compute every slice's tokens (storing their KV); returns float32 ``[len(slices), vocab]`` logits,
        each slice's next-token distribution after its last position (on the CPU: the sampler's device)."""
        if not slices:
            return torch.empty((0, 0))
        meta = build_metadata(slices, self.block_size, self.device)
        flat = [token for part in slices for token in part.token_ids]
        token_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        return self.model(token_ids, meta, self.kv_pool).float().cpu()

    def close(self) -> None:
        """Release the KV memory (the model's weights go with the runner)."""
        self.kv_pool.close()
