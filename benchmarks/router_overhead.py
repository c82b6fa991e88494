"""``kvstore bench overhead``: what ``kvstore router`` adds to a stream's latency in front of a vLLM server.

Separate processes on 127.0.0.1:

- a vLLM stand-in (:mod:`kvstore.benchmarks.standin_replica`) under uvicorn,
  streaming every answer as vLLM does, its first chunk ``--ttft-ms`` after
  the request and the next ones ``--itl-ms`` apart;
- ``kvstore router`` (``python -m kvstore router --config``) with that one
  stand-in as its replica. Routing runs in full: the body is read, the
  prompt taken as ids or tokenised (``--prompts text``), hashed and looked
  up. With ``--index warm`` (the default) this process first publishes, as
  the stand-in's KV events, every block of every prompt, so the router
  hashes and walks each whole prompt -- the most routing can cost; with
  ``cold`` the index is empty and the walk stops at the first block;
- a TCP relay: a few lines of asyncio that pipe bytes to the stand-in and
  back, parsing nothing -- the floor any extra hop through a Python process
  costs on this machine, so the router's own work reads as router minus
  relay;
- this process, the load generator: ``--streams`` clients, each keeping one
  streamed completion in flight on its own keep-alive connection (a closed
  loop), started evenly over one request's duration so arrivals are spread
  rather than in lockstep bursts.

Each repeat runs every arm on the same stand-in -- the baseline, clients
calling the stand-in directly, then through the relay and through the
router -- in an order rotated from one repeat to the next, so drift on a
shared machine falls on all of them. TTFT is the time from sending the
request to receiving the first bytes of its first SSE event; total is to
``data: [DONE]``. The first ``--warmup`` requests of each stream are not
counted (connections, the router's upstream pool).

The load generator speaks HTTP/1.1 itself (a few lines over asyncio
streams): a general client library would spend more CPU per chunk than the
router under test, and on a small machine that CPU is taken from the
processes being measured. The CPU seconds the router and the stand-in
burn per request (idle time included) are read from ``/proc``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.config import CacheConfig, EventsConfig
from kvstore.errors import ConfigError
from kvstore.events import BlockStored
from kvstore.hashing import BlockHasher, to_external
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.publisher import ZmqEventPublisher

MODEL = "standin-model"
ARMS = ("direct", "relay", "router")
_WORDS = ("cache", "block", "prefix", "router", "replica", "token", "prefill", "decode", "tier", "event", "the", "a")


class Sample(NamedTuple):
    ttft_s: float
    total_s: float
    events: int


class ArmStats(NamedTuple):
    """One arm's latencies over every repeat, and the CPU its server processes spent per request."""

    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    total_p50_ms: float
    total_p99_ms: float
    proxy_cpu_ms_per_request: float | None  # the relay's or the router's (None: direct, or no /proc)
    standin_cpu_ms_per_request: float | None


class Settings(NamedTuple):
    streams: int
    requests: int  # per stream, per arm and repeat, after the warm-up
    warmup: int
    max_tokens: int
    ttft_s: float
    itl_s: float
    prompt_tokens: int  # token ids, or words of text
    text: bool
    warm_index: bool


class Ports(NamedTuple):
    """Where each arm's clients connect, and the pid of the process between them and the stand-in."""

    port: dict[str, int]
    pid: dict[str, int]  # "standin", "relay", "router"


# ----------------------------------------------------------------- load generator


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


def _request(port: int, body: bytes) -> bytes:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _stream_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> Sample:
    """Send one streamed completion on an open connection and read its SSE answer to the end (chunked HTTP/1.1)."""
    start = time.perf_counter()
    writer.write(request)
    status = await reader.readline()
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected answer: {status!r} {await reader.read(500)!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    if not chunked:
        raise RuntimeError("expected a chunked event stream")
    first: float | None = None
    events = 0
    tail = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            break
        data = await reader.readexactly(size + 2)
        if first is None:
            first = time.perf_counter()
        events += data.count(b"data: ")
        tail = (tail + data[:-2])[-32:]
    end = time.perf_counter()
    if first is None or not tail.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"the stream did not end with data: [DONE] ({tail!r})")
    return Sample(first - start, end - start, events)


async def _run_arm(port: int, bodies: Sequence[bytes], settings: Settings, stagger_s: float) -> list[Sample]:
    """``settings.streams`` closed-loop clients on ``port``; the samples after each stream's warm-up."""
    connections = [await _open(port) for _ in range(settings.streams)]

    async def client(index: int) -> list[Sample]:
        reader, writer = connections[index]
        request = _request(port, bodies[index % len(bodies)])
        await asyncio.sleep(index * stagger_s)
        samples = [await _stream_once(reader, writer, request) for _ in range(settings.warmup + settings.requests)]
        return samples[settings.warmup :]

    try:
        per_stream = await asyncio.gather(*(client(i) for i in range(settings.streams)))
    finally:
        for _, writer in connections:
            writer.close()
    return [s for samples in per_stream for s in samples]


