"""``kvstore bench chaos``: steady load while workers die and KV events are lost, for a bounded time.

The deployment is the ``kvstore router`` shape, all in this process and on
127.0.0.1: ``--workers`` KV workers, each behind the OpenAI-compatible front
of ``kvstore worker``, and a RouterService behind the router app. Each
worker's event stream reaches the router through a lossy proxy (SUB from the
worker, PUB to the router; replay and snapshots go to the worker directly).
``--clients`` users send completions back to back (shared prefixes, so the
cache matters).

Two phases of the same load, so the faults are compared against a baseline
measured in the same run:

- **calm** (the first third): no faults;
- **chaos** (the rest): ``--loss`` of the event frames dropped, and every
  ``--kill-every`` seconds a random worker dies abruptly (its in-flight
  requests fail; the router must retry them elsewhere) and a replacement
  joins under a new name.

Reported: requests ok / failed / retried per phase, request latency and the
router's decision time (p50/p99), per kill the time until the dead worker's
blocks left the index and until the replacement served its first request,
the event-stream repairs (gaps, replays, snapshots), how long after the loss
stops the index equals the pools exactly, and whether every pool is intact
afterwards (invariants, no block held).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import random
import statistics
import threading
import time
from collections import Counter
from typing import Any, NamedTuple

import uvicorn
import zmq

from kvstore.benchmarks.lossy_proxy import LossyProxy
from kvstore.benchmarks.outputs import benchmark_command, write_output
from kvstore.deploy.config import Config, load_config
from kvstore.errors import ConfigError
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.router.app import create_app
from kvstore.router.backends import HttpBackend
from kvstore.router.service import ProducerSpec, ReplicaSpec, RouterService
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker

BENCH_DEFAULTS = (
    "worker.device=cpu",
    "worker.max_context=1024",
    "pool.num_blocks=256",
    "router.health_interval_s=0.25",
    "router.unhealthy_after=2",
)


class _Server:
    """uvicorn on 127.0.0.1 (free port) on its own event loop thread; ``call`` runs code on that loop."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.port: int = self.server.servers[0].sockets[0].getsockname()[1]

    def call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


class _Replica(NamedTuple):
    name: str
    worker: KVWorker
    server: _Server
    proxy: LossyProxy


class _Answer(NamedTuple):
    phase: str
    sent_at: float  # monotonic
    status: int  # -1: no HTTP answer
    latency_s: float
    replica: str | None
    retried: bool
    route_s: float | None


class KillReport(NamedTuple):
    at_s: float  # since the start of the run
    victim: str
    replacement: str
    blocks_out_of_index_s: float | None  # None: still indexed after the deadline
    replacement_first_request_s: float | None


