"""Synchronous clients of a node's tier, for code that runs on a worker's step-loop thread.

Both clients have the same methods (:class:`TierClient`): one reaches the
node's :class:`~kvstore.tiers.actor.TierActor` through Ray, the other runs a
:class:`~kvstore.tiers.store.TierStore` in this process on its own event-loop
thread (tests, single-process deployments). Every call blocks until the
store answers, at most ``timeout_s``. A tier that cannot answer -- a
timeout (:class:`~kvstore.tiers.errors.TierTimeoutError`, also a ``TimeoutError``),
a dead or unreachable actor, a closed store -- raises
:class:`~kvstore.tiers.errors.TierUnavailableError`; callers' mistakes raise the
store's own typed errors.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import ray

from kvstore.config import EventsConfig
from kvstore.publisher import EventEndpoints
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit
from kvstore.tiers.config import TierConfig
from kvstore.tiers.errors import TierError, TierTimeoutError, TierUnavailableError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.shared_memory import ArenaInfo
from kvstore.tiers.stats import TierStats
from kvstore.tiers.store import TierStore

T = TypeVar("T")


class TierClient(Protocol):
    """What a worker asks its node's tier (contracts on :class:`TierStore`)."""

    def arena_info(self) -> ArenaInfo: ...
    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit: ...
    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]: ...
    def commit(self, lease_ids: Sequence[int]) -> int: ...
    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]: ...
    def release(self, lease_ids: Sequence[int]) -> None: ...
    def stats(self) -> TierStats: ...


class RayTierClient:
    """A :class:`TierClient` over a TierActor handle."""

    def __init__(self, handle: Any, *, timeout_s: float = 30.0) -> None:
        self._handle = handle
        self._timeout_s = timeout_s

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TierTimeoutError(f"the tier actor did not answer within {self._timeout_s} s") from None
        except ray.exceptions.RayActorError as exc:  # dead, or unreachable (ActorUnavailableError)
            raise TierUnavailableError(f"the tier actor is gone ({type(exc).__name__})") from exc
        except ray.exceptions.RayTaskError as exc:  # raised by the tier itself: re-raise its own type
            if isinstance(exc.cause, TierError):
                raise exc.cause from None
            raise

    def arena_info(self) -> ArenaInfo:
        return self._get(self._handle.arena_info.remote())  # type: ignore[no-any-return]

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        return self._get(self._handle.lookup.remote(list(block_hashes), start))  # type: ignore[no-any-return]

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        return self._get(self._handle.reserve.remote(list(blocks), arena))  # type: ignore[no-any-return]

    def commit(self, lease_ids: Sequence[int]) -> int:
        return self._get(self._handle.commit.remote(list(lease_ids)))  # type: ignore[no-any-return]

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        return self._get(self._handle.acquire.remote(list(blocks), arena))  # type: ignore[no-any-return]

    def release(self, lease_ids: Sequence[int]) -> None:
        self._get(self._handle.release.remote(list(lease_ids)))

    def stats(self) -> TierStats:
        return self._get(self._handle.stats.remote())  # type: ignore[no-any-return]


class LocalTierClient:
    """A :class:`TierClient` that owns a TierStore running on a private event-loop thread."""

    def __init__(
        self,
        config: TierConfig,
        identity: CacheIdentity,
        *,
        events: EventsConfig | None = None,
        arena_name: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-tier-loop", daemon=True)
        self._thread.start()
        try:
            self.store: TierStore = self._run(_build(config, identity, events, arena_name))
        except BaseException:
            self._stop_loop()
            raise

    def arena_info(self) -> ArenaInfo:
        return self._call(lambda: self.store.arena_info)

    def event_endpoints(self) -> EventEndpoints | None:
        return self._call(lambda: self.store.event_endpoints)

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        return self._call(lambda: self.store.lookup(block_hashes, start))

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        return self._run(self.store.reserve(blocks, arena))

    def commit(self, lease_ids: Sequence[int]) -> int:
        return self._run(self.store.commit(lease_ids))

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        return self._run(self.store.acquire(blocks, arena))

    def release(self, lease_ids: Sequence[int]) -> None:
        self._call(lambda: self.store.release(lease_ids))

    def stats(self) -> TierStats:
        return self._call(self.store.stats)

    def check_invariants(self) -> None:
        self._call(self.store.check_invariants)

    def close(self) -> None:
        """Close the store (unlinking its arena) and stop the loop thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._run(self.store.aclose())
        finally:
            self._stop_loop()

    def _call(self, fn: Callable[[], T]) -> T:
        async def on_loop() -> T:
            return fn()

        return self._run(on_loop())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("LocalTierClient called from its own loop thread: await the store instead")
        if self._loop.is_closed():
            coro.close()
            raise TierUnavailableError("the tier store is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self._timeout_s)
        except TimeoutError:
            future.cancel()
            raise TierTimeoutError(f"the tier store did not answer within {self._timeout_s} s") from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


async def _build(
    config: TierConfig, identity: CacheIdentity, events: EventsConfig | None, arena_name: str | None
) -> TierStore:
    return TierStore(config, identity, events=events, arena_name=arena_name)
