"""Sampling on a real worker: vLLM's parameters, each checked against greedy output or an exact property."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from workers_testlib import Reference, WorkerFactory, make_config, random_tokens

from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.worker_api import FinishReason, GenerateRequest, SamplingParams
from kvstore.workers.sampler import GREEDY, ChoiceSampling
from kvstore.workers.scheduler import RequestState
from kvstore.workers.worker import KVWorker

PROMPT = random_tokens(random.Random(7), 40)


def run(worker: KVWorker, max_tokens: int = 16, prompt: list[int] = PROMPT, **sampling: object) -> object:
    return worker.generate(GenerateRequest(prompt, max_tokens, sampling=SamplingParams(**sampling)))  # type: ignore[arg-type]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(make_worker: WorkerFactory) -> None:
    worker = make_worker()
    first = run(worker, temperature=1.0, seed=11).output_token_ids  # type: ignore[attr-defined]
    crowd = [
        worker.submit(
            GenerateRequest(random_tokens(random.Random(i), 30), 20, sampling=SamplingParams(temperature=1.0))
        )
        for i in range(4)
    ]
    again = worker.submit(GenerateRequest(PROMPT, 16, sampling=SamplingParams(temperature=1.0, seed=11)))
    assert again.result(timeout=60).output_token_ids == first
    for stream in crowd:
        stream.result(timeout=60)
    other = make_worker("w1")  # another replica of the same model
    assert run(other, temperature=1.0, seed=11).output_token_ids == first  # type: ignore[attr-defined]
    assert run(worker, temperature=1.0, seed=12).output_token_ids != first  # type: ignore[attr-defined]


def test_truncation_to_one_token_is_greedy(make_worker: WorkerFactory, reference: Reference) -> None:
    worker = make_worker()
    greedy = reference(GenerateRequest(PROMPT, 16))
    assert run(worker, temperature=1.0, top_k=1, seed=1).output_token_ids == greedy  # type: ignore[attr-defined]
    assert run(worker, temperature=1.0, top_p=1e-9, seed=2).output_token_ids == greedy  # type: ignore[attr-defined]
    assert run(worker, temperature=1.0, min_p=1.0, seed=3).output_token_ids == greedy  # type: ignore[attr-defined]


def test_logit_bias_and_penalties_change_the_greedy_choice(make_worker: WorkerFactory, reference: Reference) -> None:
    worker = make_worker()
    greedy = reference(GenerateRequest(PROMPT, 16))
    assert run(worker, logit_bias={300: 100.0}).output_token_ids == [300] * 16  # type: ignore[attr-defined]
    assert greedy != [300] * 16
    fox = list(b"The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again.")
    looping = run(worker, 24, fox).output_token_ids  # type: ignore[attr-defined]
    assert looping[:8] == [looping[0]] * 8, "the toy model repeats itself here: penalties have work to do"
    penalised = run(worker, 24, fox, frequency_penalty=2.0, presence_penalty=2.0).output_token_ids  # type: ignore[attr-defined]
    assert len(set(penalised)) > len(set(looping))
    assert run(worker, 24, fox, repetition_penalty=2.0).output_token_ids != looping  # type: ignore[attr-defined]


def test_allowed_token_ids_are_all_that_is_sampled(make_worker: WorkerFactory, reference: Reference) -> None:
    worker = make_worker()
    greedy = reference(GenerateRequest(PROMPT, 16))
    allowed = (5, 300, 301)
    assert not set(greedy) <= set(allowed), "the model's own choice lies outside: the mask has work to do"
    for sampling in ({}, {"temperature": 1.0, "seed": 4}, {"temperature": 0.7, "top_p": 0.9, "seed": 5}):
        out = run(worker, allowed_token_ids=allowed, **sampling).output_token_ids  # type: ignore[attr-defined]
        assert len(out) == 16 and set(out) <= set(allowed), (sampling, out)
    only = run(worker, allowed_token_ids=(300,), logit_bias={301: 100.0}).output_token_ids  # type: ignore[attr-defined]
    assert only == [300] * 16  # a bias cannot bring back a masked token


def test_bad_words_ban_a_sequence_s_last_token_only_after_the_rest(make_worker: WorkerFactory) -> None:
    """vLLM's bad_words on a real worker: a one-token word is never sampled; a two-token word's last token is
    refused only right after its first, which itself stays allowed."""
    worker = make_worker()
    greedy = run(worker).output_token_ids  # type: ignore[attr-defined]
    first, second = greedy[0], greedy[1]
    banned = run(worker, bad_words_token_ids=((first,),)).output_token_ids  # type: ignore[attr-defined]
    assert first not in banned and banned != greedy
    pair = run(worker, bad_words_token_ids=((first, second),)).output_token_ids  # type: ignore[attr-defined]
    assert pair[0] == first and pair[1] != second
    assert all(pair[i + 1] != second for i in range(len(pair) - 1) if pair[i] == first)
    sampled = run(worker, temperature=1.0, seed=3, bad_words_token_ids=((first,),)).output_token_ids  # type: ignore[attr-defined]
    assert first not in sampled


def test_bad_words_give_way_when_they_would_ban_every_allowed_token() -> None:
    """A ban that leaves no token to sample is not applied: the allowed tokens stay (never a row of -inf)."""
    params = SamplingParams(allowed_token_ids=(2, 3), bad_words_token_ids=((2,), (3,), (1, 4)))
    choice = ChoiceSampling(params, GREEDY, index=0, prompt_ids=[0], eos_token_ids=())
    row = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    choice.process(row)
    assert row.tolist() == [float("-inf"), float("-inf"), 3.0, 4.0, float("-inf")]
    params = SamplingParams(bad_words_token_ids=((2,), (1, 4), (0, 1, 3)))
    choice = ChoiceSampling(params, GREEDY, index=0, prompt_ids=[1, 4], eos_token_ids=())  # the prompt never counts
    row = torch.zeros(5)
    choice.process(row)
    assert row.tolist() == [0.0, 0.0, float("-inf"), 0.0, 0.0]
    choice.record(0)
    choice.record(1)
    row = torch.zeros(5)
    choice.process(row)
    assert row.tolist() == [0.0, 0.0, float("-inf"), float("-inf"), float("-inf")]


def test_penalty_arithmetic_is_vllms() -> None:
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={4: 1.0})
    choice = ChoiceSampling(params, GREEDY, index=0, prompt_ids=[0, 1], eos_token_ids=())
    choice.record(1)
    choice.record(1)
    choice.record(2)
    row = torch.tensor([4.0, -4.0, 4.0, 4.0, 4.0])
    choice.process(row)
    # 0: prompt, positive -> /2. 1: prompt+output x2, negative -> *2, then -(0.5*2 + 0.25). 2: output x1, /2 - 0.75.
    # 3: untouched. 4: bias +1.
    assert row.tolist() == [2.0, -9.25, 1.25, 4.0, 5.0]


def test_stop_strings_cut_the_text_and_the_held_back_tail_is_never_shown(make_worker: WorkerFactory) -> None:
    worker = make_worker()
    prompt = list(b"The KV cache makes the second request faster. ")
    plain = run(worker, 24, prompt).choices[0]  # type: ignore[attr-defined]
    assert len(plain.text) >= 10
    stop = plain.text[6:9]
    cut = plain.text[: plain.text.find(stop)]
    result = run(worker, 24, prompt, stop=(stop, "never-appears")).choices[0]  # type: ignore[attr-defined]
    assert (result.text, result.finish_reason, result.stop_reason) == (cut, FinishReason.STOP, stop)
    kept = run(worker, 24, prompt, stop=(stop,), include_stop_str_in_output=True).choices[0]  # type: ignore[attr-defined]
    assert kept.text == cut + stop
    stream = worker.submit(GenerateRequest(prompt, 24, sampling=SamplingParams(stop=(stop,))))
    shown = [d.text for chunk in stream for d in chunk.deltas]
    assert "".join(shown) == cut  # nothing of the stop string was streamed, then taken back


class _EosTokenizer(ByteTokenizer):
    def __init__(self, eos: int) -> None:
        super().__init__()
        self.eos_token_ids = (eos,)


def test_eos_stop_ids_min_tokens_and_ignore_eos(reference: Reference) -> None:
    greedy = reference(GenerateRequest(PROMPT, 16))
    eos = greedy[3]
    first = greedy.index(eos)
    worker = KVWorker("eos", make_config(), tokenizer=_EosTokenizer(eos))
    try:
        ended = run(worker).choices[0]  # type: ignore[attr-defined]
        assert ended.token_ids == greedy[: first + 1]
        assert (ended.finish_reason, ended.stop_reason) == (FinishReason.STOP, None)
        assert run(worker, ignore_eos=True).output_token_ids == greedy  # type: ignore[attr-defined]
        by_id = run(worker, ignore_eos=True, stop_token_ids=(eos,)).choices[0]  # type: ignore[attr-defined]
        assert by_id.token_ids == greedy[: first + 1] and by_id.stop_reason == eos
        # The token that ends a choice is in its ids, not its text (as vLLM's v1 detokenizer leaves it out),
        # unless include_stop_str_in_output.
        before = run(worker, first, ignore_eos=True).choices[0].text  # type: ignore[attr-defined]
        through = run(worker, first + 1, ignore_eos=True).choices[0].text  # type: ignore[attr-defined]
        assert before != through
        assert ended.text == by_id.text == before
        kept = run(worker, stop_token_ids=(eos,), include_stop_str_in_output=True).choices[0]  # type: ignore[attr-defined]
        assert (kept.token_ids, kept.text) == (greedy[: first + 1], through)
        late = run(worker, min_tokens=first + 3).choices[0]  # type: ignore[attr-defined]
        assert len(late.token_ids) >= first + 3 and eos not in late.token_ids[: first + 2]
    finally:
        worker.shutdown()


def test_logprobs_are_the_raw_distribution_with_or_without_cache(make_worker: WorkerFactory) -> None:
    cached = make_worker()
    run(cached, 4)  # the prompt's blocks are now cached
    fresh = make_worker("fresh", caching=False)
    a = run(cached, 8, logprobs=3).choices[0]  # type: ignore[attr-defined]
    b = run(fresh, 8, logprobs=3).choices[0]  # type: ignore[attr-defined]
    assert a.token_ids == b.token_ids and len(a.logprobs) == 8
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == x.top[0][0] and x.logprob == pytest.approx(x.top[0][1])  # greedy: the best one
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert sum(math.exp(lp) for _, lp in x.top) <= 1.0 + 1e-6
        assert x.top[0][1] >= x.top[1][1] >= x.top[2][1]
    assert run(cached, 4).choices[0].logprobs is None  # type: ignore[attr-defined]


def test_n_choices_share_the_prompt_blocks_and_each_equals_its_seed(make_worker: WorkerFactory) -> None:
    worker = make_worker()
    prompt = random_tokens(random.Random(3), 64)  # 4 blocks: a later choice hits 3 of them (the last is recomputed)
    result = worker.generate(GenerateRequest(prompt, 12, sampling=SamplingParams(n=3, temperature=1.0, seed=40)))
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert worker._manager.prefix_cache_stats.hits == 2 * 48  # choices 1 and 2 hit choice 0's blocks
    alone = make_worker("alone")
    for index, choice in enumerate(result.choices):
        single = run(alone, 12, prompt, temperature=1.0, seed=40 + index).output_token_ids  # type: ignore[attr-defined]
        assert choice.token_ids == single
    assert result.stats.completion_tokens == 36 and result.prompt_tokens == 64
    worker.check_invariants()


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-39},  # logits / temperature: every one infinite
        {"temperature": 1.0, "repetition_penalty": 1e-39},  # the prompt's positive logits infinite
        {"temperature": 1.0, "allowed_token_ids": (7,), "stop_token_ids": (7,), "min_tokens": 2},  # nothing left
        {"allowed_token_ids": (7, 9), "bad_words_token_ids": ((7,), (9,)), "min_tokens": 1, "stop_token_ids": (9,)},
    ],
    ids=["tiny temperature", "tiny repetition penalty", "min_tokens blocks every allowed token", "all banned"],
)
def test_extreme_but_valid_sampling_never_stops_the_worker(make_worker: WorkerFactory, sampling: dict) -> None:
    """Requests that pass every check but leave the sampler with infinite logits or nothing to draw are
    answered (before: torch.multinomial raised on the step loop, and the worker died)."""
    worker = make_worker()
    out = run(worker, 6, **sampling).output_token_ids  # type: ignore[attr-defined]
    assert 1 <= len(out) <= 6
    if "allowed_token_ids" in sampling:
        assert set(out) <= set(sampling["allowed_token_ids"])
    assert worker.health()["alive"] and len(run(worker, 2).output_token_ids) == 2  # type: ignore[attr-defined]


def test_a_temperature_below_vllms_epsilon_is_greedy(reference: Reference, make_worker: WorkerFactory) -> None:
    worker = make_worker()
    assert run(worker, temperature=1e-6, seed=1).output_token_ids == reference(GenerateRequest(PROMPT, 16))  # type: ignore[attr-defined]


@pytest.mark.parametrize(("min_tokens", "text", "count"), [(0, "x", 2), (2, "xey", 4), (4, "xeyex", 6)])
def test_stop_strings_are_searched_past_the_min_tokens_tokens_text_as_vllm_does(
    min_tokens: int, text: str, count: int
) -> None:
    """vLLM's detokenizer searches stop strings once more than ``min_tokens`` tokens exist, and only for one
    that ends in a later token's text: a stop string inside the ``min_tokens``-th token does not stop it."""
    from kvstore.workers.output import ChoiceRecord

    params = SamplingParams(stop=("e",), min_tokens=min_tokens)
    state = RequestState(GenerateRequest([1, 2], 10, sampling=params), "r", 0.0)
    record = ChoiceRecord(None, 0, params, GREEDY, ByteTokenizer(), (), [1, 2])  # type: ignore[arg-type]
    shown = ""
    for token in b"xeyexez":
        shown += record.accept(state, token, None).text
        if state.is_finished:
            break
    assert (shown, len(state.output_token_ids), state.stop_reason) == (text, count, "e")


