"""``kvstore router`` in front of vLLM: what reaches the replica, and what comes back, byte for byte.

Two vLLM stand-ins (:mod:`kvstore.benchmarks.standin_replica`, written from
vLLM's documented server behaviour) each behind a tap that keeps the exact
bytes of every answer it sends, and routers built by ``kvstore router``'s
own code over them, all on 127.0.0.1. KV events are not part of this: each
replica's events endpoint is a free port nobody publishes on, so routing
runs on load alone.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.middleware.gzip import GZipMiddleware
from tokenizers import Tokenizer

from kvstore.benchmarks.standin_replica import StandinState, create_standin_app
from kvstore.deploy.config import config_from_dict
from kvstore.deploy.router_cli import build_router
from kvstore.router.app import create_app
from kvstore.router.config import ExternalReplica
from kvstore.router.relay import relayed_headers
from kvstore.router.service import RouterService
from tests import openai_conformance as conformance
from tests.checkpoints import CHATML_SPECIALS, CHATML_TEMPLATE, train_tokenizer
from tests.http_servers import ServerThread
from tests.router.router_helpers import wait_for

MODEL = "standin-model"
BLOCK = 16
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class Tap:
    """An ASGI wrapper keeping the exact body bytes of every completion answer the app sends,
    and counting the completion requests whose connection closed before the answer was complete."""

    def __init__(self, app: ASGI) -> None:
        self._app = app
        self.answers: list[bytearray] = []
        self.hung_up = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self._app(scope, receive, send)
            return
        answer = bytearray()
        self.answers.append(answer)
        request = [message := await receive()]
        while message.get("more_body"):
            request.append(message := await receive())
        done, gone = asyncio.Event(), asyncio.Event()

        async def replay() -> Message:
            if request:
                return request.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:  # what the app would see if it listened, as vLLM does
            if (await receive())["type"] == "http.disconnect" and not done.is_set():
                self.hung_up += 1
            gone.set()

        async def tapped(message: Message) -> None:
            if message["type"] == "http.response.body":
                answer.extend(message.get("body", b""))
                if not message.get("more_body"):
                    done.set()
            await send(message)

        watcher = asyncio.ensure_future(watch())
        try:
            await self._app(scope, replay, tapped)
        finally:
            done.set()
            await asyncio.sleep(0)
            watcher.cancel()


class Replica:
    """One stand-in on a real socket: its state (what it saw), its tap (what it answered)."""

    def __init__(self, name: str, *, gzip: bool = False, model: str = MODEL) -> None:
        self.name = name
        self.state = StandinState(model)
        app = create_standin_app(self.state)
        if gzip:
            app.add_middleware(GZipMiddleware, minimum_size=0)
        self.tap = Tap(app)
        self.server = ServerThread(self.tap).start()

    @property
    def last_body(self) -> bytes:
        return self.state.requests[-1].body

    def reset(self) -> None:
        self.state.ttft_s = self.state.itl_s = 0.0
        self.state.running = self.state.waiting = self.state.kv_usage = 0.0

    def stop(self) -> None:
        self.server.stop()


class Router:
    """``kvstore router`` (its own build_router) over some replicas, with a client."""

    def __init__(self, replicas: list[Replica], *, model: str | None = None, **router: Any) -> None:
        specs = [ExternalReplica(name=r.name, url=r.server.url, events=_free_endpoint(), model=model) for r in replicas]
        config = config_from_dict(
            {
                "cache": {"block_size": BLOCK},
                "router": {"health_interval_s": 0.1, **router, "replicas": [msgspec.to_builtins(s) for s in specs]},
            }
        )
        self.service: RouterService = build_router(config)
        self.server = ServerThread(create_app(self.service)).start()
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=30)
        assert wait_for(lambda: len(self.client.get("/v1/models").json()["data"]) > 0, timeout=10)

    def post(self, path: str, raw: bytes, **headers: str) -> httpx.Response:
        return self.client.post(path, content=raw, headers={"content-type": "application/json", **headers})

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["name"]: w for w in self.client.get("/workers").json()["workers"]}

    def close(self) -> None:
        self.client.close()
        self.server.stop()


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as vLLM reads one: a byte-level BPE tokenizer.json and a ChatML template."""
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(CHATML_SPECIALS, bos=None).save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, Replica]]:
    made = {name: Replica(name) for name in ("a", "b")}
    yield made
    for replica in made.values():
        replica.stop()


