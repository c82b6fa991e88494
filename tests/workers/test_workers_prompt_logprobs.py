"""Prompt logprobs (vLLM's ``prompt_logprobs``) equal transformers' scores of the prompt, cached or not.

A worker serving a tiny transformers-written checkpoint scores each prompt
token after the first: its log-probability under the model's raw
distribution, its rank and the top alternatives. The reference is
``log_softmax`` of transformers' logits over the same prompt. A request
that asks for them computes its whole prompt (no prefix hit: a cached
block has no logits), in chunks when the step budget is small, and the
blocks it fills serve later requests as any others.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvstore.deploy.config import config_from_dict
from kvstore.errors import InvalidRequestError
from kvstore.worker_api import GenerateRequest, GenerateResult, SamplingParams, TokenLogprob
from kvstore.workers.worker import KVWorker
from tests.checkpoints import TinyCheckpoint, reference_model

TOP = 3


@pytest.fixture
def worker(qwen2_checkpoint: TinyCheckpoint) -> Iterator[KVWorker]:
    config = config_from_dict(
        {
            "cache": {"block_size": 16},
            "pool": {"num_blocks": 64, "watermark": 0.0},
            "events": {"enabled": False},
            # a 24-token step budget: a 70-token prompt is scored in chunks that cross block edges
            "worker": {"device": "cpu", "model": str(qwen2_checkpoint.path), "max_num_batched_tokens": 24},
        }
    )
    made = KVWorker("scorer", config)
    yield made
    made.shutdown()


def reference_scores(checkpoint: TinyCheckpoint, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference_model(checkpoint)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_scores(got: list[TokenLogprob | None], scores: torch.Tensor, prompt: list[int]) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for position, entry in enumerate(got[1:], start=1):
        assert entry is not None, f"prompt token {position} was not scored"
        row = scores[position - 1]  # the logits after token p - 1 predict token p
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1  # 1 + the tokens scored above it
        want_ids = torch.topk(row, TOP).indices.tolist()
        assert [token for token, _ in entry.top] == want_ids
        assert [lp for _, lp in entry.top] == pytest.approx(row[want_ids].tolist(), abs=1e-4)


def ask(prompt: list[int], *, n: int = 1, score: int | None = TOP, max_tokens: int = 3) -> GenerateRequest:
    sampling = SamplingParams(temperature=0.0, n=n, prompt_logprobs=score)
    return GenerateRequest(prompt, max_tokens, sampling=sampling)


def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(
    worker: KVWorker, qwen2_checkpoint: TinyCheckpoint
) -> None:
    prompt = [random.Random(3).randrange(300) for _ in range(70)]
    scores = reference_scores(qwen2_checkpoint, prompt)

    first = worker.generate(ask(prompt))
    check_scores(first.choices[0].prompt_logprobs or [], scores, prompt)
    assert first.cached_tokens == 0
    assert first.choices[0].token_ids[0] == int(scores[-1].argmax())  # the last prompt row still samples

    again = worker.generate(ask(prompt))  # the prompt's blocks are cached now: scoring computes it all again
    assert again.cached_tokens == 0
    assert again.choices[0].prompt_logprobs == first.choices[0].prompt_logprobs
    assert again.choices[0].token_ids == first.choices[0].token_ids

    plain = worker.generate(ask(prompt, score=None))  # without scores the blocks the scorers filled are hit
    assert plain.cached_tokens == 64
    assert plain.choices[0].prompt_logprobs is None
    assert plain.choices[0].token_ids == first.choices[0].token_ids
    worker.check_invariants()


def test_every_choice_carries_the_prompt_scores_once(worker: KVWorker, qwen2_checkpoint: TinyCheckpoint) -> None:
    prompt = [random.Random(4).randrange(300) for _ in range(41)]
    scores = reference_scores(qwen2_checkpoint, prompt)
    stream = worker.submit(ask(prompt, n=3, max_tokens=4))
    chunks = list(stream)
    carried = [(d.index, d.prompt_logprobs) for c in chunks for d in c.deltas if d.prompt_logprobs is not None]
    assert sorted(index for index, _ in carried) == [0, 1, 2]  # each choice's first token carries them, once
    for _, entries in carried:
        check_scores(entries, scores, prompt)
    worker.check_invariants()


def test_zero_alternatives_and_a_one_token_prompt(worker: KVWorker, qwen2_checkpoint: TinyCheckpoint) -> None:
    prompt = [random.Random(5).randrange(300) for _ in range(20)]
    result: GenerateResult = worker.generate(ask(prompt, score=0))
    entries = result.choices[0].prompt_logprobs or []
    assert len(entries) == 20 and entries[0] is None
    assert all(e is not None and e.top == [] and e.rank is not None and e.rank >= 1 for e in entries[1:])
    one = worker.generate(ask(prompt[:1]))
    assert one.choices[0].prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21, 2.5])
def test_out_of_range_prompt_logprobs_are_refused(worker: KVWorker, value: object) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        worker.submit(ask([1, 2, 3], score=value))  # type: ignore[arg-type]


def test_scoring_requests_are_not_counted_as_prefix_cache_queries(worker: KVWorker) -> None:
    """They look nothing up (vLLM counts neither their queries nor hits): the hit rate stays that of the rest."""
    prompt = [random.Random(6).randrange(300) for _ in range(50)]
    worker.generate(ask(prompt, score=None))
    before = worker._manager.prefix_cache_stats
    for _ in range(3):
        worker.generate(ask(prompt, score=0))
    assert worker._manager.prefix_cache_stats == before
    worker.generate(ask(prompt, score=None))
    after = worker._manager.prefix_cache_stats
    assert (after.queries - before.queries, after.hits - before.hits) == (50, 48)
