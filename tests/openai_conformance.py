"""Checks with the official ``openai`` client that any kvstore OpenAI front must pass.

Each function takes the server's base URL (``http://host:port``) and its
model name, and asserts one behaviour; the test modules for a worker's own
front, for ``kvstore serve`` and for ``kvstore router`` call them, so all
three are held to the same contract.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai

Behaviour = Callable[[str, str], None]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name the three tiers of the KV cache, and say which one is fastest."},
]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def models_list(base_url: str, model: str) -> None:
    listed = client(base_url).models.list()
    assert [m.id for m in listed.data] == [model]
    assert abs(listed.data[0].created - time.time()) < 3600  # a timestamp, as vLLM's cards carry
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert isinstance(card["max_model_len"], int) and card["parent"] is None
    assert [p["object"] for p in card["permission"]] == ["model_permission"]  # one, with vLLM's defaults
    assert card["permission"][0]["allow_sampling"] is True and card["permission"][0]["organization"] == "*"
    assert client(base_url).models.retrieve(model).id == model


def completions_plain_and_streamed(base_url: str, model: str) -> None:
    c = client(base_url)
    prompt = "The quick brown fox jumps over the lazy dog, "
    plain = c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason in ("length", "stop") and plain.usage is not None
    tokens = plain.usage.completion_tokens
    assert 1 <= tokens <= 12 and (tokens == 12) == (choice.finish_reason == "length")
    events = list(
        c.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert text == choice.text, "greedy streamed text equals the plain text"
    assert events[-1].choices == [] and events[-1].usage is not None and events[-1].usage.completion_tokens == tokens
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == choice.finish_reason
    running = list(
        c.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )  # fmt: skip
    so_far = [e.usage.completion_tokens for e in running if e.choices and e.usage is not None]
    assert len(so_far) == sum(1 for e in running if e.choices), "continuous usage: every chunk carries the usage"
    assert so_far == sorted(so_far) and so_far[-1] == tokens and running[-1].usage is not None
    assert (running[-1].usage.prompt_tokens, running[-1].usage.completion_tokens) == (plain.usage.prompt_tokens, tokens)


def chat_plain_and_streamed_and_cached(base_url: str, model: str) -> None:
    c = client(base_url)
    first = c.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    message = first.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    again = c.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert again.choices[0].message.content == message.content
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and (details.cached_tokens or 0) > 0, "a repeated chat prompt is served from cache"
    stream = c.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == message.content
    assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason


def seeded_sampling_is_reproducible(base_url: str, model: str) -> None:
    c = client(base_url)

    def draw(seed: int) -> str:
        out = c.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed)
        return out.choices[0].text

    assert draw(7) == draw(7)
    assert len({draw(7), draw(8), draw(9)}) > 1


def async_client_streams(base_url: str, model: str) -> None:
    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=model,
                messages=CHAT,
                max_tokens=6,
                temperature=0,
                stream=True,  # type: ignore[arg-type]
            )
            return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

    plain = client(base_url).chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert asyncio.run(run()) == plain.choices[0].message.content


def unknown_model_is_404(base_url: str, model: str) -> None:
    c = client(base_url)
    try:
        c.completions.create(model=f"{model}-nope", prompt="x", max_tokens=1)
    except openai.NotFoundError as exc:
        assert exc.status_code == 404
        body = exc.body if isinstance(exc.body, dict) else {}
        assert "does not exist" in str(body.get("message", exc)) and body.get("param") == "model"
    else:
        raise AssertionError("an unknown model must be a 404")
    response = httpx.get(f"{base_url}/v1/models/{model}-nope")
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"
    # The framework's own errors carry the same shape: an unknown path, a wrong method.
    for status, response in (
        (404, httpx.post(f"{base_url}/v1/responses", json={"model": model})),
        (405, httpx.get(f"{base_url}/v1/completions")),
    ):
        error = response.json().get("error")
        assert response.status_code == status and error and error["code"] == status, (response, response.text)
    assert response.json()["error"]["type"] == "Method Not Allowed"  # the phrase, as vLLM types the framework's


def unsupported_fields_are_named(base_url: str, model: str) -> None:
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}],
                                  "tool_choice": "none"}, "tools[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0]"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"prompt": "x", "temperture": 0.5}, "temperture"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
         "modalities"),
    ]  # fmt: skip
    for path, body, param in cases:
        response = httpx.post(f"{base_url}{path}", json={"model": model, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "BadRequestError", (body, error)


def openai_fields_that_change_nothing_are_accepted(base_url: str, model: str) -> None:
    """What the official client and SDKs on it send beside the sampling fields -- storage, metadata, billing,
    cache keys, a plain-text response format -- is accepted, and the tokens are those of the same request
    without them."""
    c = client(base_url)
    messages: Any = [{"role": "user", "content": "Name a colour."}]
    plain = c.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
    extras = {"store": False, "metadata": {"team": "a"}, "service_tier": "auto", "prompt_cache_key": "tenant-1",
              "safety_identifier": "user-7", "response_format": {"type": "text"}, "modalities": ["text"],
              "verbosity": "low", "prediction": {"type": "content", "content": "red"}, "user": "u"}  # fmt: skip
    dressed = c.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0, extra_body=extras)
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    completion = c.completions.create(
        model=model, prompt="Name a colour.", max_tokens=3, temperature=0,
        extra_body={"store": False, "metadata": {"k": "v"}, "response_format": {"type": "text"}},
    )  # fmt: skip
    assert completion.choices[0].finish_reason is not None


def batched_prompts(base_url: str, model: str) -> None:
    """A completions request with a list of prompts answers each as if sent alone: choice i is choice i % n of
    prompt i // n, plain and streamed; the usage is the sum over the prompts."""
    c = client(base_url)
    prompts = ["The KV cache makes the second request ", "Prefix caching skips the prefill of "]
    alone = [c.completions.create(model=model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    texts = [a.choices[0].text for a in alone]
    batch = c.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in batch.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert batch.usage is not None and all(a.usage is not None for a in alone)
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)  # type: ignore[union-attr]
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)  # type: ignore[union-attr]
    events = list(
        c.completions.create(
            model=model, prompt=prompts, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed: dict[int, str] = {}
    for event in events:
        for ch in event.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: texts[0], 1: texts[1]}
    assert events[-1].choices == [] and events[-1].usage is not None
    assert events[-1].usage.prompt_tokens == batch.usage.prompt_tokens
    ids = c.completions.create(model=model, prompt=[[5, 6, 7, 8], [9, 10, 11]], max_tokens=3, temperature=0)
    assert [ch.index for ch in ids.choices] == [0, 1] and ids.usage is not None and ids.usage.prompt_tokens >= 7
    bad = httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": ["fine", ""]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]", bad.text


def client_request_id_is_prefixed(base_url: str, model: str) -> None:
    """A client's ``x-request-id`` names the answer as vLLM names it: ``cmpl-<id>`` / ``chatcmpl-<id>``."""
    c = client(base_url)
    headers = {"x-request-id": "probe-7"}
    plain = c.completions.create(model=model, prompt="ids", max_tokens=2, temperature=0, extra_headers=headers)
    assert plain.id == "cmpl-probe-7", plain.id
    chat = c.chat.completions.create(model=model, messages=CHAT, max_tokens=2, temperature=0, extra_headers=headers)
    assert chat.id == "chatcmpl-probe-7", chat.id
    streamed = c.completions.create(
        model=model, prompt="ids", max_tokens=2, temperature=0, stream=True, extra_headers=headers
    )
    assert {event.id for event in streamed} == {"cmpl-probe-7"}


def echo_with_logprobs_scores_the_prompt(base_url: str, model: str) -> None:
    """``echo`` with ``logprobs`` scores the prompt as vLLM does (what lm-evaluation-harness's loglikelihood asks):
    one entry per prompt token then per generated token, the first with no logprob; a prompt token's score is
    the score the same token gets when generated after the same text; batches, streams, ``max_tokens`` 0 and
    the ``prompt_logprobs`` field agree."""
    c = client(base_url)
    prompt = [5, 17, 33, 2, 41, 8, 19, 23, 7, 12, 30, 4, 9, 28, 14, 3, 21, 6, 11, 40]
    body = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 2},
        timeout=60,
    ).json()
    out_ids, scores = body["choices"][0]["token_ids"], body["choices"][0]["logprobs"]
    assert len(out_ids) >= 2, body  # the toy and tiny checkpoints do not stop this soon
    echoed = c.completions.create(
        model=model, prompt=prompt + out_ids[:2], max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    lp = echoed.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.token_logprobs) == len(prompt) + 2 + 1  # the prompt, then the one generated token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    # Scored as prompt tokens, the two tokens generated after the prompt get the scores they had when generated.
    for got, want in zip(lp.token_logprobs[len(prompt) : len(prompt) + 2], scores["token_logprobs"][:2], strict=True):
        assert abs(got - want) < 1e-3, (got, want)
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False))
    # the token itself, then 2 alternatives, one entry per distinct text (byte tokens may share one)
    assert all(top and 1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    # vLLM's prompt_logprobs field: per prompt token, the token first with its rank, then the alternatives.
    raw = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1},
        timeout=60,
    ).json()
    field = raw["choices"][0]["prompt_logprobs"]
    assert len(field) == len(prompt) and field[0] is None
    for position, step in enumerate(field[1:], start=1):
        own = step[str(prompt[position])]
        assert own["rank"] >= 1 and own["logprob"] <= 0 and isinstance(own["decoded_token"], str)
        assert abs(own["logprob"] - lp.token_logprobs[position]) < 1e-3
        best = [entry for entry in step.values() if entry["rank"] == 1]
        assert len(best) == 1 and best[0]["logprob"] >= own["logprob"]
    # echo with max_tokens 0: the prompt alone; a stream's first chunk carries the same scores; batches too.
    alone = c.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0)
    only = alone.choices[0].logprobs
    assert only is not None and only.token_logprobs is not None and len(only.token_logprobs) == len(prompt)
    streamed = list(c.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                         logprobs=1, stream=True))  # fmt: skip
    opening = streamed[0].choices[0].logprobs
    assert opening is not None and opening.token_logprobs is not None
    assert opening.token_logprobs[0] is None and len(opening.token_logprobs) == len(prompt) + 1
    for got, want in zip(opening.token_logprobs[1 : len(prompt)], lp.token_logprobs[1 : len(prompt)], strict=True):
        assert abs(got - want) < 1e-3
    batch = c.completions.create(model=model, prompt=[prompt[:8], prompt], max_tokens=1, temperature=0, echo=True,
                                 logprobs=0)  # fmt: skip
    lengths = [len(ch.logprobs.token_logprobs or []) for ch in batch.choices if ch.logprobs is not None]
    assert lengths == [9, len(prompt) + 1]
    refused = httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": prompt, "stream": True,
                                                             "prompt_logprobs": 2}, timeout=30)  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", refused.text