@pytest.fixture(autouse=True)
def _calm(replicas: dict[str, Replica]) -> None:
    for replica in replicas.values():
        replica.reset()


@pytest.fixture(scope="module")
def router(replicas: dict[str, Replica], tokenizer_dir: Path) -> Iterator[Router]:
    made = Router(list(replicas.values()), tokenizer=str(tokenizer_dir))
    yield made
    made.close()


def served_by(replicas: dict[str, Replica], response: httpx.Response) -> Replica:
    return replicas[response.headers["x-kvstore-replica"]]


def sse_events(raw: bytes) -> list[bytes]:
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


# ------------------------------------------------------------------ request bodies

# Odd spacing, key order, escapes, a big seed, vLLM's extension fields and a vendor's: all must arrive as sent.
RAW_COMPLETION = (
    b'{ "model" : "standin-model",\n  "prompt": [1, 2, 3, 17, 99, 250],"max_tokens":3,'
    b' "temperature": 0.70, "top_p":1e-1, "seed": 12345678901234, "stop": ["\\n\\n", "\\u00e9t\\u00e9"],'
    b' "presence_penalty": -0.5, "frequency_penalty": 0.25, "n": 1, "logit_bias": {"50256": -100},'
    b' "ignore_eos": true, "top_k": -1, "min_tokens": 2, "repetition_penalty": 1.05,'
    b' "vendor_x": {"nested": [1, {"deep": null}], "flag": false}, "cache_salt": "tenant-7"}'
)
RAW_TEXT = b'{"model":"standin-model","prompt":"caf\\u00e9 caf\xc3\xa9  \\t spaced","max_tokens":2,"top_k":40}'
RAW_CHAT = (
    b'{"messages":[{"role":"system","content":"You are terse."},'
    b'{"role":"user","content":[{"type":"text","text":"Name the tiers."}]}],'
    b'"model":"standin-model","max_completion_tokens":2,"temperature":0,"chat_template_kwargs":{"x":1},'
    b'"min_tokens":1,"skip_special_tokens":false,"guided_json":{"type":"object"}}'
)


@pytest.mark.parametrize(
    ("path", "raw"),
    [("/v1/completions", RAW_COMPLETION), ("/v1/completions", RAW_TEXT), ("/v1/chat/completions", RAW_CHAT)],
    ids=["token-ids", "text", "chat"],
)
def test_bodies_reach_the_replica_byte_for_byte(
    router: Router, replicas: dict[str, Replica], path: str, raw: bytes
) -> None:
    response = router.post(path, raw, **{"x-request-id": "req-1", "x-vendor-trace": "abc"})
    assert response.status_code == 200, response.text
    replica = served_by(replicas, response)
    seen = replica.state.requests[-1]
    assert seen.path == path and seen.body == raw
    assert seen.headers["x-request-id"] == "req-1" and seen.headers["x-vendor-trace"] == "abc"
    assert seen.headers["host"] == replica.server.url.removeprefix("http://")
    assert response.content == replica.tap.answers[-1], "the answer is the replica's, unchanged"
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == "req-1", "the replica's own headers come back"
    for name in ("date", "server", "content-length"):  # the router's, once each: not the replica's beside them
        assert len(response.headers.get_list(name)) <= 1, (name, response.headers.get_list(name))
    assert response.headers["x-kvstore-retried"] == "false"
    assert float(response.headers["x-kvstore-route-s"]) >= 0