# ------------------------------------------------------------------ processes


def serve_standin(port: int, ttft_s: float, itl_s: float) -> None:
    """The stand-in's process: uvicorn on ``port`` (what ``python -c`` runs)."""
    import uvicorn

    from kvstore.benchmarks.standin_replica import StandinState, create_standin_app

    state = StandinState(MODEL, ttft_s=ttft_s, itl_s=itl_s)
    state.record = lambda item: None  # type: ignore[method-assign]  # a benchmark keeps no bodies
    uvicorn.run(create_standin_app(state), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_relay(port: int, target: int) -> None:
    """The relay's process: every connection on ``port`` piped, byte for byte, to ``target`` and back."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(accept, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (None where /proc is not there)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s")


@contextmanager
def _processes(settings: Settings, tokenizer: str, events: ZmqEventPublisher, workdir: Path) -> Iterator[Ports]:
    """The stand-in, the relay and the router, each in its own process."""
    port = {arm: _free_port() for arm in ARMS}
    call = "from kvstore.benchmarks.router_overhead import serve_standin, serve_relay; "
    standin_code = f"{call}serve_standin({port['direct']}, {settings.ttft_s!r}, {settings.itl_s!r})"
    relay_code = f"{call}serve_relay({port['relay']}, {port['direct']})"
    config = workdir / "router.toml"
    config.write_text(
        "[router]\n"
        f'host = "127.0.0.1"\nport = {port["router"]}\nhealth_interval_s = 0.5\ntokenizer = {json.dumps(tokenizer)}\n'
        "[[router.replicas]]\n"
        f'name = "standin"\nurl = "http://127.0.0.1:{port["direct"]}"\n'
        f'events = "{events.endpoint}"\nreplay = "{events.replay_endpoint}"\n'
    )
    commands = {
        "standin": [sys.executable, "-c", standin_code],
        "relay": [sys.executable, "-c", relay_code],
        "router": [sys.executable, "-m", "kvstore", "router", "--config", str(config)],
    }
    started: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, command in commands.items():
            started[name] = subprocess.Popen(command)
        _wait_ready(f"http://127.0.0.1:{port['direct']}/v1/models", started["standin"])
        _wait_ready(f"http://127.0.0.1:{port['relay']}/v1/models", started["relay"])
        _wait_ready(f"http://127.0.0.1:{port['router']}/healthz", started["router"])
        yield Ports(port, {name: process.pid for name, process in started.items()})
    finally:
        for process in reversed(started.values()):
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ------------------------------------------------------------------- prompts


def _tokenizer_for_text(path: str | None, workdir: Path) -> str:
    """``path``, or a byte-level BPE trained here on a small corpus (nothing is downloaded)."""
    if path:
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    corpus = [" ".join(_word(rng) for _ in range(50)) for _ in range(200)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    file = workdir / "tokenizer.json"
    tokenizer.save(str(file))
    return str(file)


def _prompts(settings: Settings, seed: int) -> list[Any]:
    """One prompt per stream: ``prompt_tokens`` random ids, or text of that many words."""
    rng = random.Random(seed)
    if settings.text:
        return [" ".join(_word(rng) for _ in range(settings.prompt_tokens)) for _ in range(settings.streams)]
    return [[rng.randrange(32000) for _ in range(settings.prompt_tokens)] for _ in range(settings.streams)]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS) + str(rng.randrange(100))


def _body(prompt: Any, settings: Settings, rng: random.Random) -> bytes:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": settings.max_tokens, "stream": True,
            "temperature": 0.7, "top_p": 0.95, "seed": rng.randrange(1 << 30)}  # fmt: skip
    return json.dumps(body).encode()


def _publish_prompts(events: ZmqEventPublisher, token_ids: Sequence[Sequence[int]]) -> int:
    """Every full block of every prompt, as stored on the stand-in's GPU (hashed as the router hashes)."""
    cache = CacheConfig()
    hasher = BlockHasher.from_config(cache)
    blocks = 0
    for ids in token_ids:
        hashes: list[int] = [to_external(h) for h in hasher.hash_blocks(ids)]
        stored = len(hashes) * cache.block_size
        events.publish([BlockStored(hashes, None, list(ids[:stored]), cache.block_size, None, "GPU", None)])
        blocks += len(hashes)
    return blocks


def _wait_indexed(router_port: int, body: bytes, blocks: int, timeout_s: float = 30.0) -> None:
    """Until the router's index holds the whole prompt of ``body`` (the replay of the published events)."""
    deadline = time.monotonic() + timeout_s
    matched = 0
    while time.monotonic() < deadline:
        decision = httpx.post(f"http://127.0.0.1:{router_port}/route", content=body, timeout=5).json()
        matched = sum(decision["matched_blocks"]["standin"].values())
        if matched >= blocks:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the router indexed {matched} of the prompt's {blocks} blocks in {timeout_s:.0f} s")


# ------------------------------------------------------------------- the run


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stats(samples: Sequence[Sample], proxy_cpu: float | None, standin_cpu: float | None) -> ArmStats:
    ttft = [s.ttft_s * 1e3 for s in samples]
    total = [s.total_s * 1e3 for s in samples]
    n = len(samples)
    return ArmStats(
        n,
        statistics.median(ttft),
        _percentile(ttft, 0.9),
        _percentile(ttft, 0.99),
        statistics.median(total),
        _percentile(total, 0.99),
        None if proxy_cpu is None else proxy_cpu / n * 1e3,
        None if standin_cpu is None else standin_cpu / n * 1e3,
    )


def measure(settings: Settings, repeats: int, tokenizer: str | None, seed: int) -> dict[str, Any]:
    """Every arm, ``repeats`` times in rotated order; the JSON report of one prompt kind."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvstore-overhead-") as tmp:
        workdir = Path(tmp)
        router_tokenizer = _tokenizer_for_text(tokenizer, workdir) if settings.text else ""
        prompts = _prompts(settings, seed)
        bodies = [_body(prompt, settings, rng) for prompt in prompts]
        token_ids = (
            [load_tokenizer(router_tokenizer).encode(p, add_special_tokens=True) for p in prompts]
            if settings.text
            else prompts
        )
        stagger = (settings.ttft_s + settings.itl_s * (settings.max_tokens - 1)) / settings.streams
        samples: dict[str, list[Sample]] = {arm: [] for arm in ARMS}
        cpu: dict[str, dict[str, float | None]] = {arm: {"proxy": 0.0, "standin": 0.0} for arm in ARMS}
        per_repeat: list[dict[str, Any]] = []
        events = ZmqEventPublisher(EventsConfig())
        try:
            if settings.warm_index:
                _publish_prompts(events, token_ids)
            with _processes(settings, router_tokenizer, events, workdir) as ports:
                if settings.warm_index:
                    _wait_indexed(ports.port["router"], bodies[-1], len(token_ids[-1]) // CacheConfig().block_size)
                for repeat in range(repeats):
                    order = ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]
                    medians: dict[str, float] = {}
                    for arm in order:
                        pids = {"proxy": ports.pid.get(arm), "standin": ports.pid["standin"]}
                        before = {name: _cpu_seconds(pid) if pid else None for name, pid in pids.items()}
                        got = asyncio.run(_run_arm(ports.port[arm], bodies, settings, stagger))
                        for name, pid in pids.items():
                            now, then, spent = (_cpu_seconds(pid) if pid else None), before[name], cpu[arm][name]
                            cpu[arm][name] = (
                                None if now is None or then is None or spent is None else spent + now - then
                            )
                        samples[arm].extend(got)
                        medians[arm] = statistics.median(s.ttft_s for s in got) * 1e3
                    per_repeat.append({"order": list(order), **{f"{arm}_ttft_p50_ms": medians[arm] for arm in ARMS}})
        finally:
            events.close()
    stats = {arm: _stats(samples[arm], cpu[arm]["proxy"], cpu[arm]["standin"]) for arm in ARMS}
    direct, relay, routed = stats["direct"], stats["relay"], stats["router"]
    added = [r["router_ttft_p50_ms"] - r["direct_ttft_p50_ms"] for r in per_repeat]
    return {
        "settings": settings._asdict(),
        "repeats": repeats,
        "prompt_token_ids": statistics.mean(len(ids) for ids in token_ids),
        "router_tokenizer": (tokenizer or "a trained byte-level BPE (2,000 ids)") if settings.text else None,
        "baseline": "direct: the same clients calling the stand-in without the router",
        "arms": {arm: s._asdict() for arm, s in stats.items()},
        "added_ttft_p50_ms": routed.ttft_p50_ms - direct.ttft_p50_ms,
        "added_ttft_p50_ms_median_of_repeats": statistics.median(added),
        "added_ttft_p90_ms": routed.ttft_p90_ms - direct.ttft_p90_ms,
        "added_ttft_p99_ms": routed.ttft_p99_ms - direct.ttft_p99_ms,
        "added_total_p50_ms": routed.total_p50_ms - direct.total_p50_ms,
        "ttft_p50_ratio": routed.ttft_p50_ms / direct.ttft_p50_ms,
        "relay_added_ttft_p50_ms": relay.ttft_p50_ms - direct.ttft_p50_ms,
        "per_repeat": per_repeat,
        "events_per_stream": samples["router"][0].events if samples["router"] else 0,
    }


def _print(report: dict[str, Any]) -> None:
    s = report["settings"]
    n = s["prompt_tokens"]
    prompt = f"{n} words of text ({report['prompt_token_ids']:.0f} tokens)" if s["text"] else f"{n} token ids"
    print(
        f"router overhead: {s['streams']} concurrent streams, {s['requests']} requests each per arm and repeat "
        f"({report['repeats']} repeats, rotated order); prompts of {prompt}, "
        f"{'warm' if s['warm_index'] else 'cold'} index; stand-in TTFT {s['ttft_s'] * 1e3:.0f} ms, "
        f"ITL {s['itl_s'] * 1e3:.0f} ms, {s['max_tokens']} tokens; {os.cpu_count()} CPUs for 4 processes"
    )
    print(f"{'arm':<8}{'requests':>9}{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'total p50':>11}{'p99':>8}"
          f"{'proxy CPU/req':>15}{'stand-in CPU/req':>18}")  # fmt: skip

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for arm, a in report["arms"].items():
        print(
            f"{arm:<8}{a['requests']:>9}{a['ttft_p50_ms']:>10.2f}{a['ttft_p90_ms']:>8.2f}{a['ttft_p99_ms']:>8.2f}"
            f"{a['total_p50_ms']:>11.1f}{a['total_p99_ms']:>8.1f}"
            f"{ms(a['proxy_cpu_ms_per_request']):>15}{ms(a['standin_cpu_ms_per_request']):>18}"
        )
    print(
        f"the router adds {report['added_ttft_p50_ms']:.2f} ms to TTFT p50 ({report['ttft_p50_ratio']:.3f}x direct; "
        f"median over repeats {report['added_ttft_p50_ms_median_of_repeats']:.2f} ms), "
        f"{report['added_ttft_p99_ms']:.2f} ms to p99, {report['added_total_p50_ms']:.2f} ms to total p50; "
        f"a bare TCP relay adds {report['relay_added_ttft_p50_ms']:.2f} ms (times and CPU in ms)"
    )


def run(args: argparse.Namespace) -> int:
    for name in ("streams", "requests", "repeats", "max_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or not all(math.isfinite(ms) and ms >= 0 for ms in (args.ttft_ms, args.itl_ms)):
        raise ConfigError("--warmup, --ttft-ms and --itl-ms must be >= 0")
    reports = {}
    for text in (False, True) if args.prompts == "both" else (args.prompts == "text",):
        settings = Settings(
            args.streams, args.requests, args.warmup, args.max_tokens, args.ttft_ms / 1e3, args.itl_ms / 1e3,
            args.prompt_tokens, text, args.index == "warm",
        )  # fmt: skip
        report = measure(settings, args.repeats, args.tokenizer, args.seed)
        _print(report)
        reports["text" if text else "token_ids"] = report
    if args.json:
        out = {"benchmark": "overhead", "cpu_count": os.cpu_count(), "machine": platform.machine(),
               "python": platform.python_version(), "runs": reports}  # fmt: skip
        write_output("--json", args.json, json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "overhead", help="TTFT a stream gains through `kvstore router` vs calling a vLLM stand-in directly"
    )
    p.add_argument("--streams", type=int, default=64, help="concurrent streams (closed loop, one connection each)")
    p.add_argument("--requests", type=int, default=5, help="timed requests per stream, per arm and repeat")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first, per stream, arm and repeat")
    p.add_argument("--repeats", type=int, default=6, help="rounds of every arm, order rotated")
    p.add_argument("--max-tokens", type=int, default=32, help="SSE chunks (tokens) per answer")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="the stand-in's time to its first chunk")
    p.add_argument("--itl-ms", type=float, default=20.0, help="the stand-in's time between chunks")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length (token ids, or words of text)")
    p.add_argument("--prompts", choices=("ids", "text", "both"), default="both",
                   help="token-id prompts, text prompts (the router tokenises them), or one run of each")  # fmt: skip
    p.add_argument("--index", choices=("warm", "cold"), default="warm",
                   help="warm: the router's index holds every prompt (it hashes all of it); cold: empty")  # fmt: skip
    p.add_argument("--tokenizer", default=None,
                   help="the router's tokenizer for text prompts (model directory or tokenizer.json); "
                        "default: a byte-level BPE trained on the spot")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
