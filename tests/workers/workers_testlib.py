"""Helpers shared by the workers tests (a uniquely named module: tests/ is not a package)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from kvstore.deploy.config import Config, config_from_dict
from kvstore.worker_api import GenerateRequest
from kvstore.workers.worker import KVWorker

VOCAB = 512
WorkerFactory = Callable[..., KVWorker]
Reference = Callable[[GenerateRequest], list[int]]


def make_config(
    *,
    num_blocks: int = 256,
    block_size: int = 16,
    caching: bool = True,
    events: bool = False,
    watermark: float = 0.0,
    **worker: Any,
) -> Config:
    """The default toy model on the CPU; events off unless asked (each publisher binds two loopback ports)."""
    return config_from_dict(
        {
            "cache": {"block_size": block_size, "enable_prefix_caching": caching},
            "pool": {"num_blocks": num_blocks, "watermark": watermark},
            "events": {"enabled": events},
            "worker": {"device": "cpu", **worker},
        }
    )


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix_requests(
    seed: int, count: int, *, prefix_lengths: tuple[int, ...] = (0, 16, 40, 64), max_tokens: int = 12
) -> list[GenerateRequest]:
    """Requests whose prompts share a few common prefixes (some block-aligned, some not)."""
    rng = random.Random(seed)
    prefixes = [random_tokens(rng, n) for n in prefix_lengths]
    return [
        GenerateRequest(rng.choice(prefixes) + random_tokens(rng, rng.randrange(1, 40)), rng.randrange(1, max_tokens))
        for _ in range(count)
    ]


def fail_once(monkeypatch: Any, owner: object, attribute: str, error: BaseException) -> None:
    """Make ``owner.attribute`` raise ``error`` on its next call, and be itself again from then on."""
    real = getattr(owner, attribute)

    def failing(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(owner, attribute, real)
        raise error

    monkeypatch.setattr(owner, attribute, failing)
