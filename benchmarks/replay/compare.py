"""``kvstore replay --compare``: the same workload against three in-process deployments.

Runs, in order, each on fresh workers (cold caches) and its own router:

- ``kvstore``: cache-aware routing (``router.policy = "kvstore"``);
- ``round_robin``: the same workers and caches, cache-blind routing
  (``router.policy = "round_robin"``);
- ``no_cache``: prefix caching off in the workers
  (``cache.enable_prefix_caching = false``); the router still scores, but
  with nothing cached it balances load only.

Ray is started once (embedded, unless the caller already initialised it)
and kept up across the three runs: :func:`kvstore.deploy.launcher.launch` then
leaves Ray alone, and :meth:`Deployment.stop` only kills the run's actors.
Each router is the real app (:func:`kvstore.router.app.create_app`) under uvicorn
on ``127.0.0.1`` with a free port, in a thread of this process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import httpx
import ray
import uvicorn

from kvstore.benchmarks.replay.client import RunResult, Schedule, run_replay
from kvstore.benchmarks.replay.workload import Workload
from kvstore.deploy.config import Config, load_config
from kvstore.deploy.launcher import NAMESPACE, Deployment, launch
from kvstore.errors import ConfigError
from kvstore.router.app import create_app
from kvstore.worker_api import GenerateRequest

logger = logging.getLogger(__name__)

RUNS: dict[str, tuple[str, ...]] = {
    "kvstore": ("router.policy=kvstore",),
    "round_robin": ("router.policy=round_robin",),
    "no_cache": ("cache.enable_prefix_caching=false",),
}
"""Run label -> config overrides applied after the caller's (so they win)."""

BASE_OVERRIDES: tuple[str, ...] = ("worker.device=cpu", "pool.num_blocks=4096", "tiers.enabled=false")
"""Applied before the caller's ``--set``: the small CPU model with a finite GPU-pool cache and no
lower tiers, so the three runs differ only in routing and caching."""


class RouterThread:
    """The router app under uvicorn on 127.0.0.1 with a free port, in a daemon thread.

    ``start`` returns once the socket listens (the app's lifespan has
    started the service); ``stop`` makes uvicorn exit, which closes the
    service, and joins the thread.
    """

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="replay-router", daemon=True)
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> RouterThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the router's uvicorn server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


class CompareRun(NamedTuple):
    label: str
    overrides: list[str]  # the full override list of this run's config
    result: RunResult


def run_config(label: str, config_path: str | None, overrides: Sequence[str]) -> tuple[Config, list[str]]:
    """The config of run ``label``: file < BASE_OVERRIDES < ``overrides`` < the run's own."""
    full = [*BASE_OVERRIDES, *overrides, *RUNS[label]]
    return load_config(config_path, overrides=full), full


@contextmanager
def embedded_ray(num_workers: int) -> Iterator[None]:
    """Ray for the comparison: the caller's when already initialised, else a local one shut down on exit.

    A local Ray gets at least ``num_workers`` logical CPUs, so every worker
    actor (one CPU each) is placed even on a machine with fewer cores.
    """
    if ray.is_initialized():
        yield
        return
    ray.init(
        namespace=NAMESPACE,
        num_cpus=max(os.cpu_count() or 1, num_workers),
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def serve_in_process(config: Config, num_workers: int) -> Iterator[tuple[str, Deployment]]:
    """A deployment on the current Ray and a router in front of it; yields (router URL, deployment).

    On exit the router stops (closing the service), the actors are killed,
    and their names are free again, so the next run can reuse them.
    """
    assert ray.is_initialized(), "call inside embedded_ray()"
    deployment = launch(config, num_workers=num_workers)
    names = [f"kvstore-{w.name}" for w in deployment.workers]
    try:
        _warm_up(deployment, config)
        server = RouterThread(create_app(deployment.service)).start()
        try:
            _wait_until_routable(server.url, len(names))
            yield server.url, deployment
        finally:
            server.stop()
    finally:
        deployment.stop()
        _wait_until_gone(names)


def run_comparison(
    workload: Workload,
    schedule: Schedule,
    *,
    num_workers: int,
    config_path: str | None,
    overrides: Sequence[str],
    progress: bool,
    timeout_s: float,
) -> list[CompareRun]:
    """Replay ``workload`` on ``schedule`` against each of :data:`RUNS`, in order (module docstring)."""
    if num_workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {num_workers}")
    configs = {label: run_config(label, config_path, overrides) for label in RUNS}  # all validated up front
    runs = []
    with embedded_ray(num_workers):
        for label, (config, full) in configs.items():
            with serve_in_process(config, num_workers) as (url, _):
                result = asyncio.run(run_replay(url, workload, schedule, timeout_s=timeout_s, progress=progress,
                                                label=label))  # fmt: skip
            runs.append(CompareRun(label, full, result))
    return runs


def _warm_up(deployment: Deployment, config: Config) -> None:
    """One short request per worker, straight to its actor, so the first replayed request pays no start-up."""
    rng = random.Random(f"warm-up/{config.cache.hash_seed}")
    vocab = config.worker.vocab_size
    requests = [
        worker.handle.generate.remote(GenerateRequest([rng.randrange(vocab) for _ in range(48)], 2))
        for worker in deployment.workers
    ]
    ray.get(requests, timeout=120)


def _wait_until_routable(url: str, replicas: int, timeout_s: float = 30.0) -> None:
    """Until the router lists ``replicas`` healthy replicas whose event streams are in sync."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            workers = client.get("/workers").json()["workers"]
            ready = [w for w in workers if w["healthy"] and w["events"] is not None and w["events"]["syncing"] is None]
            if len(ready) == replicas:
                return
            time.sleep(0.05)
    logger.warning("router at %s: not every replica's event stream synced within %.0f s", url, timeout_s)


def _wait_until_gone(actor_names: Sequence[str], timeout_s: float = 30.0) -> None:
    """Until no actor of ``actor_names`` is registered (a killed actor's name is released asynchronously)."""
    deadline = time.monotonic() + timeout_s
    for name in actor_names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.1)
