"""A worker's own HTTP front (``kvstore worker``, no Ray) against the official ``openai`` client."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer
from workers_testlib import make_config

from kvstore.router.backends import parse_load
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker
from tests import openai_conformance as check
from tests.checkpoints import TinyCheckpoint, reference_model
from tests.http_servers import ServerThread

MODEL = "kvstore-toy"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, KVWorker]]:
    worker = KVWorker("http-0", make_config(num_blocks=512))
    server = ServerThread(create_worker_app(worker)).start()
    yield server.url, worker
    server.stop()
    worker.shutdown()


BEHAVIOURS = check.every_behaviour()


@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda f: f.__name__)
def test_openai_client(served: tuple[str, KVWorker], behaviour: check.Behaviour) -> None:
    behaviour(served[0], MODEL)


@pytest.fixture(scope="module")
def served_checkpoint(qwen2_checkpoint: TinyCheckpoint) -> Iterator[tuple[str, KVWorker]]:
    """A transformers-written Qwen2 checkpoint: its own tokenizer, ChatML template and EOS ids."""
    worker = KVWorker("http-qwen", make_config(num_blocks=256, model=str(qwen2_checkpoint.path)))
    server = ServerThread(create_worker_app(worker)).start()
    yield server.url, worker
    server.stop()
    worker.shutdown()


@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda f: f.__name__)
def test_openai_client_on_a_checkpoint(served_checkpoint: tuple[str, KVWorker], behaviour: check.Behaviour) -> None:
    url, worker = served_checkpoint
    assert worker.info().model_name == qwen2_checkpoint_name(worker)
    behaviour(url, worker.info().model_name)


def qwen2_checkpoint_name(worker: KVWorker) -> str:
    assert worker.served.checkpoint is not None
    return Path(worker.served.checkpoint).name  # the served name defaults to the directory's


def test_a_client_that_disconnects_mid_stream_cancels_its_request(served: tuple[str, KVWorker]) -> None:
    url, worker = served
    before = _aborted(worker)
    check.disconnect_mid_stream(url, MODEL)
    deadline = time.monotonic() + 10
    while (_aborted(worker) == before or worker.load().running) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _aborted(worker) == before + 1 and worker.load().running == 0
    worker.check_invariants()


def _aborted(worker: KVWorker) -> float:
    for line in worker.metrics_text().decode().splitlines():
        if line.startswith("kvstore_requests_total") and 'outcome="aborted"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_health_check_answers_under_vllms_name_and_the_routers() -> None:
    """``/health`` (vLLM's) and ``/healthz`` (the router's) are one check: 200 with the worker's state while it
    serves, 503 once it is shut down (a probe written for either front fits a worker)."""
    worker = KVWorker("http-health", make_config(num_blocks=64))
    server = ServerThread(create_worker_app(worker)).start()
    try:
        for path in ("/health", "/healthz"):
            answer = httpx.get(server.url + path, timeout=10)
            assert answer.status_code == 200 and answer.json()["alive"] is True, (path, answer.text)
        worker.shutdown()
        for path in ("/health", "/healthz"):
            answer = httpx.get(server.url + path, timeout=10)
            assert answer.status_code == 503 and answer.json()["alive"] is False, (path, answer.text)
    finally:
        server.stop()
        worker.shutdown()


def test_a_checkpoints_max_new_tokens_caps_what_the_front_generates(
    qwen2_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """generation_config.json's max_new_tokens reaches the HTTP front (through ModelInfo) and caps max_tokens."""
    copy = shutil.copytree(qwen2_checkpoint.path, tmp_path / "capped")
    path = copy / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_new_tokens": 3}))
    worker = KVWorker("http-capped", make_config(num_blocks=64, model=str(copy)))
    server = ServerThread(create_worker_app(worker)).start()
    try:
        body = {"model": "capped", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert (len(choice["token_ids"]), choice["finish_reason"]) == (3, "length")
    finally:
        server.stop()
        worker.shutdown()


def test_bad_words_over_http_keep_a_word_out_of_the_answer(served: tuple[str, KVWorker]) -> None:
    """vLLM's ``bad_words`` through the OpenAI front, sent as the official client sends vLLM's extensions."""
    client = check.client(served[0])
    plain = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    ids = plain.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert ord("5") in ids, "the toy model writes a '5' here: the ban has work to do"
    banned = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body={"bad_words": ["5"]}
    )
    assert ord("5") not in banned.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert "5" not in banned.choices[0].text and banned.choices[0].text != plain.choices[0].text


