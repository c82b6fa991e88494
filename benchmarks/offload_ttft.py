"""TTFT of one prompt served by recompute vs from a GPU, CPU-tier and disk-tier hit.

One worker with its node's tiers in process (a real TierStore behind a
LocalTierClient, the same TierLink and connector a Ray worker uses). For a
prompt P of each length:

- recompute: P on a cold worker (the baseline);
- GPU hit: P again with a new last block (every earlier block in the pool);
- CPU hit: after two other prompts of the same length evicted P from the
  pool (it holds one prompt), P's blocks are spilled to the CPU arena and
  promoted back;
- disk hit: the same with an arena of two slots, so P's blocks went on to
  disk before coming back.

Each run checks its hit came from the medium it claims; a prompt is one
output token, so TTFT is the prefill (and the promotion). The model is the
one ``kvstore bench ttft`` measures (4 layers, hidden 512, fp32, CPU), or
what ``model`` names: config overrides such as ``worker.shape=qwen2.5-0.5b``
(a real architecture with random weights) or ``worker.model=PATH`` (a
Hugging Face checkpoint), so the table can be measured on a real
architecture with its own block bytes.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from kvstore.benchmarks.ttft_bench import BENCH_MODEL
from kvstore.deploy.config import Config, load_config
from kvstore.events import Medium
from kvstore.hashing import BlockHasher, to_external
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.link import TierLink
from kvstore.worker_api import GenerateRequest, GenerateResult
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker

BLOCK = 16


class TTFTRow(NamedTuple):
    prompt_tokens: int
    recompute_ms: float
    gpu_hit_ms: float
    cpu_hit_ms: float
    disk_hit_ms: float


def _config(length: int, *, cpu_slots: int, disk_dir: Path | None, model: Sequence[str] = ()) -> Config:
    """The benchmark model (``BENCH_MODEL``, then ``model``), a pool that holds one prompt, a tier."""
    blocks = -(-length // BLOCK) + 2
    block_bytes = cache_identity(load_config(overrides=[*BENCH_MODEL, *model, f"cache.block_size={BLOCK}"])).block_bytes
    overrides = [
        *BENCH_MODEL,
        *model,
        f"cache.block_size={BLOCK}",
        f"pool.num_blocks={blocks + 8}",
        "pool.watermark=0.0",
        "events.enabled=false",
        "worker.device=cpu",
        f"worker.max_context={length + 64}",
        "worker.max_num_batched_tokens=4096",
        f"tiers.cpu_capacity_bytes={cpu_slots * block_bytes}",
        "tiers.cpu_prefault=false",
    ]
    if disk_dir is not None:
        overrides.append(f"tiers.disk_dir={disk_dir}")
    return load_config(overrides=overrides)


def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the tier did not settle in time")
        time.sleep(0.01)


def _tiered_hit(
    length: int, cpu_slots: int, medium: Medium, rng: random.Random, model: Sequence[str] = ()
) -> tuple[float, float, float]:
    """(recompute, GPU hit, tier hit) TTFT in ms for one fresh worker whose tier serves ``medium``."""
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as tmp:
        # The CPU case has no disk: its arena holds every block spilled, so nothing is written back.
        disk_dir = Path(tmp) if medium == Medium.STORAGE else None
        config = _config(length, cpu_slots=cpu_slots, disk_dir=disk_dir, model=model)
        client = LocalTierClient(config.tiers, cache_identity(config))
        offload = TierOffload(TierLink(client, cache_identity(config)))
        worker = KVWorker("bench", config, offload=offload)
        try:
            prompt = [rng.randrange(256) for _ in range(length)]
            others = [[rng.randrange(256) for _ in range(length)] for _ in range(2)]

            def run(tokens: list[int]) -> GenerateResult:
                return worker.generate(GenerateRequest(tokens, 1))

            recompute = run(prompt)
            gpu = run([*prompt[:-BLOCK], *(t ^ 1 for t in prompt[-BLOCK:])])
            assert gpu.cached_tokens_by_medium[Medium.GPU] >= length - 2 * BLOCK, gpu.cached_tokens_by_medium
            for other in others:  # evict (spill) every block of the prompt: the pool holds one prompt
                run(other)
            hashes = [to_external(h) for h in BlockHasher.from_config(config.cache).hash_blocks(prompt)]
            want = len(hashes) - 1 if medium == Medium.CPU else len(hashes) - 1 - cpu_slots

            def settled() -> bool:
                hit = client.lookup(hashes[: len(hashes) - 1])
                return hit.num_blocks >= len(hashes) - 1 and list(hit.media).count(medium) >= want

            _wait(settled)
            tier = run([*prompt[:-BLOCK], *(t ^ 2 for t in prompt[-BLOCK:])])
            assert tier.cached_tokens_by_medium[medium] > 0, tier.cached_tokens_by_medium
            assert tier.cached_tokens_by_medium[Medium.GPU] == 0, tier.cached_tokens_by_medium
            return recompute.ttft_s * 1e3, gpu.ttft_s * 1e3, tier.ttft_s * 1e3
        finally:
            worker.shutdown()
            offload.close()
            client.close()


def measure_ttft(lengths: list[int], *, seed: int = 0, model: Sequence[str] = ()) -> list[TTFTRow]:
    """One row per prompt length (see the module docstring); ``model``: config overrides naming the model."""
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        arena = 4 * (-(-length // BLOCK) + 1) + 8  # the prompt, its variant and the two evicting prompts
        recompute, gpu, cpu = _tiered_hit(length, cpu_slots=arena, medium=Medium.CPU, rng=rng, model=model)
        _, _, disk = _tiered_hit(length, cpu_slots=2, medium=Medium.STORAGE, rng=rng, model=model)
        rows.append(TTFTRow(length, recompute, gpu, cpu, disk))
    return rows
