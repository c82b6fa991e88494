"""``kvstore serve``: the whole service, on an embedded local Ray or on a Ray cluster.

Checks that this node's /dev/shm can hold the CPU arena (:mod:`kvstore.deploy.shm`),
starts the deployment (:mod:`kvstore.deploy.launcher`), binds the router's HTTP
socket itself (so ``--port 0`` works and the printed URL is the real one),
prints the URLs and a curl line to try, and serves until SIGINT/SIGTERM, while
:mod:`kvstore.deploy.supervisor` replaces dead workers.

A signal at any moment -- Ray starting, actors being placed, serving -- stops
it in order (:mod:`kvstore.deploy.signals`): requests in flight get
``router.drain_timeout_s``, then the HTTP server stops, the actors shut down
(sockets closed, the arena unlinked) and, when it started Ray, Ray shuts down;
any process Ray left behind is stopped too (:mod:`kvstore.deploy.reaper`).
Exit status 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import uvicorn

from kvstore.deploy.config import Config, load_config
from kvstore.deploy.http_server import bind_socket, port_number, server_config
from kvstore.deploy.launcher import Deployment, launch
from kvstore.deploy.model_args import add_model_arguments, model_overrides, with_router_defaults
from kvstore.deploy.reaper import become_subreaper, stop_children
from kvstore.deploy.shm import check_arena_fits
from kvstore.deploy.signals import stop_on_signals
from kvstore.deploy.supervisor import WorkerSupervisor
from kvstore.errors import ConfigError
from kvstore.heap import freeze_startup_heap
from kvstore.router.app import create_app


def check_one_port_per_producer(config: Config) -> None:
    """kvstore serve starts several event publishers on a node (its tier and each worker), all from one
    ``[events]`` section: a fixed port would be bound by the first and refused to the rest."""
    events = config.events
    if not events.enabled:
        raise ConfigError(
            "events.enabled = false: kvstore serve's router builds its prefix index from the workers' and tiers' "
            "KV events, so they must be on (a router in front of replicas without events: kvstore router)"
        )
    if not events.bind:
        return
    for field, endpoint in (("endpoint", events.endpoint), ("replay_endpoint", events.replay_endpoint)):
        if not endpoint.endswith("*"):
            raise ConfigError(
                f"events.{field} = {endpoint!r}: kvstore serve binds one publisher per worker and per node's tier, "
                "so the port must be * (each takes a free one; the router learns them)"
            )


def run(args: argparse.Namespace) -> int:
    overrides = [*model_overrides(args), *args.set]
    if args.workers is not None:
        if args.workers < 1:
            raise ConfigError("--workers must be >= 1")
        overrides.append(f"worker.num_workers={args.workers}")
    config = with_router_defaults(load_config(args.config, overrides=overrides))
    check_one_port_per_producer(config)
    host = args.host or config.router.host
    port = config.router.port if args.port is None else args.port
    arena = check_arena_fits(config.tiers)
    become_subreaper()  # what Ray leaves orphaned comes back to us, to be stopped on the way out
    with stop_on_signals() as signals:
        sock = bind_socket(host, port, "the router")
        try:
            deployment = launch(config, address=args.address)
        except (KeyboardInterrupt, SystemExit):  # SystemExit: Ray's own SIGTERM handler, while Ray starts
            with signals.shielded():
                sock.close()
                stop_children()
                print("kvstore stopped before it was serving", file=sys.stderr, flush=True)
            return 0
        try:
            _banner(config, deployment, f"http://{host}:{sock.getsockname()[1]}", arena)
            supervisor = WorkerSupervisor(deployment)
            app = create_app(deployment.service, tasks=[supervisor.run])
            server = uvicorn.Server(server_config(app, config.router, lifespan="on"))
            freeze_startup_heap()
            # uvicorn catches SIGINT/SIGTERM itself while it serves, drains, and re-raises the signal on its way
            # out, still inside its event loop: raising there would tear down its lifespan task mid-shutdown.
            with signals.shielded():
                server.run(sockets=[sock])
        except KeyboardInterrupt:  # StopRequested, or what Ray made of it inside a blocking call
            pass
        finally:
            with signals.shielded():
                sock.close()
                deployment.stop()
                stop_children()
                print("kvstore stopped", file=sys.stderr, flush=True)
    return 0


def _banner(config: Config, deployment: Deployment, url: str, arena: str) -> None:
    count = len(deployment.workers)
    print(f"kvstore is serving {count} worker{'s' if count != 1 else ''} at {url}", flush=True)
    print(f"  model:       {config.router.model_name}", flush=True)
    disk = config.tiers.disk_dir if config.tiers.enabled else None
    disk_line = f"; disk {config.tiers.disk_capacity_bytes / 1024**3:g} GiB in {disk}" if disk else ""
    print(f"  tiers:       {arena}{disk_line}", flush=True)
    print(f"  openai api:  {url}/v1  (completions, chat/completions, models)   route: {url}/route", flush=True)
    print(f"  workers:     {url}/workers   health: {url}/healthz   metrics: {url}/metrics", flush=True)
    for worker in deployment.workers:
        print(f"  events {worker.name}: {worker.endpoint} (replay {worker.replay_endpoint})", flush=True)
    for tier in deployment.tiers:
        print(f"  events tier {tier.node}: {tier.endpoint} (replay {tier.replay_endpoint})", flush=True)
    example = json.dumps({"prompt": "The KV cache makes the second request faster.", "max_tokens": 8})
    auth = " -H 'authorization: Bearer <router.api_key>'" if config.router.api_key else ""  # the key is not shown
    print(f"  try: curl -s {url}/v1/completions{auth} -H 'content-type: application/json' -d '{example}'", flush=True)


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="run workers, tiers and the router on Ray (embedded by default)")
    p.add_argument("--address", default=None, help="Ray cluster address ('auto' to join); default: embedded Ray")
    p.add_argument("--config", default=None, help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    p.add_argument("--workers", type=int, default=None, help="KV workers to start (default: sized to the cluster)")
    add_model_arguments(p)
    p.add_argument("--host", default=None, help="router bind address (default router.host, 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=None, help="router port (default router.port, 8000; 0 = any free)"
    )
    p.set_defaults(func=run)
