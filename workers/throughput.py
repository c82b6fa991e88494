"""The worker model's prefill and decode speed on this machine, for models that need them.

``kvstore simulate`` takes its replicas' default prefill throughput and
decode rate from here, so its TTFTs are those of the model ``kvstore
serve`` would run, on this machine. One :class:`~kvstore.workers.worker.KVWorker`
(no Ray) runs a warm-up, then a prompt of ``prompt_tokens`` with one output
token (TTFT = prefill, nothing cached) and a short generation (decode rate =
tokens after the first / time after the first). Each is the best of
``repeats``: the least disturbed run of a shared machine.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import msgspec

from kvstore.worker_api import GenerateRequest
from kvstore.workers.config import WorkerSettings, replace_sections
from kvstore.workers.worker import KVWorker


class ModelRates(NamedTuple):
    prefill_tps: float  # prompt tokens per second, one uncached prompt at a time
    decode_tps: float  # output tokens per second of one request
    prompt_tokens: int  # the measured prompt's length
    device: str


def measure_model_rates(
    config: WorkerSettings, prompt_tokens: int = 1024, decode_tokens: int = 32, repeats: int = 2, seed: int = 0
) -> ModelRates:
    """Measure the configured worker model (module docstring); prompts shorter than its context."""
    model = config.worker
    prompt_tokens = max(16, min(prompt_tokens, model.max_context - decode_tokens - 1))
    blocks = 2 * (-(-(prompt_tokens + decode_tokens) // config.cache.block_size)) + 8
    sized = replace_sections(
        config,
        worker=msgspec.structs.replace(model, max_num_batched_tokens=max(model.max_num_batched_tokens, prompt_tokens)),
        pool=msgspec.structs.replace(config.pool, num_blocks=max(config.pool.num_blocks, blocks)),
    )
    rng = random.Random(seed)
    worker = KVWorker("rate-probe", sized)
    try:

        def prompt(length: int) -> list[int]:
            return [rng.randrange(model.vocab_size) for _ in range(length)]

        worker.generate(GenerateRequest(prompt(64), 2))  # warm-up: first-call allocations
        prefill_s = min(worker.generate(GenerateRequest(prompt(prompt_tokens), 1)).ttft_s for _ in range(repeats))
        decode_s = min(_decode_seconds(worker, prompt(64), decode_tokens) for _ in range(repeats))
    finally:
        worker.shutdown()
    return ModelRates(prompt_tokens / prefill_s, (decode_tokens - 1) / decode_s, prompt_tokens, str(worker.device))


def _decode_seconds(worker: KVWorker, prompt: list[int], tokens: int) -> float:
    result = worker.generate(GenerateRequest(prompt, tokens))
    return result.total_s - result.ttft_s
