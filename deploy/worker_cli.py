"""``kvstore worker``: one KV worker behind its OpenAI-compatible HTTP front, no Ray.

Its HTTP server takes the ``router`` section's limits, as every front does (:mod:`kvstore.deploy.http_server`).
"""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from kvstore.deploy.config import Config, load_config
from kvstore.deploy.http_server import bind_socket, port_number, server_config
from kvstore.deploy.model_args import add_model_arguments, model_overrides
from kvstore.heap import freeze_startup_heap
from kvstore.workers.http import create_worker_app
from kvstore.workers.worker import KVWorker


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=[*model_overrides(args), *args.set])
    sock = bind_socket(args.host, args.port, f"worker {args.name}")  # before the model loads: a taken port fails fast
    try:
        return _serve(args, config, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, config: Config, sock: socket.socket) -> int:
    worker = KVWorker(args.name, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            worker.shutdown()

    app = create_worker_app(
        worker,
        bounds=config.router.body_bounds(),
        trust_template=config.router.trust_request_chat_template,
        tool_parser=config.router.tool_call_parser or None,
        reasoning_parser=config.router.reasoning_parser or None,
    )
    app.router.lifespan_context = lifespan
    endpoints = worker.event_endpoints()
    served = worker.served
    print(f"kvstore worker {args.name}: {served.name!r} ({served.spec.architecture}, {served.dtype}) "
          f"on {worker.device} at http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr)  # fmt: skip
    print(f"  events: {endpoints.endpoint}  replay: {endpoints.replay_endpoint}", file=sys.stderr, flush=True)
    # The router section's HTTP limits (timeouts, connections, body bounds) hold for this front too.
    server = uvicorn.Server(server_config(app, config.router))
    freeze_startup_heap()
    server.run(sockets=[sock])
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("worker", help="one KV worker with an OpenAI-compatible HTTP front (no Ray)")
    p.add_argument("--name", default="worker-0")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8100, help="port (0 = any free)")
    p.add_argument("--config", default=None, help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    add_model_arguments(p)
    p.set_defaults(func=run)
