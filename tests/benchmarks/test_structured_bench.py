"""``kvstore bench structured`` runs end to end at a small vocabulary and writes its JSON (no timing is asserted):
the constrained batch really is held to its schema, and bad flags are refused by name."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstore.benchmarks import structured_bench
from kvstore.errors import ConfigError
from kvstore.openai.structured import grammar_tokenizer
from tests.benchmarks.bench_cli import bench_parser


def build_parser() -> argparse.ArgumentParser:
    return bench_parser(structured_bench)


def test_the_bench_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "structured.json"
    argv = ["bench", "structured", "--vocab", "2048", "--batch", "1,3", "--steps", "40", "--repeat", "1",
            "--json", str(out)]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 3] and result["vocab"] == 2048
    for row in result["rows"]:
        assert row["plain_us_per_step"] > 0 and row["grammar_us_per_step"] > 0 and row["ratio"] > 0
    assert "JSON schema grammar vs plain sampling" in capsys.readouterr().out


def test_the_constrained_batch_writes_json_of_the_schema(tmp_path: Path) -> None:
    """What the bench times is real constrained sampling: a choice's tokens, decoded, are JSON of the schema."""
    import jsonschema
    import torch

    from kvstore.worker_api import SamplingParams
    from kvstore.workers.grammar import GrammarMatcher
    from kvstore.workers.sampler import GREEDY, ChoiceSampling, Sampler

    tokenizer = structured_bench.synthetic_tokenizer(tmp_path, 2048)
    assert tokenizer.vocab_size == 2048 and tokenizer.eos_token_ids == (2047,)
    grammar = structured_bench.json_schema_grammar(structured_bench.SCHEMA, any_whitespace=False)
    matcher = GrammarMatcher(grammar_tokenizer(tokenizer, 2048, tokenizer.eos_token_ids), grammar)
    params = SamplingParams(temperature=1.0, grammar=grammar)
    choice = ChoiceSampling(params, GREEDY, index=0, prompt_ids=[0], eos_token_ids=(2047,), grammar=matcher)
    sampler, generator, tokens = Sampler(1), torch.Generator().manual_seed(1), []
    while not choice.constraint_done() and len(tokens) < 400:
        ((token, _),) = sampler.sample(torch.randn(1, 2048, generator=generator) * 5, [choice])
        tokens.append(token)
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), structured_bench.SCHEMA)


@pytest.mark.parametrize(
    "flags", [["--batch", "0"], ["--vocab", "100"], ["--steps", "0"], ["--top-p", "0"], ["--spread", "0"]]
)
def test_bad_flags_are_refused(flags: list[str]) -> None:
    args = build_parser().parse_args(["bench", "structured", *flags])
    with pytest.raises(ConfigError):
        args.func(args)
