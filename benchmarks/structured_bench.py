"""``kvstore bench structured``: what structured output costs the sampler, per step.

A batch of ``--batch`` choices is sampled from random logits as wide as a
real vocabulary (``--vocab``, default Qwen2.5's 151,936), the way the
worker's step loop samples them (``Sampler.sample``), twice with the same
sampling parameters (temperature 1, ``--top-p``): plain, and each choice held
to a JSON schema by its own grammar matcher (llguidance), which masks the
row and advances by the drawn token; a choice whose JSON is complete is
replaced by a fresh one between steps, outside the timing. The baseline is
the plain batch in the same run, and the ratio is their step times.

The logits are drawn from N(0, ``--spread``²): at the default 5, 95% of a
row's probability lies in its top ~160 tokens and the best token holds about
a third, as a trained model's next-token distribution typically does (the
table prints the measured nucleus). Flatter rows make top-p sort more of
the vocabulary.

The tokenizer is synthetic: a byte-level BPE of ``--vocab`` tokens (the 256
byte tokens and random lowercase words, one of them ``<|im_end|>`` for EOS),
written to a temporary directory. No checkpoint is needed, and llguidance's
mask depends on the tokens' bytes, not on how a text splits into them.

The model's own step is not in these numbers: they are what the grammar adds
to each step, which a step's forward pass dwarfs on a GPU at small batches
and which grows with the batch (one mask per constrained choice).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.errors import ConfigError
from kvstore.openai.structured import grammar_tokenizer, json_schema_grammar
from kvstore.openai.tokenizer import HFTokenizer
from kvstore.worker_api import SamplingParams
from kvstore.workers.grammar import GrammarMatcher
from kvstore.workers.sampler import GREEDY, ChoiceSampling, Sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tier": {"enum": ["gpu", "cpu", "disk"]},
        "hits": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "tier", "hits"],
    "additionalProperties": False,
}
EOS_TEXT = "<|im_end|>"


def synthetic_tokenizer(directory: Path, vocab: int, seed: int = 0) -> HFTokenizer:
    """A byte-level BPE tokenizer of ``vocab`` tokens (no merges: only its vocabulary matters here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    tokens = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    letters = "abcdefghijklmnopqrstuvwxyzĠ"
    while len(tokens) < vocab - 1:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
        tokens.setdefault(word, len(tokens))
    tokens[EOS_TEXT] = len(tokens)
    tokenizer = Tokenizer(models.BPE(vocab=tokens, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TEXT])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TEXT}))
    return HFTokenizer(directory)


def _choices(batch: int, params: SamplingParams, eos: tuple[int, ...], matcher: GrammarMatcher | None) -> list[Any]:
    return [
        ChoiceSampling(
            params,
            GREEDY,
            index=i,
            prompt_ids=[0],
            eos_token_ids=eos,
            grammar=matcher.copy() if matcher is not None else None,
        )
        for i in range(batch)
    ]


