"""Synchronous clients of a node's tier, for code that runs on a worker's step-loop thread.

Both clients have the same methods (:class:`TierClient`): one reaches the
node's :class:`~kvstore.tiers.actor.TierActor` through Ray, the other runs a
:class:`~kvstore.tiers.store.TierStore` in this process on its own event-loop
thread (tests, single-process deployments). Every call blocks until the
store answers, at most ``timeout_s`` -- except ``commit_later`` /
``release_later``, which send the call and return a :class:`Pending` at once;
their answer, or error, is read from the Pending. Whether a later call sees
their effect depends on the path, and each client says which (``ordered``):
the tier's control socket and a local store run on the caller's thread run
one client's calls in the order sent, but Ray does not promise that for an
async actor's calls (nor does a local store on its loop, whose calls can
interleave at their disk I/O), so there a caller that needs the effect
collects the Pending first (``TierLink`` does). A tier that cannot answer -- a
timeout (:class:`~kvstore.tiers.errors.TierTimeoutError`, also a ``TimeoutError``),
a dead or unreachable actor, a closed store -- raises
:class:`~kvstore.tiers.errors.TierUnavailableError`; callers' mistakes raise the
store's own typed errors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import ray

from kvstore.config import EventsConfig
from kvstore.events import Medium
from kvstore.publisher import EventEndpoints
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit, decode_grants, encode_metas
from kvstore.tiers.config import TierConfig
from kvstore.tiers.control import ControlChannel
from kvstore.tiers.errors import TierError, TierTimeoutError, TierUnavailableError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.shared_memory import ArenaInfo
from kvstore.tiers.stats import TierStats
from kvstore.tiers.store import TierStore

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Pending(Protocol):
    """A call sent without waiting: ``result()`` waits for its answer (at most the client's timeout)
    and raises what the call raised."""

    def done(self) -> bool: ...
    def result(self) -> Any: ...


class TierClient(Protocol):
    """What a worker asks its node's tier (contracts on :class:`TierStore`)."""

    def arena_info(self) -> ArenaInfo: ...
    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit: ...
    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]: ...
    def commit(self, lease_ids: Sequence[int]) -> int: ...
    def commit_later(self, lease_ids: Sequence[int]) -> Pending: ...
    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]: ...
    def release(self, lease_ids: Sequence[int]) -> None: ...
    def release_later(self, lease_ids: Sequence[int]) -> Pending: ...
    def stats(self) -> TierStats: ...

    @property
    def ordered(self) -> bool:
        """Whether the tier runs this client's calls in the order sent, each finished before the next starts
        (so a call sees the effect of every earlier one, ``_later`` calls included)."""
        ...


class _RayPending:
    def __init__(self, client: RayTierClient, ref: Any) -> None:
        self._client = client
        self._ref = ref

    def done(self) -> bool:
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self) -> Any:
        return self._client._get(self._ref)


class _LocalPending:
    def __init__(self, future: concurrent.futures.Future[Any], timeout_s: float) -> None:
        self._future = future
        self._timeout_s = timeout_s

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        try:
            return self._future.result(self._timeout_s)
        except concurrent.futures.CancelledError:
            raise TierUnavailableError("the tier store closed before answering") from None
        except TimeoutError:
            raise TierTimeoutError(f"the tier store did not answer within {self._timeout_s} s") from None


class _ChannelPending:
    def __init__(self, channel: ControlChannel, seq: int) -> None:
        self._channel = channel
        self._seq = seq

    def done(self) -> bool:
        return self._channel.done(self._seq)

    def result(self) -> Any:
        return self._channel.wait(self._seq)