def test_the_openai_client_s_requests_arrive_as_it_sent_them(router: Router, replicas: dict[str, Replica]) -> None:
    sent: list[bytes] = []
    http = httpx.Client(event_hooks={"request": [lambda request: sent.append(request.read())]})
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="k", max_retries=0, http_client=http)
    vllm_fields = {"ignore_eos": True, "top_k": 5, "min_tokens": 1, "repetition_penalty": 1.1, "vendor": [1, "x"]}
    completion = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0.3, top_p=0.9, seed=11, stop=["."],
        presence_penalty=0.1, frequency_penalty=0.2, extra_body=vllm_fields,
    )  # fmt: skip
    assert completion.choices[0].text == "t0 t1 t2 t3 " and completion.usage is not None
    messages: Any = [{"role": "user", "content": "héllo"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, seed=3, extra_body=vllm_fields)
    assert chat.choices[0].message.content == "t0 t1 "
    received = [r.body for replica in replicas.values() for r in replica.state.requests[-2:]]
    for body in sent:
        assert body in received, "the replica saw exactly what the client sent"
    parsed = [json.loads(body) for body in sent]
    sampling = {"temperature": 0.3, "top_p": 0.9, "seed": 11, "stop": ["."], "presence_penalty": 0.1,
                "frequency_penalty": 0.2}  # fmt: skip
    assert parsed[0] == {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, **sampling, **vllm_fields}
    assert parsed[1] == {"model": MODEL, "messages": messages, "max_tokens": 2, "seed": 3, **vllm_fields}


def test_the_configured_model_replaces_only_the_model_field(replicas: dict[str, Replica]) -> None:
    rewriting = Router(list(replicas.values()), model=MODEL)
    try:
        body = {"model": "alias", "prompt": [9, 8, 7], "max_tokens": 2, "top_k": 3, "vendor": {"z": [1.5, None]}}
        response = rewriting.post("/v1/completions", json.dumps(body).encode())
        assert response.status_code == 200, response.text
        seen = json.loads(served_by(replicas, response).last_body)
        assert seen == {**body, "model": MODEL} and list(seen) == list(body)
        no_model = {"prompt": [1], "max_tokens": 1}
        response = rewriting.post("/v1/completions", json.dumps(no_model).encode())
        assert json.loads(served_by(replicas, response).last_body) == {**no_model, "model": MODEL}
    finally:
        rewriting.close()


# ------------------------------------------------------------------------ streams


def test_streams_pass_through_chunk_by_chunk(router: Router, replicas: dict[str, Replica]) -> None:
    for replica in replicas.values():
        replica.state.itl_s = 0.2  # 5 events 0.2 s apart: the last exists 0.8 s after the first
    raw = b'{"model":"standin-model","prompt":[1,2,3],"max_tokens":5,"stream":true}'
    arrivals: list[tuple[float, bytes]] = []
    start = time.monotonic()
    with router.client.stream("POST", "/v1/completions", content=raw) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert re.fullmatch("[0-9a-f]{32}", response.headers["x-request-id"]), "the replica's id for the request"
        assert response.headers.get_list("transfer-encoding") == ["chunked"], "the router's framing, once"
        for data in response.iter_raw():
            arrivals.append((time.monotonic() - start, data))
    received = b"".join(data for _, data in arrivals)
    assert received == served_by(replicas, response).tap.answers[-1], "every event as the replica sent it"
    events = sse_events(received)
    assert len(events) == 6 and events[-1] == b"data: [DONE]\n\n"
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == [f"t{i} " for i in range(5)]
    first, last = arrivals[0][0], arrivals[-1][0]
    assert first < 0.4 and last > 0.75 and last - first > 0.6, arrivals  # the first came long before the last existed
    assert len(arrivals) >= 5, "one network read per event, not one at the end"


def test_usage_is_the_replica_s_plain_and_streamed(router: Router, replicas: dict[str, Replica]) -> None:
    prompt = [4, 5, 6, 7]
    length = len(json.dumps(prompt))  # the stand-in counts the prompt's JSON characters
    usage = {"prompt_tokens": length, "completion_tokens": 3, "total_tokens": length + 3}
    plain = router.post("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 3}).encode())
    assert plain.json()["usage"] == usage and plain.content == served_by(replicas, plain).tap.answers[-1]
    body = {"prompt": prompt, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    streamed = router.post("/v1/completions", json.dumps(body).encode())
    events = sse_events(streamed.content)
    assert streamed.content == served_by(replicas, streamed).tap.answers[-1]
    last = json.loads(events[-2][6:])
    assert last["choices"] == [] and last["usage"] == usage and events[-1] == b"data: [DONE]\n\n"
    chunks = list(
        conformance.client(router.url).chat.completions.create(
            model=MODEL, messages=conformance.CHAT, max_tokens=3, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_a_client_that_leaves_mid_stream_closes_the_upstream_connection(
    router: Router, replicas: dict[str, Replica]
) -> None:
    for replica in replicas.values():
        replica.state.itl_s = 0.2  # 20 events: 4 s if nobody hangs up
    before = {name: r.state.disconnects for name, r in replicas.items()}
    conformance.disconnect_mid_stream(router.url, MODEL)  # reads the first event, then drops the connection
    assert wait_for(lambda: sum(r.state.disconnects for r in replicas.values()) == sum(before.values()) + 1, 3)
    assert all(w["inflight"] == 0 for w in router.workers().values())


def test_a_client_that_leaves_before_a_plain_answer_closes_the_upstream_connection(
    router: Router, replicas: dict[str, Replica]
) -> None:
    for replica in replicas.values():
        replica.state.ttft_s = 3.0  # a plain answer comes whole, at the end: the router waits for its headers
    before = sum(r.tap.hung_up for r in replicas.values())
    host, port = router.url.removeprefix("http://").split(":")
    body = b'{"prompt": [1, 2, 3], "max_tokens": 4}'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert wait_for(lambda: sum(w["inflight"] for w in router.workers().values()) == 1, 2)
    assert wait_for(lambda: sum(r.tap.hung_up for r in replicas.values()) == before + 1, 2), "the replica saw it"
    assert all(w["inflight"] == 0 for w in router.workers().values())


# ---------------------------------------------------------------- models, errors


def test_models_are_the_fleet_s_and_an_unknown_model_gets_the_replica_s_404(
    router: Router, replicas: dict[str, Replica]
) -> None:
    conformance.models_list(router.url, MODEL)
    conformance.unknown_model_is_404(router.url, MODEL)
    response = router.post("/v1/completions", b'{"model":"nope","prompt":[1],"max_tokens":1}')
    assert response.status_code == 404
    assert response.content == served_by(replicas, response).tap.answers[-1]
    assert response.json()["error"]["message"] == "The model `nope` does not exist."


def request_counts(router: Router) -> dict[tuple[str, str], float]:
    page = router.client.get("/metrics").text
    return {
        (sample.labels["outcome"], sample.labels["code"]): sample.value
        for family in text_string_to_metric_families(page)
        if family.name == "kvstore_router_requests"
        for sample in family.samples
        if sample.name == "kvstore_router_requests_total"
    }


def test_relayed_requests_are_counted_once_by_what_the_client_got(router: Router) -> None:
    before = request_counts(router)
    assert router.post("/v1/completions", b'{"model":"standin-model","prompt":[1,2],"max_tokens":1}').status_code == 200
    assert router.post("/v1/completions", b'{"model":"nope","prompt":[1],"max_tokens":1}').status_code == 404
    assert router.post("/v1/completions", b'{"prompt": [1,').status_code == 400  # the router's own refusal
    after = request_counts(router)
    grown = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    assert grown == {("ok", "2xx"): 1.0, ("rejected", "4xx"): 2.0}
    # Every family has series from the start: cached tokens per medium are zeros here (vLLM reports none).
    cached = {
        sample.labels["medium"]: sample.value
        for family in text_string_to_metric_families(router.client.get("/metrics").text)
        if family.name == "kvstore_router_cached_tokens"
        for sample in family.samples
        if sample.name == "kvstore_router_cached_tokens_total"
    }
    assert cached == {"GPU": 0.0, "CPU": 0.0, "STORAGE": 0.0}


def test_the_openai_battery_that_a_stand_in_can_pass(router: Router) -> None:
    conformance.completions_plain_and_streamed(router.url, MODEL)
    conformance.async_client_streams(router.url, MODEL)


def test_without_a_tokenizer_text_is_refused_naming_router_tokenizer(replicas: dict[str, Replica]) -> None:
    bare = Router(list(replicas.values()))
    try:
        served = sum(len(r.state.requests) for r in replicas.values())
        for path, raw, param in (
            ("/v1/completions", b'{"prompt":"hello","max_tokens":1}', "prompt"),
            ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}]}', "messages"),
        ):
            response = bare.post(path, raw)
            assert response.status_code == 400
            error = response.json()["error"]
            assert "router.tokenizer" in error["message"] and error["param"] == param, error
        assert sum(len(r.state.requests) for r in replicas.values()) == served, "nothing was forwarded"
        assert bare.post("/v1/completions", b'{"prompt":[1,2],"max_tokens":1}').status_code == 200  # ids still route
    finally:
        bare.close()


def test_with_a_tokenizer_text_and_chat_route_on_the_replica_s_tokens(
    router: Router, replicas: dict[str, Replica], tokenizer_dir: Path
) -> None:
    hf = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text = "The router sends each request to the replica that holds most of its prefix. " * 30  # > 2 KiB: a thread
    ids = hf.encode(text, add_special_tokens=True).ids
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    assert router.post("/route", body).json()["prompt_tokens"] == len(ids)
    response = router.post("/v1/completions", body)
    assert response.status_code == 200 and served_by(replicas, response).last_body == body
    assert response.headers["x-kvstore-prompt-blocks"] == str(math.ceil(len(ids) / BLOCK))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text[:300]}]  # inline
    chatml = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    chat_ids = hf.encode(chatml + "<|im_start|>assistant\n", add_special_tokens=False).ids
    body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
    assert router.post("/route", body).json()["prompt_tokens"] == len(chat_ids)
    response = router.post("/v1/chat/completions", body)
    assert response.status_code == 200 and served_by(replicas, response).last_body == body
    assert response.headers["x-kvstore-prompt-blocks"] == str(math.ceil(len(chat_ids) / BLOCK))


