"""The whole configuration tree: one section per part, each owned (and its defaults written) by that part.

Assembled here, at the top, because this is the one layer that knows every
part; the layers below read only their sections, typed as a Protocol
(:class:`~kvstore.workers.config.WorkerSettings`,
:class:`~kvstore.router.config.RouterSettings`), which this tree satisfies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvstore.config import CacheConfig, EventsConfig, PoolConfig, load_tree, tree_from_dict
from kvstore.router.config import RouterConfig
from kvstore.tiers.config import TierConfig
from kvstore.workers.config import WorkerConfig


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole tree: one section per part, each default written once."""

    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)
    tiers: TierConfig = msgspec.field(default_factory=TierConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """The tree from defaults < TOML file < environment < ``section.field=value`` overrides (see
    :func:`kvstore.config.load_tree`). Raises ConfigError naming the offending field."""
    return load_tree(Config, path, env=env, overrides=overrides)


def config_from_dict(tree: Mapping[str, Any]) -> Config:
    """Validate a plain mapping into a Config, with errors that name the field."""
    return tree_from_dict(Config, tree)