def tokenize_and_detokenize(base_url: str, model: str) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``: a prompt's or a chat's tokens, counted as the completion counts
    them; back to text; the tokens' vocabulary spellings on request; another model a 404, a bad id a 400."""
    c = client(base_url)
    prompt = "The KV cache makes the second request faster."
    counted = c.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0).usage
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": model, "prompt": prompt}, timeout=30).json()
    assert counted is not None and tokens["count"] == len(tokens["tokens"]) == counted.prompt_tokens, tokens
    assert isinstance(tokens["max_model_len"], int) and tokens["token_strs"] is None
    chat_counted = c.chat.completions.create(model=model, messages=CHAT, max_tokens=1, temperature=0).usage  # type: ignore[arg-type]
    chat = httpx.post(f"{base_url}/tokenize", json={"model": model, "messages": CHAT, "return_token_strs": True},
                      timeout=30).json()  # fmt: skip
    assert chat_counted is not None and chat["count"] == chat_counted.prompt_tokens
    assert len(chat["token_strs"]) == chat["count"] and all(isinstance(t, str) for t in chat["token_strs"])
    text = httpx.post(f"{base_url}/detokenize", json={"model": model, "tokens": tokens["tokens"]}, timeout=30).json()
    assert prompt in text["prompt"], text  # a BOS the tokenizer adds reads back too
    other = httpx.post(f"{base_url}/tokenize", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["type"] == "NotFoundError", other.text
    bad = httpx.post(f"{base_url}/detokenize", json={"model": model, "tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text
    neither = httpx.post(f"{base_url}/tokenize", json={"model": model}, timeout=30)
    assert neither.status_code == 400, neither.text


def every_behaviour() -> list[Behaviour]:
    """The checks every front must pass (disconnect_mid_stream needs a way to see the cancel: run it apart)."""
    return [
        models_list,
        completions_plain_and_streamed,
        chat_plain_and_streamed_and_cached,
        seeded_sampling_is_reproducible,
        async_client_streams,
        unknown_model_is_404,
        unsupported_fields_are_named,
        openai_fields_that_change_nothing_are_accepted,
        batched_prompts,
        client_request_id_is_prefixed,
        echo_with_logprobs_scores_the_prompt,
        tokenize_and_detokenize,
    ]


def disconnect_mid_stream(base_url: str, model: str) -> None:
    """Open a long stream, read its first event, drop the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    body = (
        b'{"model": "' + model.encode() + b'", "prompt": "Tell me everything", "max_tokens": 1500, '
        b'"temperature": 0, "ignore_eos": true, "stream": true}'
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        deadline = time.monotonic() + 30
        while b"data: " not in received and time.monotonic() < deadline:
            received += sock.recv(65536)
        assert b"data: " in received