class RayTierClient:
    """A :class:`TierClient` over a TierActor handle.

    The hot calls (``lookup``, ``reserve``, ``commit``, ``acquire``, ``release`` and their
    ``_later`` forms) go over the actor's control socket when it offers one and this process can
    see it (:mod:`~kvstore.tiers.control`: asked once, at the first of them); the rest, and every
    call when there is no socket, through Ray. :meth:`close` closes the socket.
    """

    def __init__(self, handle: Any, *, timeout_s: float = 30.0, control: bool = True) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        self._ask_control = control  # ask the actor for its socket at the first hot call
        self._channel: ControlChannel | None = None

    @property
    def channel(self) -> ControlChannel | None:
        """The control socket the hot calls use (None: they go through Ray)."""
        return self._fast()

    @property
    def ordered(self) -> bool:
        """True while the hot calls go over the control socket, which runs one client's calls in the order
        sent; through Ray an async actor may run them in any order."""
        return self._fast() is not None

    def _fast(self) -> ControlChannel | None:
        if self._ask_control:
            self._ask_control = False
            endpoint = self._get(self._handle.control_endpoint.remote())
            path = endpoint.removeprefix("ipc://") if isinstance(endpoint, str) else None
            if path is not None and os.path.exists(path):
                self._channel = ControlChannel(endpoint, timeout_s=self._timeout_s)
            elif path is not None:  # another mount namespace (a container without the tier's shm_dir)
                logger.warning("the tier's control socket %s is not visible here: calling it through Ray", path)
        return self._channel

    def _get(self, ref: Any, *, leases_of: Callable[[Any], list[int]] | None = None) -> Any:
        """``ref``'s value; ``leases_of`` as for :meth:`ControlChannel.wait`: a call that grants leases and times
        out has them released when its answer comes."""
        try:
            return ray.get(ref, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            if leases_of is not None:
                ref.future().add_done_callback(partial(self._hand_back, leases_of))
            raise TierTimeoutError(f"the tier actor did not answer within {self._timeout_s} s") from None
        except ray.exceptions.RayActorError as exc:  # dead, or unreachable (ActorUnavailableError)
            raise TierUnavailableError(f"the tier actor is gone ({type(exc).__name__})") from exc
        except ray.exceptions.RayTaskError as exc:  # raised by the tier itself: re-raise its own type
            if isinstance(exc.cause, TierError):
                raise exc.cause from None
            raise

    def _hand_back(self, leases_of: Callable[[Any], list[int]], answer: concurrent.futures.Future[Any]) -> None:
        """A timed-out call's answer came through Ray: release the leases it granted (a call not waited for)."""
        try:
            lease_ids = leases_of(answer.result())
        except Exception:  # it failed, or the tier is gone: no leases to hand back
            return
        if lease_ids:
            self._handle.release.remote(lease_ids)

    def arena_info(self) -> ArenaInfo:
        return self._get(self._handle.arena_info.remote())  # type: ignore[no-any-return]

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        channel = self._fast()
        if channel is None:
            return self._get(self._handle.lookup.remote(list(block_hashes), start))  # type: ignore[no-any-return]
        answer = channel.call("lookup", [list(block_hashes), start])
        try:
            return TierHit(int(answer[0]), tuple(Medium(medium) for medium in answer[1]))
        except (TypeError, ValueError, IndexError) as exc:
            raise TierError(f"the tier's lookup answer is malformed: {answer!r:.80}") from exc

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        # Packed both ways: Ray's own serialization of the metas and grants cost more than the round trip.
        channel = self._fast()
        if channel is None:
            packed = self._get(self._handle.reserve_packed.remote(encode_metas(blocks), arena), leases_of=_packed_ids)
        else:
            packed = channel.call("reserve", [encode_metas(blocks), arena], leases_of=_packed_ids)
        return decode_grants(packed)

    def commit(self, lease_ids: Sequence[int]) -> int:
        channel = self._fast()
        if channel is None:
            return self._get(self._handle.commit.remote(list(lease_ids)))  # type: ignore[no-any-return]
        return int(channel.call("commit", [list(lease_ids)]))

    def commit_later(self, lease_ids: Sequence[int]) -> Pending:
        channel = self._fast()
        if channel is None:
            return _RayPending(self, self._handle.commit.remote(list(lease_ids)))
        return _ChannelPending(channel, channel.send("commit", [list(lease_ids)]))

    def release_later(self, lease_ids: Sequence[int]) -> Pending:
        channel = self._fast()
        if channel is None:
            return _RayPending(self, self._handle.release.remote(list(lease_ids)))
        return _ChannelPending(channel, channel.send("release", [list(lease_ids)]))

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        channel = self._fast()
        if channel is None:
            packed = self._get(self._handle.acquire_packed.remote(encode_metas(blocks), arena), leases_of=_packed_ids)
        else:
            packed = channel.call("acquire", [encode_metas(blocks), arena], leases_of=_packed_ids)
        grants = decode_grants(packed)
        if None in grants:
            raise TierError("the tier's acquire answered a slot-less grant")
        return grants  # type: ignore[return-value]  # no None: checked above

    def release(self, lease_ids: Sequence[int]) -> None:
        channel = self._fast()
        if channel is None:
            self._get(self._handle.release.remote(list(lease_ids)))
        else:
            channel.call("release", [list(lease_ids)])

    def stats(self) -> TierStats:
        return self._get(self._handle.stats.remote())  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the control socket (the actor lives on); later hot calls go through Ray. Idempotent."""
        self._ask_control = False
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


class LocalTierClient:
    """A :class:`TierClient` that owns a TierStore running on a private event-loop thread.

    Direct calls: a store without a disk tier never awaits anything (no I/O: every operation is
    bookkeeping on the arena), so its calls run on the caller's thread under ``_direct_lock``
    instead of hopping to the loop thread and back -- a wake-up each way, which on small blocks
    costs more than the copy. The lock serialises them as the loop would (one at a time, in the
    order callers take it), ``commit_later`` / ``release_later`` are then done when they return,
    and a call that would await anyway (a bug: the store grew I/O) raises instead of blocking. A
    store with a disk tier is always driven from the loop, where its disk I/O settles.
    """

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
        # Guards sending a coroutine to the loop against closing it: once ``_closing`` is set under it,
        # nothing more is sent, so every coroutine sent is run (or cancelled) before the loop closes.
        self._send_lock = threading.Lock()
        self._closing = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-tier-loop", daemon=True)
        self._thread.start()
        self._pending: list[concurrent.futures.Future[Any]] = []  # sent by *_later, maybe not answered yet
        try:
            self._store: TierStore = self._run(_build(config, identity, events, arena_name))
        except BaseException:
            self._stop_loop()
            raise
        self._direct_lock = threading.Lock()
        self._direct = self._store.disk is None  # no I/O to await: calls run on the caller's thread

    @property
    def ordered(self) -> bool:
        """True for direct calls (each runs to its end before it returns); a store on its loop may interleave
        one call's disk I/O with the next call."""
        return self._direct_ready()

    @property
    def store(self) -> TierStore:
        """The store, for inspection between calls: calls sent without waiting are answered first."""
        self._settle()
        return self._store

    def arena_info(self) -> ArenaInfo:
        return self._call(lambda: self._store.arena_info)

    def event_endpoints(self) -> EventEndpoints | None:
        return self._call(lambda: self._store.event_endpoints)

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        return self._call(lambda: self._store.lookup(block_hashes, start))

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        return self._run(self._store.reserve(blocks, arena), leases_of=_grant_ids)

    def commit(self, lease_ids: Sequence[int]) -> int:
        return self._run(self._store.commit(lease_ids))

    def commit_later(self, lease_ids: Sequence[int]) -> Pending:
        if self._direct:
            return self._done_now(lambda: self._run(self._store.commit(lease_ids)))
        return self._send(self._store.commit(list(lease_ids)))

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        return self._run(self._store.acquire(blocks, arena), leases_of=_grant_ids)

    def release(self, lease_ids: Sequence[int]) -> None:
        self._call(lambda: self._store.release(lease_ids))

    def release_later(self, lease_ids: Sequence[int]) -> Pending:
        if self._direct:
            return self._done_now(lambda: self._call(lambda: self._store.release(lease_ids)))
        ids = list(lease_ids)

        async def on_loop() -> None:
            self._store.release(ids)

        return self._send(on_loop())

    def stats(self) -> TierStats:
        return self._call(self._store.stats)

    def check_invariants(self) -> None:
        self._call(self._store.check_invariants)

    def close(self) -> None:
        """Close the store (unlinking its arena) and stop the loop thread. Idempotent."""
        if self._loop.is_closed():
            return
        try:
            if self._direct_ready():
                with self._locked():
                    self._direct = False  # calls waiting for the lock find the store closed
                    _run_now(self._store.aclose())
            else:
                self._run(self._store.aclose())
        finally:
            self._direct = False
            self._stop_loop()

    def _call(self, fn: Callable[[], T]) -> T:
        if self._direct_ready():
            with self._locked():
                return fn()

        async def on_loop() -> T:
            return fn()

        return self._run(on_loop())

    def _run(self, coro: Coroutine[Any, Any, T], *, leases_of: Callable[[Any], list[int]] | None = None) -> T:
        """``coro``'s result, run on the caller's thread (direct) or the loop. On a timeout the call is
        cancelled -- or, when it grants leases (``leases_of`` reads their ids from its result), left to finish
        and its leases released then: a cancel racing its last step could drop grants nobody would end."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LocalTierClient called from its own loop thread: await the store instead")
        if self._direct_ready():  # (never once the loop is closed: _to_loop refuses those calls below)
            try:
                locked = self._locked()
            except BaseException:  # timed out or closed meanwhile: the coroutine never runs
                coro.close()
                raise
            with locked:
                return _run_now(coro)
        future = self._to_loop(coro)
        try:
            return future.result(self._timeout_s)
        except concurrent.futures.CancelledError:  # sent as the client closed: cancelled before it ran
            raise TierUnavailableError("the tier store closed before answering") from None
        except TimeoutError:
            if leases_of is None:
                future.cancel()
            else:
                future.add_done_callback(partial(self._hand_back, leases_of))
            raise TierTimeoutError(f"the tier store did not answer within {self._timeout_s} s") from None

    def _hand_back(self, leases_of: Callable[[Any], list[int]], answer: concurrent.futures.Future[Any]) -> None:
        """A timed-out call finished: release the leases it granted, on the loop (this runs on the loop thread,
        or on the caller's when the call had finished by the time it gave up)."""
        if answer.cancelled() or answer.exception() is not None:
            return
        lease_ids = leases_of(answer.result())
        if not lease_ids:
            return

        def release() -> None:
            with contextlib.suppress(TierError):  # closed meanwhile: its leases went with the arena
                self._store.release(lease_ids)

        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the store, and its arena
            self._loop.call_soon_threadsafe(release)

    def _to_loop(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop, unless the client is closing (then it is closed, never run)."""
        with self._send_lock:
            if self._closing or self._loop.is_closed():
                coro.close()
                raise TierUnavailableError("the tier store is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _direct_ready(self) -> bool:
        # Set once the store is built (the build itself runs on the loop); never while closing.
        return getattr(self, "_direct", False) and not self._loop.is_closed()

    def _locked(self) -> contextlib.AbstractContextManager[bool]:
        if not self._direct_lock.acquire(timeout=self._timeout_s):
            raise TierTimeoutError(f"the tier store did not answer within {self._timeout_s} s")
        if not self._direct:  # closed while this call waited
            self._direct_lock.release()
            raise TierUnavailableError("the tier store is closed")
        return _Unlock(self._direct_lock)

    def _done_now(self, fn: Callable[[], Any]) -> Pending:
        """Run ``fn`` now (a direct call) and return its answer, or error, as an answered Pending."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)
        return _LocalPending(future, self._timeout_s)

    def _send(self, coro: Coroutine[Any, Any, Any]) -> Pending:
        """Start ``coro`` on the loop (after every call sent before it) and return without waiting."""
        future = self._to_loop(coro)
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(future)
        return _LocalPending(future, self._timeout_s)

    def _settle(self) -> None:
        """Wait (each at most the timeout) for the calls sent without waiting; their errors are their callers'."""
        if threading.current_thread() is self._thread:
            return
        pending, self._pending = self._pending, []
        if pending:
            concurrent.futures.wait(pending, timeout=self._timeout_s)

    def _stop_loop(self) -> None:
        """Stop sending, stop the loop thread, cancel what was sent but not run, close the loop.

        The loop stops after the callbacks queued before its stop, which can leave two kinds of call
        behind: one whose task was created but not started, and one that finished but whose answer
        (a callback that completes the caller's future) was not yet passed on. Both are finished here,
        on this thread, as ``asyncio.run`` tears a loop down: the tasks left are cancelled and run to
        their end, then one more pass runs the callbacks still queued. So no coroutine is left never
        awaited, and every caller gets its answer or TierUnavailableError at once instead of waiting
        out its timeout.
        """
        with self._send_lock:
            self._closing = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # stuck in a call: the daemon thread is left to the process
            return
        left = asyncio.all_tasks(self._loop)
        for task in left:
            task.cancel()
        if left:  # (gather of nothing would bind to another loop)
            self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()


class _Unlock:
    """Releases an acquired lock on exit (``_locked``: the acquire may time out, so it is done first)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends to its end on this thread; raises if it suspends."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a direct tier call awaited: a store that does I/O must run on its loop")


async def _build(
    config: TierConfig, identity: CacheIdentity, events: EventsConfig | None, arena_name: str | None
) -> TierStore:
    return TierStore(config, identity, events=events, arena_name=arena_name)


def _grant_ids(grants: Sequence[SlotGrant | None]) -> list[int]:
    """The lease ids of a reserve's or acquire's grants."""
    return [grant.lease_id for grant in grants if grant is not None]


def _packed_ids(packed: Any) -> list[int]:
    """The lease ids of a reserve's or acquire's packed answer."""
    return _grant_ids(decode_grants(packed))