def test_echoed_prompt_scores_equal_transformers(
    served_checkpoint: tuple[str, KVWorker], qwen2_checkpoint: TinyCheckpoint
) -> None:
    """lm-evaluation-harness's loglikelihood request (a prompt of token ids, ``echo``, ``logprobs=1``,
    ``max_tokens=1``): each prompt token's logprob is transformers' ``log_softmax`` at the position before it;
    chat's ``prompt_logprobs`` scores the rendered conversation the same way."""
    url, worker = served_checkpoint
    model = worker.info().model_name
    prompt = torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        logits = reference_model(qwen2_checkpoint)(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)
    answer = check.client(url).completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    scores = answer.choices[0].logprobs
    assert scores is not None and scores.token_logprobs is not None and scores.top_logprobs is not None
    assert scores.token_logprobs[0] is None
    for position in range(1, len(prompt)):
        row = want[position - 1]
        assert scores.token_logprobs[position] == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        # keyed by text (tokens that decode alike share a key, as in vLLM): every value is the token's or the best's
        best = {float(row[prompt[position]]), float(row.max())}
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in scores.top_logprobs[position].values())
    assert scores.token_logprobs[-1] == pytest.approx(float(want[-1].max()), abs=1e-4)  # greedy: the best token
    messages = [{"role": "user", "content": "Score me."}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1,
                                                          "prompt_logprobs": 0}, timeout=60).json()  # fmt: skip
    rendered = list(
        AutoTokenizer.from_pretrained(qwen2_checkpoint.path).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    with torch.no_grad():
        chat_logits = reference_model(qwen2_checkpoint)(torch.tensor([rendered])).logits[0].float()
    chat_want = torch.log_softmax(chat_logits, dim=-1)
    field = chat["prompt_logprobs"]
    assert len(field) == len(rendered) and field[0] is None
    for position in range(1, len(rendered)):
        entry = field[position][str(rendered[position])]
        assert entry["logprob"] == pytest.approx(float(chat_want[position - 1][rendered[position]]), abs=1e-4)
        assert next(iter(field[position])) == str(rendered[position])  # the prompt's own token first


def test_a_front_with_a_tool_call_parser_serves_tool_choice_auto(served: tuple[str, KVWorker]) -> None:
    """``router.tool_call_parser = "hermes"``: a chat with tools (``tool_choice`` "auto" by default) is served,
    plain and streamed, through the official client; the toy model writes no call, so the answer is content."""
    _, worker = served
    server = ServerThread(create_worker_app(worker, tool_parser="hermes")).start()
    try:
        client = check.client(server.url)
        tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        answer = client.chat.completions.create(model=MODEL, messages=check.CHAT, tools=tools, max_tokens=6)
        assert answer.choices[0].finish_reason in ("length", "stop") and answer.choices[0].message.tool_calls == []
        assert answer.choices[0].message.content
        events = list(
            client.chat.completions.create(model=MODEL, messages=check.CHAT, tools=tools, max_tokens=6, stream=True)
        )
        streamed = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        assert streamed == answer.choices[0].message.content  # greedy: the same text, no call found in either
        refused = httpx.post(f"{served[0]}/v1/chat/completions",
                             json={"model": MODEL, "messages": check.CHAT, "tools": tools}, timeout=30)  # fmt: skip
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"  # no parser there
    finally:
        server.stop()


def test_metrics_carry_vllms_names_for_what_reads_a_vllm_server(served: tuple[str, KVWorker]) -> None:
    """A vLLM-aware router or dashboard reads ``vllm:*`` series: each equals its ``kvstore_*`` twin, parsed by the
    Prometheus client's own text parser, and the router's HTTP backend reads the load from them."""
    url = served[0]
    check.client(url).completions.create(model=MODEL, prompt="metrics, please", max_tokens=3, temperature=0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    pairs = {
        "vllm:num_requests_running": "kvstore_requests_running",
        "vllm:num_requests_waiting": "kvstore_requests_waiting",
        "vllm:kv_cache_usage_perc": "kvstore_gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total": "kvstore_prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total": "kvstore_prefix_cache_hits_total",
        "vllm:num_preemptions_total": "kvstore_preemptions_total",
    }
    for vllm_name, ours in pairs.items():
        assert samples[vllm_name].labels == {"model_name": MODEL, "engine": "0"}, vllm_name
        assert samples[vllm_name].value == samples[ours].value, (vllm_name, ours)
    # The token counters move every step, ours when a request finishes: on an idle worker vLLM's have counted
    # everything ours have, and the prompts and tokens of requests that never finished (cancelled) besides.
    for vllm_name, ours in [("vllm:prompt_tokens_total", "kvstore_prompt_tokens_total"),
                            ("vllm:generation_tokens_total", "kvstore_generation_tokens_total")]:  # fmt: skip
        assert samples[vllm_name].labels == {"model_name": MODEL, "engine": "0"}, vllm_name
        assert samples[vllm_name].value >= samples[ours].value > 0, (vllm_name, ours)
    assert samples["vllm:generation_tokens_total"].value >= 3
    load = parse_load(text)
    assert load.running == samples["vllm:num_requests_running"].value


def test_vllms_token_counters_move_while_a_stream_runs(served: tuple[str, KVWorker]) -> None:
    """As vLLM's: prompt tokens counted once the first token comes, generated tokens every step -- not at the end,
    which would leave a rate() panel at zero through a long stream, then spike."""
    url = served[0]

    def read() -> dict[str, float]:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = read()
    body = {"model": MODEL, "prompt": "count me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
        lines = answer.iter_lines()
        for _ in range(40):
            next(lines)
        during = read()
        assert during["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] >= 20
        assert during["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == len(b"count me")
        assert during["kvstore_generation_tokens_total"] == before["kvstore_generation_tokens_total"]  # at the end
        for _ in lines:
            pass