def test_a_replica_that_would_compress_is_asked_for_identity() -> None:
    """The answer is relayed as raw bytes, so the replica must not gzip it behind the client's back."""
    gzipping = Replica("g", gzip=True)
    router = Router([gzipping])
    try:
        response = router.post("/v1/completions", b'{"prompt":[1],"max_tokens":2}', **{"accept-encoding": "gzip"})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "t0 t1 "
        assert gzipping.state.requests[-1].headers["accept-encoding"] == "identity"
    finally:
        router.close()
        gzipping.stop()


# ------------------------------------------------------------------ load, retries


def _polled(router: Router, replica: str, field: str, value: object) -> bool:
    """Whether the router's /workers reports ``value`` for the replica within a few health polls."""
    return wait_for(lambda: bool(router.workers()[replica][field] == value), timeout=5)


def route_counts(router: Router, requests: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"a": 0, "b": 0}
    for _ in range(requests):
        body = json.dumps({"prompt": [rng.randrange(1000) for _ in range(40)], "max_tokens": 1}).encode()
        response = router.post("/v1/completions", body)
        assert response.status_code == 200
        counts[response.headers["x-kvstore-replica"]] += 1
    return counts


def test_vllm_waiting_gauge_is_read_and_steers_routing(replicas: dict[str, Replica]) -> None:
    replicas["b"].state.waiting = 50
    replicas["b"].state.running = 7
    replicas["b"].state.kv_usage = 0.5
    blind, steered = Router(list(replicas.values())), Router(list(replicas.values()), waiting_weight=10.0)
    try:
        for router in (blind, steered):
            assert _polled(router, "b", "waiting", 50)
            b = router.workers()["b"]
            assert (b["running"], b["kv_usage"], router.workers()["a"]["waiting"]) == (7, 0.5, 0)
        assert min(route_counts(blind, 20, seed=1).values()) > 0, "waiting_weight = 0: the gauge does not count"
        assert route_counts(steered, 20, seed=1) == {"a": 20, "b": 0}
        decision = steered.post("/route", b'{"prompt":[1,2,3]}').json()
        assert decision["scores"]["b"] - decision["scores"]["a"] == pytest.approx(10.0 * 50)
    finally:
        blind.close()
        steered.close()


