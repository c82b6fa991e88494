"""Runs one scheduler step on the model: tensors in, next-token logits out.

The runner owns the model and the KV tensor pool it reads and writes. It
knows nothing of requests or scheduling: it takes the step's slices
(:class:`kvstore.workers.attention.SequenceSlice`), writes their K/V into the pool
and returns, per slice, the logits after its last position. The caller
samples the slices that reached the end of their sequence and ignores the
rest (prefill chunks that did not).

A slice may also ask for its rows' prompt logprobs (:class:`PromptRows`):
each of its first rows is scored against the prompt token that follows it
-- that token's log-probability under the model's raw distribution, its
rank, and the top alternatives, as vLLM's ``prompt_logprobs`` reports
them. Those rows' logits are made a bounded block of rows at a time
(:data:`SCORE_ROWS`), so a long prefill never holds ``[tokens, vocab]``
at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvstore.worker_api import TokenLogprob
from kvstore.workers.attention import SequenceSlice, build_metadata
from kvstore.workers.config import WorkerConfig
from kvstore.workers.kv_tensor_pool import KVTensorPool
from kvstore.workers.model_source import describe_model, load_model
from kvstore.workers.model_spec import ServedModel

SCORE_ROWS = 256  # prompt rows whose logits are made at once (each [vocab] float32)


class PromptRows(NamedTuple):
    """Score slice ``slice_index``'s first ``len(targets)`` rows: row ``r`` against ``targets[r]``, the prompt
    token after it, with the ``top`` most likely alternatives."""

    slice_index: int
    targets: Sequence[int]
    top: int


class StepOutput(NamedTuple):
    logits: torch.Tensor  # float32 [len(slices), vocab] on the CPU: each slice's next-token logits
    prompt_logprobs: list[list[TokenLogprob]]  # per PromptRows asked, one entry per target, in order


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
    def execute(self, slices: Sequence[SequenceSlice], prompt_rows: Sequence[PromptRows] = ()) -> StepOutput:
        """Compute every slice's tokens (storing their KV); returns each slice's next-token logits after its last
        position (on the CPU: the sampler's device), and the prompt logprobs ``prompt_rows`` ask for."""
        if not slices:
            return StepOutput(torch.empty((0, 0)), [])
        meta = build_metadata(slices, self.block_size, self.device)
        flat = [token for part in slices for token in part.token_ids]
        token_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        hidden = self.model.hidden(token_ids, meta, self.kv_pool)
        logits = self.model.logits(hidden[meta.sample_rows]).cpu()
        if not prompt_rows:
            return StepOutput(logits, [])
        starts = [0]
        for part in slices:
            starts.append(starts[-1] + len(part.token_ids))
        scored = []
        for ask in prompt_rows:
            if not 0 <= len(ask.targets) <= len(slices[ask.slice_index].token_ids):
                raise ValueError(f"{len(ask.targets)} prompt rows asked of a slice of "
                                 f"{len(slices[ask.slice_index].token_ids)}")  # fmt: skip
            first = starts[ask.slice_index]
            scored.append(self._score(hidden[first : first + len(ask.targets)], ask.targets, ask.top))
        return StepOutput(logits, scored)

    def _score(self, rows: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprob]:
        """Each row's log-probability of its target, the target's rank (1 + the tokens scored at least as high
        but itself, vLLM's count), and the ``top`` best alternatives."""
        out: list[TokenLogprob] = []
        for begin in range(0, len(targets), SCORE_ROWS):
            chunk = torch.log_softmax(self.model.logits(rows[begin : begin + SCORE_ROWS]), dim=-1)
            wanted = torch.tensor(targets[begin : begin + SCORE_ROWS], dtype=torch.long, device=chunk.device)
            picked = chunk.gather(1, wanted[:, None])
            ranks = (chunk >= picked).sum(dim=1).tolist()
            if top > 0:
                values, ids = torch.topk(chunk, min(top, chunk.shape[1]), dim=1)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
            else:
                tops = [[] for _ in ranks]
            for token, logprob, rank, alternatives in zip(
                wanted.tolist(), picked[:, 0].tolist(), ranks, tops, strict=True
            ):
                out.append(TokenLogprob(token, logprob, alternatives, rank))
        return out

    def close(self) -> None:
        """Release the KV memory (the model's weights go with the runner)."""
        self.kv_pool.close()
