"""Greedy continuations of Hugging Face checkpoints equal ``model.generate(do_sample=False)``, cached or not.

One worker per case, wired to an in-process tier (LocalTierClient: a real
store, CPU arena and disk) with a pool small enough to evict: a prompt is
computed cold, hit in the GPU pool, evicted (spilled) and promoted back
from the CPU arena -- or, with an arena of a few slots, from disk -- and
every continuation equals transformers' token for token.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.deploy.config import Config, config_from_dict
from kvstore.errors import InvalidRequestError
from kvstore.hashing import BlockHasher, to_external
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.link import TierLink
from kvstore.worker_api import FinishReason, GenerateRequest, SamplingParams
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker
from tests.checkpoints import TinyCheckpoint, reference_model

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)  # a checkpoint's own default (vLLM's) would sample
MAX_TOKENS = 10


Cases = list[tuple[list[int], list[int]]]
_CASES: dict[Path, Cases] = {}  # per checkpoint: the two tier cases share transformers' (slow) generate


def greedy_prompts(checkpoint: TinyCheckpoint, count: int, length: int, seed: int) -> Cases:
    """``count`` random prompts and transformers' greedy continuations, none of which reaches an eos id.

    Both stop at eos; prompts whose continuation reaches none compare all MAX_TOKENS tokens.
    """
    if checkpoint.path not in _CASES:
        _CASES[checkpoint.path] = _generate(checkpoint, count, length, seed)
    return _CASES[checkpoint.path]


def _generate(checkpoint: TinyCheckpoint, count: int, length: int, seed: int) -> Cases:
    reference = reference_model(checkpoint)
    rng = random.Random(seed)
    cases: Cases = []
    while len(cases) < count:
        prompt = [rng.randrange(300) for _ in range(length)]
        ids = torch.tensor([prompt])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        continuation = out[0, length:].tolist()
        if len(continuation) == MAX_TOKENS and not set(continuation) & set(checkpoint.eos_token_ids):
            cases.append((prompt, continuation))
    assert len({tuple(c) for _, c in cases}) == count  # distinct continuations: the model does not collapse
    return cases


def tiered_config(checkpoint: TinyCheckpoint, tmp_path: Path, *, cpu_slots: int) -> Config:
    def config(**tiers: Any) -> Config:
        return config_from_dict({
            "cache": {"block_size": BLOCK}, "pool": {"num_blocks": 24}, "events": {"enabled": False},
            "worker": {"device": "cpu", "model": str(checkpoint.path)}, "tiers": tiers,
        })  # fmt: skip

    block_bytes = cache_identity(config()).block_bytes
    return config(cpu_capacity_bytes=cpu_slots * block_bytes, disk_dir=str(tmp_path / "disk"))


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("fixture", ["llama_checkpoint", "llama3_checkpoint", "qwen2_checkpoint", "mistral_checkpoint"])
@pytest.mark.parametrize(("cpu_slots", "medium"), [(256, "CPU"), (3, "STORAGE")])
def test_greedy_output_equals_transformers_cold_hit_and_promoted(
    fixture: str, cpu_slots: int, medium: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    checkpoint: TinyCheckpoint = request.getfixturevalue(fixture)
    # 6 blocks each: the 24-block pool evicts the first prompt's blocks while computing the fifth, and the
    # sixth pushes them on through a 3-slot arena to disk.
    cases = greedy_prompts(checkpoint, 6, 5 * BLOCK + 3, seed=11)
    config = tiered_config(checkpoint, tmp_path, cpu_slots=cpu_slots)
    identity = cache_identity(config)
    client = LocalTierClient(config.tiers, identity, arena_name=f"kvstore-test-{uuid.uuid4().hex[:12]}")
    worker = KVWorker("hf", config, offload=TierOffload(TierLink(client, identity)))
    (first, expected), *others = cases
    hashes = [to_external(h) for h in BlockHasher.from_config(config.cache).hash_blocks(first)]
    try:
        cold = worker.generate(GenerateRequest(first, MAX_TOKENS, sampling=GREEDY))
        assert cold.output_token_ids == expected and cold.cached_tokens == 0
        hit = worker.generate(GenerateRequest(first, MAX_TOKENS, sampling=GREEDY))
        assert hit.output_token_ids == expected and hit.cached_tokens_by_medium["GPU"] == 5 * BLOCK
        for prompt, want in others:  # evict the first prompt's blocks (spilled to the tier)
            assert worker.generate(GenerateRequest(prompt, MAX_TOKENS, sampling=GREEDY)).output_token_ids == want
        assert wait_for(lambda: set(client.lookup(hashes).media) == {medium}), client.lookup(hashes)
        promoted = worker.generate(GenerateRequest(first, MAX_TOKENS, sampling=GREEDY))
        assert promoted.output_token_ids == expected
        assert promoted.cached_tokens_by_medium["GPU"] == 0 and promoted.cached_tokens_by_medium[medium] > 0
        worker.check_invariants()
    finally:
        worker.shutdown()
        client.close()


def test_the_worker_takes_its_limits_from_the_checkpoint(qwen2_checkpoint: TinyCheckpoint) -> None:
    config = config_from_dict({
        "cache": {"block_size": BLOCK}, "pool": {"num_blocks": 64}, "events": {"enabled": False},
        "worker": {"device": "cpu", "model": str(qwen2_checkpoint.path), "served_model_name": "tiny-qwen"},
    })  # fmt: skip
    worker = KVWorker("limits", config)
    try:
        assert worker.served.name == "tiny-qwen" and worker.served.eos_token_ids == qwen2_checkpoint.eos_token_ids
        info = worker.info()
        assert (info.vocab_size, info.max_context) == (320, 512)  # not the toy's 512 / 2048 defaults
        with pytest.raises(InvalidRequestError, match="out of the vocabulary range"):
            worker.generate(GenerateRequest([5, 320], 1))
        with pytest.raises(InvalidRequestError, match="512"):
            worker.generate(GenerateRequest([5] * 500, 13))
    finally:
        worker.shutdown()


def test_the_generation_configs_other_eos_ids_stop_with_their_id_as_vllm_reports_them(
    qwen2_checkpoint: TinyCheckpoint,
) -> None:
    """vLLM's rule: the tokenizer's EOS (Qwen's <|im_end|>) ends a choice with no stop reason; the generation
    config's other EOS ids (<|endoftext|>) are stop token ids, so ending on one reports it; ``ignore_eos``
    lifts both."""
    config = config_from_dict({
        "cache": {"block_size": BLOCK}, "pool": {"num_blocks": 64}, "events": {"enabled": False},
        "worker": {"device": "cpu", "model": str(qwen2_checkpoint.path)},
    })  # fmt: skip
    worker = KVWorker("eos", config)
    endoftext, im_end = qwen2_checkpoint.eos_token_ids
    assert worker.tokenizer.eos_token_ids == (im_end,)
    try:

        def forced(token: int, **sampling: object) -> tuple[object, object, int]:
            params = SamplingParams(temperature=0.0, logit_bias={token: 100.0}, **sampling)  # type: ignore[arg-type]
            result = worker.generate(GenerateRequest([5, 6, 7], 3, sampling=params))
            choice = result.choices[0]
            return choice.finish_reason, choice.stop_reason, len(choice.token_ids)

        assert forced(im_end) == (FinishReason.STOP, None, 1)
        assert forced(endoftext) == (FinishReason.STOP, endoftext, 1)
        assert forced(endoftext, ignore_eos=True) == (FinishReason.LENGTH, None, 3)
        assert forced(im_end, ignore_eos=True) == (FinishReason.LENGTH, None, 3)
    finally:
        worker.shutdown()
