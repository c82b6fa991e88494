"""``kvstore router``: the router alone, in front of external OpenAI-compatible replicas.

For a vLLM fleet (or ``kvstore worker`` processes) with no Ray: the config's
``[[router.replicas]]`` lists each replica's URL and KV event endpoints. A
replica that hashes differently (another algorithm or seed) sets
``rekey = true`` and is re-keyed from the token ids in its events.
"""

from __future__ import annotations

import argparse
import sys
from urllib.parse import urlsplit

import uvicorn

from kvstore.deploy.config import Config, load_config
from kvstore.deploy.http_server import bind_socket, port_number, server_config
from kvstore.errors import ConfigError
from kvstore.heap import freeze_startup_heap
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import load_tokenizer
from kvstore.router.app import create_app
from kvstore.router.backends import HttpBackend
from kvstore.router.service import ProducerSpec, ReplicaSpec, RouterService


def check_replica_url(name: str, url: str) -> None:
    """ConfigError unless ``url`` is http(s)://host[:port][/prefix] with a port in 1..65535."""
    where = f"router.replicas[{name}].url"
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where} must start with http:// or https://, got {url!r}")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError for a port that is no number or out of range
    except ValueError as exc:
        raise ConfigError(f"{where}: {url!r} is not a usable URL ({exc})") from None
    if not parts.hostname:
        raise ConfigError(f"{where}: {url!r} names no host")
    if port == 0:
        raise ConfigError(f"{where}: {url!r}: port 0 is no replica's port")


def build_router(config: Config) -> RouterService:
    """A RouterService over the configured external replicas (not started)."""
    replicas = config.router.replicas
    if not replicas:
        raise ConfigError(
            "router.replicas is empty: add a [[router.replicas]] table per replica with name, url and events"
        )
    names = [r.name for r in replicas]
    if len(set(names)) != len(names):
        raise ConfigError(f"router.replicas: names must be unique, got {names}")
    for r in replicas:
        check_replica_url(r.name, r.url)
        for field, value in (("events", r.events), ("replay", r.replay)):
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"router.replicas[{r.name}].{field} must be a tcp:// or ipc:// endpoint")
    limits = ModelLimits(config.router.vocab_size or None, config.router.max_context or None)
    # No tokenizer: token-id prompts only (a text prompt is refused, naming router.tokenizer).
    tokenizer = load_tokenizer(config.router.tokenizer) if config.router.tokenizer else None
    service = RouterService(config, tokenizer, limits)
    client_keys = config.router.curve_client_keys()
    if client_keys is not None and not any(r.curve_server_key for r in replicas):
        raise ConfigError("router.curve_client_cert is set but no [[router.replicas]] has a curve_server_key")
    for r in replicas:
        backend = HttpBackend(
            r.name, r.url, model=r.model, timeout_s=config.router.request_timeout_s, api_key=r.api_key,
            keep_client_auth=not config.router.api_key,
        )  # fmt: skip
        events = ProducerSpec(
            f"{r.name}/events", r.events, r.replay, rekey=r.rekey, curve_server_key=r.curve_server_key,
            curve_client_keys=client_keys if r.curve_server_key else None,
        )  # fmt: skip
        service.add_replica(ReplicaSpec(r.name, r.node, backend, events))
    return service


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, overrides=args.set)
    service = build_router(config)
    host = args.host or config.router.host
    port = args.port if args.port is not None else config.router.port
    count = len(config.router.replicas)
    sock = bind_socket(host, port, "the router")
    try:
        url = f"http://{host}:{sock.getsockname()[1]}"  # the real port, also with --port 0
        print(f"kvstore router: {url}  ({count} replica{'' if count == 1 else 's'})", file=sys.stderr, flush=True)
        server = uvicorn.Server(server_config(create_app(service), config.router))
        freeze_startup_heap()
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("router", help="the router alone, for external vLLM / kvstore worker replicas")
    p.add_argument("--config", required=True, help="TOML config with [[router.replicas]]")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    p.add_argument("--host", default=None, help="bind address (default router.host)")
    p.add_argument("--port", type=port_number, default=None, help="port (default router.port; 0 = any free)")
    p.set_defaults(func=run)