def test_a_replica_whose_load_is_not_a_number_is_out_of_routing_and_the_other_serves(
    replicas: dict[str, Replica],
) -> None:
    """NaN is legal Prometheus text; as a load it made every comparison false and every request a 500."""
    replicas["a"].state.kv_usage = float("nan")
    router = Router(list(replicas.values()), unhealthy_after=1)
    try:
        assert wait_for(lambda: router.client.get("/healthz").json()["healthy_replicas"] == 1, timeout=10)
        for _ in range(5):
            answer = router.post("/v1/completions", b'{"prompt":[1,2,3],"max_tokens":1}')
            assert answer.status_code == 200 and answer.headers["x-kvstore-replica"] == "b", answer.text
        assert router.client.get("/workers").status_code == 200 and router.workers()["a"]["healthy"] is False
    finally:
        router.close()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_replica_that_refuses_connections_is_retried_on_the_other(replicas: dict[str, Replica], stream: bool) -> None:
    dead = Replica("dead")
    dead.stop()  # its port now refuses connections
    live = replicas["a"]
    live.state.waiting = 100  # so the router's first choice is the dead replica
    router = Router([live, dead], waiting_weight=1.0, unhealthy_after=1000, health_interval_s=30)
    try:
        assert _polled(router, "a", "waiting", 100)
        assert router.post("/route", b'{"prompt":[1,2,3]}').json()["replica"] == "dead"
        raw = b'{"prompt":[3,1,4,1,5],"max_tokens":2,"stream":%s}' % (b"true" if stream else b"false")
        response = router.post("/v1/completions", raw)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvstore-replica"] == "a" and response.headers["x-kvstore-retried"] == "true"
        assert live.last_body == raw and response.content == live.tap.answers[-1]
        assert not router.workers()["dead"]["healthy"]
    finally:
        router.close()