def _nucleus_by_full_sort(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole row ascending and drop the least likely tokens whose mass stays <= 1 - top_p."""
    ordered, order = torch.sort(row)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - top_p
    drop[-1] = False
    out = row.clone()
    out[order[drop]] = float("-inf")
    return out


@pytest.mark.parametrize("scale", [8.0, 3.0, 0.05])  # peaked (the candidates suffice) to flat (the full sort)
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_what_a_full_sort_keeps(scale: float, top_p: float) -> None:
    from kvstore.workers.sampler import _nucleus

    generator = torch.Generator().manual_seed(int(scale * 100 + top_p * 10))
    for _ in range(5):
        row = torch.randn(5000, generator=generator) * scale
        got, want = _nucleus(row, top_p), _nucleus_by_full_sort(row, top_p)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        assert torch.equal(got[torch.isfinite(got)], row[torch.isfinite(want)])


def test_a_draw_follows_the_probabilities_and_never_takes_an_impossible_token() -> None:
    from kvstore.workers.sampler import _draw

    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(7)
    counts = Counter(_draw(probs, generator) for _ in range(20000))
    assert set(counts) == {0, 2, 3}
    for token, p in [(0, 0.5), (2, 0.3), (3, 0.2)]:
        assert abs(counts[token] / 20000 - p) < 0.015, counts
    assert _draw(torch.tensor([0.0, 0.0, 1.0]), generator) == 2
    assert _draw(torch.tensor([1.0, 0.0, 0.0]), generator) == 0


@pytest.mark.parametrize("top_p", [0.5, 0.95, 0.9999, 0.999999])
def test_top_p_keeps_the_smallest_set_reaching_it_on_a_large_vocabulary(top_p: float) -> None:
    """At 152k tokens the float32 probabilities sum to a little more or less than 1: the kept set is the smallest
    one whose mass reaches top_p of the row's own total, summed exactly (a float32 running sum from the top
    stopped short of it at high top_p)."""
    from kvstore.workers.sampler import _nucleus

    generator = torch.Generator().manual_seed(5)
    for spread, spike in [(2.0, 25.0), (5.0, 0.0), (1.0, 0.0)]:
        row = torch.randn(151936, generator=generator) * spread
        row[7] += spike
        kept = torch.isfinite(_nucleus(row, top_p))
        probs = torch.softmax(row, dim=-1).double()
        bound = top_p * float(probs.sum())
        mass = float(probs[kept].sum())
        assert mass >= bound or bool(kept.all()), (spread, top_p, mass, bound)
        assert mass - float(probs[kept].min()) < bound  # one token fewer would not reach it
        assert float(probs[~kept].max()) <= float(probs[kept].min()) if not kept.all() else True  # the most likely