class ChaosRun:
    def __init__(self, config: Config, args: argparse.Namespace) -> None:
        self.config = config
        self.args = args
        self.rng = random.Random(args.seed)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.replicas: dict[str, _Replica] = {}
        self.retired: list[_Replica] = []
        self.answers: list[_Answer] = []
        self.phase = "calm"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next_index = 0
        self.vocab = config.worker.vocab_size
        limits = ModelLimits(config.worker.vocab_size, config.worker.max_context)
        self.service = RouterService(config, load_tokenizer(""), limits, seed=args.seed)
        self.router = _Server(create_app(self.service))
        self.prefixes = [self._tokens(self.rng.choice([2, 4, 8]) * config.cache.block_size) for _ in range(16)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add_replica(self) -> str:
        name = f"chaos-{self._next_index}"
        self._next_index += 1
        worker = KVWorker(name, self.config)
        server = _Server(create_worker_app(worker))
        ep = worker.event_endpoints()
        loss = self.args.loss if self.phase == "chaos" else 0.0
        proxy = LossyProxy(self.ctx, ep.endpoint, loss=loss, seed=self.args.seed * 1000 + self._next_index)
        backend = HttpBackend(name, f"http://127.0.0.1:{server.port}", timeout_s=self.config.router.request_timeout_s)
        spec = ReplicaSpec(name, None, backend, ProducerSpec(f"{name}/events", proxy.endpoint, ep.replay_endpoint))
        self.router.call(self.service.add_replica, spec)  # on the router's loop: it owns the registry
        self.replicas[name] = _Replica(name, worker, server, proxy)
        return name

    def kill(self, started: float) -> KillReport:
        victim = self.rng.choice(sorted(self.replicas))
        replica = self.replicas.pop(victim)
        at = time.monotonic()
        replica.worker.shutdown()  # abrupt: in-flight requests fail now, the HTTP front answers 503
        replica.server.stop()
        replica.proxy.close()
        producer = f"{victim}/events"
        deadline = at + 10
        while producer in self.service.index.dump() and time.monotonic() < deadline:
            time.sleep(0.005)
        removed = None if producer in self.service.index.dump() else time.monotonic() - at
        self.router.call(self.service.remove_replica, victim)
        self.retired.append(replica)
        replacement = self.add_replica()
        return KillReport(at - started, victim, replacement, removed, None)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", self.router.port, timeout=60)
        while not self._stop.is_set():
            prompt = rng.choice(self.prefixes) + [rng.randrange(self.vocab) for _ in range(rng.randint(1, 24))]
            body = json.dumps({"prompt": prompt, "max_tokens": rng.randint(1, 8)})
            phase, sent = self.phase, time.monotonic()
            status, headers = -1, {}
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
                response = conn.getresponse()
                response.read()
                status, headers = response.status, {k.lower(): v for k, v in response.getheaders()}
            except (OSError, http.client.HTTPException, ValueError):
                conn.close()
            answer = _Answer(phase, sent, status, time.monotonic() - sent, *routing_of(headers))
            with self._lock:
                self.answers.append(answer)
        conn.close()

    def stop_clients(self) -> None:
        self._stop.set()

    def converged(self) -> bool:
        dump = self.service.index.dump()
        return all(
            dump.get(f"{name}/events", {}).get("GPU", Counter()) == Counter(r.worker.cached_hashes())
            for name, r in self.replicas.items()
        )

    def close(self) -> None:
        self.router.stop()
        for replica in self.replicas.values():
            replica.server.stop()
            replica.worker.shutdown()
            replica.proxy.close()
        self.ctx.destroy(linger=0)


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def routing_of(headers: dict[str, str]) -> tuple[str | None, bool, float | None]:
    """(replica, retried, route seconds) of an answer, from the router's ``x-kvstore-*`` headers (lower-cased
    names). The headers, not the body's ``kvstore`` object: a router without a tokenizer relays token-id
    prompts to the worker as sent, and that answer comes back as the worker wrote it, without the object."""
    route_s = headers.get("x-kvstore-route-s")
    return (
        headers.get("x-kvstore-replica"),
        headers.get("x-kvstore-retried") == "true",
        (None if route_s is None else float(route_s)),
    )


def _phase_row(answers: list[_Answer], seconds: float) -> dict[str, Any]:
    ok = [a for a in answers if a.status == 200]
    route = [a.route_s for a in ok if a.route_s is not None]
    latency = [a.latency_s for a in ok]
    return {
        "requests": len(answers),
        "ok": len(ok),
        "failed": len(answers) - len(ok),
        "retried": sum(a.retried for a in ok),
        "requests_per_s": len(answers) / seconds if seconds else 0.0,
        "latency_p50_s": _pct(latency, 50),
        "latency_p99_s": _pct(latency, 99),
        "decision_p50_s": _pct(route, 50),
        "decision_p99_s": _pct(route, 99),
        "failures": dict(Counter(a.status for a in answers if a.status != 200)),
    }


def _ms(value: float | None, scale: float = 1e3, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.duration) and args.duration >= 3):
        raise ConfigError(f"--duration must be at least 3 seconds, got {args.duration}")
    if args.workers < 2:
        raise ConfigError("--workers must be at least 2 (a killed worker's requests need somewhere to go)")
    if args.clients < 1 or not 0.0 <= args.loss < 1.0 or not (math.isfinite(args.kill_every) and args.kill_every > 0):
        raise ConfigError("--clients must be >= 1, --loss in [0, 1), --kill-every > 0")
    config = load_config(args.config, overrides=(*BENCH_DEFAULTS, *args.set))
    chaos = ChaosRun(config, args)
    kills: list[KillReport] = []
    try:
        for _ in range(args.workers):
            chaos.add_replica()
        threads = [threading.Thread(target=chaos.client, args=(i,), daemon=True) for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        calm_until = started + args.duration / 3
        end = started + args.duration
        time.sleep(max(0.0, calm_until - time.monotonic()))
        chaos.phase = "chaos"
        for replica in chaos.replicas.values():
            replica.proxy.loss = args.loss
        next_kill = time.monotonic() + min(args.kill_every, (end - time.monotonic()) / 2)
        while time.monotonic() < end:
            time.sleep(max(0.0, min(next_kill, end) - time.monotonic()))
            if time.monotonic() >= next_kill and time.monotonic() < end:
                kills.append(chaos.kill(started))
                next_kill += args.kill_every
        # The loss stops; traffic flows a moment longer (a lost tail shows as a gap), then stops.
        loss_stopped = time.monotonic()
        for replica in chaos.replicas.values():
            replica.proxy.loss = 0.0
        time.sleep(0.5)
        chaos.stop_clients()
        for thread in threads:
            thread.join(timeout=120)
        deadline = time.monotonic() + 10
        while not chaos.converged() and time.monotonic() < deadline:
            time.sleep(0.01)
        converged_s = time.monotonic() - loss_stopped if chaos.converged() else None
        for replica in chaos.replicas.values():
            replica.worker.check_invariants()
        held = {name: r.worker.load().kv_usage for name, r in chaos.replicas.items()}
        health = {h.producer: h for h in chaos.service.listener.health()}
        stragglers = sum(thread.is_alive() for thread in threads)
    finally:
        chaos.close()

    kills = [
        k._replace(replacement_first_request_s=min(
            (a.sent_at + a.latency_s - started - k.at_s for a in chaos.answers if a.replica == k.replacement),
            default=None,
        ))
        for k in kills
    ]  # fmt: skip
    calm = _phase_row([a for a in chaos.answers if a.phase == "calm"], args.duration / 3)
    storm = _phase_row([a for a in chaos.answers if a.phase == "chaos"], args.duration * 2 / 3)
    proxies = [r.proxy for r in (*chaos.replicas.values(), *chaos.retired)]
    forwarded, dropped = sum(p.forwarded for p in proxies), sum(p.dropped for p in proxies)
    events: dict[str, int | float | None] = {
        "frames_forwarded": forwarded,
        "frames_dropped": dropped,
        "gaps": sum(h.gaps for h in health.values()),
        "replays": sum(h.replays for h in health.values()),
        "snapshots": sum(h.snapshots for h in health.values()),
        "lossy": sum(h.lossy for h in health.values()),
        "converged_after_loss_stopped_s": converged_s,
    }
    print(
        f"chaos: {args.duration:.0f} s, {args.clients} clients, {args.workers} workers; calm for the first third, "
        f"then {args.loss:.1%} event loss and a worker killed every {args.kill_every:g} s"
    )
    print(f"{'phase':<7}{'requests':>9}{'ok':>7}{'failed':>7}{'retried':>8}{'req/s':>7}"
          f"{'lat p50 ms':>11}{'lat p99 ms':>11}{'route p50 us':>13}{'route p99 us':>13}")  # fmt: skip
    for name, row in (("calm", calm), ("chaos", storm)):
        print(
            f"{name:<7}{row['requests']:>9}{row['ok']:>7}{row['failed']:>7}{row['retried']:>8}"
            f"{row['requests_per_s']:>7.0f}{_ms(row['latency_p50_s']):>11}{_ms(row['latency_p99_s']):>11}"
            f"{_ms(row['decision_p50_s'], 1e6, 0):>13}{_ms(row['decision_p99_s'], 1e6, 0):>13}"
        )
    if calm["latency_p99_s"] and storm["latency_p99_s"]:
        print(f"chaos/calm latency p99: {storm['latency_p99_s'] / calm['latency_p99_s']:.2f}x")
    print(f"{'kill at s':>9}  {'victim':<10}{'replacement':<13}{'blocks out of index ms':>23}"
          f"{'first req on new s':>19}")  # fmt: skip
    for k in kills:
        print(f"{k.at_s:>9.1f}  {k.victim:<10}{k.replacement:<13}{_ms(k.blocks_out_of_index_s):>23}"
              f"{_ms(k.replacement_first_request_s, 1, 2):>19}")  # fmt: skip
    print(
        f"events: {dropped} of {dropped + forwarded} frames "
        f"dropped; {events['gaps']} gaps, {events['replays']} replays, {events['snapshots']} snapshots, "
        f"{events['lossy']} lossy; index == pools {_ms(converged_s)} ms after the loss stopped"
    )
    print(f"pools afterwards: invariants hold, blocks held {held} (0 = all free or cached); "
          f"{stragglers} clients still waiting")  # fmt: skip
    if args.json:
        report = {
            "benchmark": "chaos",
            "baseline": "the same load without faults (calm phase), same run",
            "duration_s": args.duration,
            "clients": args.clients,
            "workers": args.workers,
            "loss": args.loss,
            "kill_every_s": args.kill_every,
            "phases": {"calm": calm, "chaos": storm},
            "kills": [k._asdict() for k in kills],
            "events": events,
            "kv_usage_after": held,
            "clients_still_waiting": stragglers,
        }
        write_output("--json", args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if stragglers == 0 and converged_s is not None and not any(held.values()) else 1


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("chaos", help="load while workers die and KV events are lost; calm phase as baseline")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load (a third calm, the rest chaos)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--workers", type=int, default=2, help="KV workers (a killed one is replaced)")
    p.add_argument("--kill-every", type=float, default=8.0, help="seconds between worker kills in the chaos phase")
    p.add_argument("--loss", type=float, default=0.01, help="share of event frames dropped in the chaos phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None, help="TOML config (over the benchmark defaults)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=benchmark_command(run))