class BreakingReplica:
    """A replica on a raw socket that answers health polls, then breaks every completion off part way: a stream
    after two SSE chunks, a plain answer after 10 of the 1,000 bytes it announced (its connection aborted)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop
        ).result(10)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if head.startswith(b"GET"):
                    page = b"" if b" /metrics" in head else json.dumps({"data": [{"id": MODEL}]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page))
                    await writer.drain()
                    continue
                if b'"stream":true' in body:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
                    writer.write(b"transfer-encoding: chunked\r\n\r\n")
                    for text in (b"a", b"b"):
                        event = b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % text
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    writer.write(b'10\r\ndata: {"choic')  # half an event, half a chunk
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n")
                    writer.write(b'{"choices":')
                await writer.drain()
                writer.transport.abort()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    def stop(self) -> None:
        async def close() -> None:  # on its loop: an asyncio Server is not thread-safe
            self.server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_replica_that_breaks_off_its_answer_gives_an_error_event_or_a_502_not_a_crash() -> None:
    """A stream whose replica fails after the 200 went out ends with an error event and [DONE] (as a worker's failed
    stream does); a plain answer that breaks off is a 502. Each counted as failed; the router serves on."""
    broken = BreakingReplica()
    config = config_from_dict(
        {"cache": {"block_size": BLOCK}, "router": {"health_interval_s": 0.1, "replicas": [
            {"name": "broken", "url": broken.url, "events": _free_endpoint()}]}}
    )  # fmt: skip
    service = build_router(config)
    server = ServerThread(create_app(service)).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=30)
        assert wait_for(lambda: len(client.get("/v1/models").json()["data"]) > 0, timeout=10)
        streamed = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
        assert streamed.status_code == 200
        events = streamed.content.split(b"\n\n")
        sent = [b'data: {"choices":[{"index":0,"text":"%s"}]}' % text for text in (b"a", b"b")]
        assert events[:2] == sent
        error = json.loads(events[2].removeprefix(b"data: "))["error"]  # the half chunk never went out
        assert error["code"] == 502 and "broken failed mid-stream" in error["message"], error
        assert events[3:] == [b"data: [DONE]", b""]
        plain = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert plain.status_code == 502 and "broken failed while answering" in plain.json()["error"]["message"]
        counted = {
            (s.labels["code"], s.labels["outcome"]): s.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            if family.name == "kvstore_router_requests"
            for s in family.samples
            if s.name == "kvstore_router_requests_total"
        }
        assert counted.get(("2xx", "failed")) == 1 and counted.get(("5xx", "failed")) == 1, counted
        assert client.get("/health").status_code in (200, 503)  # still answering
    finally:
        server.stop()
        broken.stop()


def test_in_a_mixed_fleet_a_request_goes_only_to_replicas_that_serve_its_model(replicas: dict[str, Replica]) -> None:
    """Replicas of two models behind one router: a request naming a model goes to a replica listing it (its
    /v1/models); one naming neither, or none, may go anywhere (an unknown model gets the replica's own 404)."""
    other = Replica("other", model="other-model")
    router = Router([replicas["a"], other])
    try:
        assert wait_for(lambda: {c["id"] for c in router.client.get("/v1/models").json()["data"]}
                        == {MODEL, "other-model"}, timeout=10)  # fmt: skip
        for model, want in ((MODEL, "a"), ("other-model", "other")):
            for i in range(6):
                raw = b'{"model":"%s","prompt":[%d,2,3],"max_tokens":1}' % (model.encode(), i)
                response = router.post("/v1/completions", raw)
                assert response.status_code == 200, response.text
                assert response.headers["x-kvstore-replica"] == want
            assert router.post("/route", b'{"model":"%s","prompt":[1,2]}' % model.encode()).json()["replica"] == want
        unknown = router.post("/v1/completions", b'{"model":"nope","prompt":[1],"max_tokens":1}')
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "The model `nope` does not exist."
    finally:
        router.close()
        other.stop()


def test_the_routers_key_never_reaches_a_replica_and_a_replicas_own_key_is_sent(replicas: dict[str, Replica]) -> None:
    """With router.api_key the client's Authorization is the router's key: it is not passed on. A replica's own
    key (vLLM's --api-key) goes with every forwarded request and every poll; without either, the client's
    header is passed on as sent."""
    replica = replicas["a"]
    spec = {"name": "a", "url": replica.server.url, "events": _free_endpoint(), "api_key": "replica-key"}
    router_section = {"health_interval_s": 0.1, "api_key": "router-secret", "replicas": [spec]}
    config = config_from_dict({"cache": {"block_size": BLOCK}, "router": router_section})
    service = build_router(config)
    server = ServerThread(create_app(service)).start()
    try:
        client = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": "Bearer router-secret"})
        assert wait_for(lambda: len(client.get("/v1/models").json()["data"]) > 0, timeout=10)
        poller = service._replicas["a"].spec.backend._client  # type: ignore[attr-defined]
        assert poller.headers["authorization"] == "Bearer replica-key"  # the polls' client (the stand-in logs no GETs)
        answer = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        sent = replica.state.requests[-1]
        assert sent.path == "/v1/completions" and sent.headers.get("authorization") == "Bearer replica-key"
        assert not any("router-secret" in value for value in sent.headers.values())
    finally:
        server.stop()
    # No keys anywhere: the client's header reaches the replica as it was sent (it may be the replica's key).
    plain = Router([replica])
    try:
        answer = plain.post("/v1/completions", b'{"prompt":[1,2],"max_tokens":1}', authorization="Bearer mine")
        assert answer.status_code == 200 and replica.state.requests[-1].headers.get("authorization") == "Bearer mine"
    finally:
        plain.close()


def test_only_headers_about_the_replicas_connection_stay_behind() -> None:
    upstream = {"content-type": "application/json", "x-request-id": "r1", "content-encoding": "identity",
                "connection": "keep-alive", "keep-alive": "timeout=5", "transfer-encoding": "chunked",
                "content-length": "12", "date": "Fri, 27 Nov 2026 03:00:00 GMT", "server": "uvicorn",
                "x-kvstore-replica": "spoofed", "x-vendor": "v"}  # fmt: skip
    cookies = [("set-cookie", "a=1"), ("set-cookie", "b=2")]
    assert relayed_headers([*upstream.items(), *cookies]) == [
        ("content-type", "application/json"), ("x-request-id", "r1"), ("content-encoding", "identity"),
        ("x-vendor", "v"), *cookies
    ]  # fmt: skip


def test_a_chat_with_its_own_template_is_forwarded_and_the_router_never_runs_it(
    router: Router, replicas: dict[str, Replica]
) -> None:
    """The replica decides whether to run a request's template (vLLM: --trust-request-chat-template); the
    router, not trusting it, routes by load, forwards the body unchanged, and stays responsive."""
    slow = "{% for i in range(100000) %}{% for j in range(500) %}{{ '' }}{% endfor %}{% endfor %}x"
    for template in ("{{ 1/0 }}", slow):
        raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                          "chat_template": template}).encode()  # fmt: skip
        started = time.monotonic()
        response = router.post("/v1/chat/completions", raw)
        assert response.status_code == 200, response.text
        assert served_by(replicas, response).last_body == raw
        assert time.monotonic() - started < 5, "the router rendered the request's template"


@pytest.mark.parametrize("kwargs", [{"tools": 5}, {"documents": 5}, {"tools": "text"}])
def test_a_chat_whose_template_kwargs_cannot_render_is_forwarded_and_routed_by_load(
    router: Router, replicas: dict[str, Replica], kwargs: dict[str, Any]
) -> None:
    """``chat_template_kwargs`` the router's own rendering cannot use (``tools`` that are no list) are the
    replica's to judge: the body goes to it unchanged, routed by load, and ``/route`` answers too -- never a
    500 of the router's with a traceback."""
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "chat_template_kwargs": kwargs}).encode()  # fmt: skip
    response = router.post("/v1/chat/completions", raw)
    assert response.status_code == 200, response.text
    assert served_by(replicas, response).last_body == raw
    routed = router.post("/route", raw)
    assert routed.status_code == 200 and routed.json()["replica"] in replicas, routed.text