def measure(
    tokenizer: HFTokenizer,
    vocab: int,
    batch: int,
    steps: int,
    schema: Any,
    seed: int,
    spread: float = 5.0,
    top_p: float = 1.0,
) -> tuple[list[float], list[float], int]:
    """Seconds per step, plain and constrained, and how many JSON answers the constrained batch completed."""
    eos = tokenizer.eos_token_ids
    grammar = json_schema_grammar(schema, any_whitespace=False)
    matcher = GrammarMatcher(grammar_tokenizer(tokenizer, vocab, eos), grammar)
    plain_params = SamplingParams(temperature=1.0, top_p=top_p)
    held_params = SamplingParams(temperature=1.0, top_p=top_p, grammar=grammar)
    generator = torch.Generator().manual_seed(seed)
    logits = [torch.randn(batch, vocab, generator=generator) * spread for _ in range(8)]
    sampler = Sampler(seed)
    plain = _choices(batch, plain_params, eos, None)
    held = _choices(batch, held_params, eos, matcher)
    plain_s: list[float] = []
    held_s: list[float] = []
    completed = 0
    for step in range(steps):
        rows = logits[step % len(logits)]
        for side in (0, 1) if step % 2 else (1, 0):  # who goes first alternates: the second finds the row cached
            start = time.perf_counter()
            if side == 0:
                sampler.sample(rows, plain)
                plain_s.append(time.perf_counter() - start)
            else:
                drawn = sampler.sample(rows, held)
                held_s.append(time.perf_counter() - start)
        for index, (token, _) in enumerate(drawn):
            if held[index].constraint_done() or token in eos:
                completed += 1
                held[index] = _choices(1, held_params, eos, matcher)[0]
    return plain_s, held_s, completed


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.vocab < 512 or args.steps < 1 or args.repeat < 1:
        raise ConfigError("--batch needs sizes >= 1, --vocab >= 512, --steps and --repeat >= 1")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 < args.spread < 100:
        raise ConfigError(f"--spread must be in (0, 100), got {args.spread}")
    schema = SCHEMA if args.schema is None else json.loads(Path(args.schema).read_text())
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-structured-") as directory:
        start = time.perf_counter()
        tokenizer = synthetic_tokenizer(Path(directory), args.vocab)
        grammar_tokenizer(tokenizer, args.vocab, tokenizer.eos_token_ids)
        view_s = time.perf_counter() - start
        for batch in batches:
            plain_runs, held_runs, completed = [], [], 0
            for rep in range(args.repeat):
                plain_s, held_s, done = measure(
                    tokenizer, args.vocab, batch, args.steps, schema,
                    seed=rep, spread=args.spread, top_p=args.top_p,
                )  # fmt: skip
                plain_runs.append(statistics.median(plain_s))
                held_runs.append(statistics.median(held_s))
                completed += done
            plain_us, held_us = statistics.median(plain_runs) * 1e6, statistics.median(held_runs) * 1e6
            rows.append({
                "batch": batch,
                "plain_us_per_step": round(plain_us, 1),
                "grammar_us_per_step": round(held_us, 1),
                "added_us_per_choice": round((held_us - plain_us) / batch, 1),
                "ratio": round(held_us / plain_us, 2),
                "answers_completed": completed,
            })  # fmt: skip
    sample = torch.softmax(torch.randn(args.vocab, generator=torch.Generator().manual_seed(0)) * args.spread, -1)
    nucleus = int((sample.sort(descending=True).values.cumsum(0) < 0.95).sum()) + 1
    print(f"Sampler step, {args.vocab:,}-token vocabulary, JSON schema grammar vs plain sampling (same logits, "
          f"N(0, {args.spread:g}^2): 95% of a row in its top {nucleus:,} tokens; temperature 1, "
          f"top-p {args.top_p:g}); "
          f"medians of {args.repeat} runs of {args.steps} steps")  # fmt: skip
    print(f"{'batch':>6} {'plain us':>10} {'grammar us':>11} {'+us/choice':>11} {'ratio':>6} {'answers':>8}")
    for row in rows:
        print(f"{row['batch']:>6} {row['plain_us_per_step']:>10.1f} {row['grammar_us_per_step']:>11.1f} "
              f"{row['added_us_per_choice']:>11.1f} {row['ratio']:>6.2f} {row['answers_completed']:>8}")  # fmt: skip
    print(f"tokenizer view built in {view_s:.2f} s (once per process)")
    if args.json:
        result = {"vocab": args.vocab, "steps": args.steps, "repeat": args.repeat, "spread": args.spread,
                  "top_p": args.top_p,
                  "nucleus_tokens": nucleus, "schema": schema, "tokenizer_view_s": round(view_s, 3),
                  "rows": rows}  # fmt: skip
        write_output("--json", args.json, json.dumps(result, indent=2) + "\n")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("structured", help="sampler step time with a JSON schema grammar vs without")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (logits width)")
    p.add_argument("--batch", default="1,8,32", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--repeat", type=int, default=3, help="runs per batch size; the median is reported")
    p.add_argument("--spread", type=float, default=5.0, help="standard deviation of the random logits")
    p.add_argument("--top-p", type=float, default=1.0, help="top_p of both batches (1: none)")
    p.add_argument("--schema", default=None, help="a JSON schema file (default: a small built-in object schema)")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
