"""vLLM's guided choice (``guided_choice`` / ``structured_outputs.choice``): the output is one of the choices,
whole, whatever the sampling -- on the built-in model and on a transformers-written checkpoint whose tokenizer
merges characters -- through the worker and through the HTTP front with the official ``openai`` client."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from workers_testlib import make_config

from kvstore.errors import InvalidRequestError
from kvstore.openai.errors import ApiError
from kvstore.openai.protocol import ModelLimits, decode_completion, parse_completion
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.worker_api import FinishReason, GenerateRequest, SamplingParams
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests import openai_conformance as check
from tests.checkpoints import TinyCheckpoint
from tests.http_servers import ServerThread

CHOICES = ["positive", "negative", "neutral", "neg"]


@pytest.fixture(scope="module")
def toy() -> Iterator[KVWorker]:
    worker = KVWorker("guided", make_config(num_blocks=128))
    yield worker
    worker.shutdown()


def test_every_sample_is_one_of_the_choices_whole(toy: KVWorker) -> None:
    ids = tuple(tuple(c.encode()) for c in CHOICES)
    rng = random.Random(3)
    seen = set()
    for seed in range(12):
        prompt = [rng.randrange(256) for _ in range(20)]
        sampling = SamplingParams(temperature=1.5, seed=seed, n=2, choice_token_ids=ids)
        result = toy.generate(GenerateRequest(prompt, 32, sampling=sampling))
        for choice in result.choices:
            assert choice.text in CHOICES, choice.text
            # "neg" goes on to "negative": without EOS the toy model must take the longer one
            assert choice.text != "neg" and choice.finish_reason is FinishReason.STOP
            seen.add(choice.text)
    assert len(seen) >= 2  # sampling still chooses among them
    toy.check_invariants()


def test_a_guided_choice_cut_short_by_max_tokens_ends_with_length(toy: KVWorker) -> None:
    sampling = SamplingParams(temperature=0.0, choice_token_ids=(tuple(b"abcdef"),))
    result = toy.generate(GenerateRequest([1, 2, 3], 3, sampling=sampling))
    assert result.choices[0].text == "abc" and result.choices[0].finish_reason is FinishReason.LENGTH


def test_bad_choice_sequences_are_refused(toy: KVWorker) -> None:
    for bad in [(), ((),), ((10**6,),)]:
        with pytest.raises(InvalidRequestError, match=r"choice_token_ids|vocabulary"):
            toy.submit(GenerateRequest([1, 2], 4, sampling=SamplingParams(choice_token_ids=bad)))  # type: ignore[arg-type]


def test_over_http_on_a_checkpoint_whose_tokenizer_merges(qwen2_checkpoint: TinyCheckpoint) -> None:
    worker = KVWorker("guided-hf", make_config(num_blocks=64, model=str(qwen2_checkpoint.path)))
    server = ServerThread(create_worker_app(worker)).start()
    try:
        model = worker.info().model_name
        tokenizer = load_tokenizer(str(qwen2_checkpoint.path))
        choices = ["The KV cache", "prefix caching", "Hello, world!"]
        assert any(len(tokenizer.encode(c)) < len(c) for c in choices)  # merged tokens, not bytes
        client = check.client(server.url)
        for seed in range(4):
            answer = client.completions.create(
                model=model, prompt="Pick one:", max_tokens=20, temperature=1.0, seed=seed,
                extra_body={"guided_choice": choices},
            )  # fmt: skip
            assert answer.choices[0].text in choices, answer.choices[0].text
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Pick one."}], max_tokens=20, temperature=0,
            extra_body={"structured_outputs": {"choice": choices}},
        )  # fmt: skip
        assert chat.choices[0].message.content in choices
        for body, param in [
            ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs.regex"),  # one kind only
            ({"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, "guided_choice"),
            ({"guided_choice": []}, "guided_choice"),
            ({"guided_choice": ["ok", 3]}, "guided_choice[1]"),
        ]:
            refused = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "x", **body})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    finally:
        server.stop()
        worker.shutdown()


def test_a_choice_whose_tokens_read_otherwise_mid_text_is_refused(tmp_path: Path) -> None:
    """A SentencePiece-style tokenizer marks a word's start: ``negative`` alone is ``▁negative``, which reads
    " negative" after other text, not the choice. Constrained by its own tokens, the output would not be one of
    the choices, so the request is refused naming the choice (a byte-level BPE, as Qwen2's, is served)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.train_from_iterator(["positive negative neutral x"] * 8, trainer=trainers.BpeTrainer(vocab_size=80))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    spm = load_tokenizer(str(tmp_path))
    raw = json.dumps({"prompt": "x", "guided_choice": ["negative"]}).encode()
    with pytest.raises(ApiError, match="reads as ' negative'") as info:
        parse_completion(decode_completion(raw), spm, ModelLimits(None, 2048))
    assert info.value.param == "guided_choice[0]"
