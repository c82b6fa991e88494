"""The tier's control socket over a real ZeroMQ ipc socket and a real TierStore on its own event loop.

Round trips keep the store's error types, one client's calls run in the order sent while another
client's interleave, garbage is answered without stopping the reader, and a server that goes away
fails the calls waiting on it at once rather than at their timeout.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import zmq
from tiers_helpers import IDENTITY, arena_name, hashes, make_blocks, tier_config

from kvstore.tiers.blocks import decode_grants, decode_metas, encode_grants, encode_metas
from kvstore.tiers.control import ControlChannel, ControlServer, Handler
from kvstore.tiers.errors import InvalidBlockError, LeaseError, TierError, TierTimeoutError, TierUnavailableError
from kvstore.tiers.store import TierStore

T = TypeVar("T")


class Served:
    """A TierStore and a ControlServer on an event-loop thread, plus test handlers."""

    def __init__(self, tmp_path: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.dir = tmp_path
        self.store = TierStore(tier_config(tmp_path, cpu_blocks=8), IDENTITY, arena_name=arena_name())
        self.order: list[int] = []
        self.gate = asyncio.Event()
        store = self.store

        async def lookup(block_hashes: list[int], start: int = 0) -> Any:
            return store.lookup(block_hashes, start)

        async def reserve(packed: bytes, arena: int | None = None) -> bytes:
            return encode_grants(await store.reserve(decode_metas(packed), arena))

        async def commit(lease_ids: list[int]) -> int:
            return await store.commit(lease_ids)

        async def acquire(packed: bytes, arena: int | None = None) -> bytes:
            return encode_grants(await store.acquire(decode_metas(packed), arena))

        async def release(lease_ids: list[int]) -> None:
            store.release(lease_ids)

        async def note(value: int, delay_s: float) -> int:  # records the order calls ran in
            await asyncio.sleep(delay_s)
            self.order.append(value)
            return value

        async def stall() -> None:  # until the gate opens
            await self.gate.wait()

        async def slow_reserve(packed: bytes, delay_s: float) -> bytes:  # grants leases, late
            await asyncio.sleep(delay_s)
            return encode_grants(await store.reserve(decode_metas(packed)))

        handlers: dict[str, Handler] = {
            "lookup": lookup, "reserve": reserve, "commit": commit, "acquire": acquire, "release": release,
            "note": note, "stall": stall, "slow_reserve": slow_reserve,
        }  # fmt: skip
        self.server = self.run(self._start(handlers))

    async def _start(self, handlers: dict[str, Handler]) -> ControlServer:
        server = ControlServer(handlers, str(self.dir), "arena-x")
        server.start()
        return server

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def later(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.run(self.server.aclose())
        self.run(self.store.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    server = Served(tmp_path)
    try:
        yield server
    finally:
        server.close()


def test_the_hot_calls_round_trip_and_the_tiers_errors_keep_their_types(served: Served) -> None:
    channel = ControlChannel(served.server.endpoint, timeout_s=30)
    try:
        metas, _ = make_blocks(3)
        grants = decode_grants(channel.call("reserve", [encode_metas(metas), None]))
        assert [grant is not None for grant in grants] == [True, True, True]
        lease_ids = [grant.lease_id for grant in grants if grant is not None]
        assert channel.call("commit", [lease_ids]) == 3
        assert channel.call("lookup", [hashes(metas), 1]) == [2, ["CPU", "CPU"]]
        read = decode_grants(channel.call("acquire", [encode_metas(metas), None]))
        assert [grant.slot for grant in read if grant is not None] == [grant.slot for grant in grants if grant]
        assert channel.call("release", [[grant.lease_id for grant in read if grant is not None]]) is None

        with pytest.raises(LeaseError):  # released already: the caller's mistake, by its own type
            channel.call("release", [[read[0].lease_id]])  # type: ignore[union-attr]
        with pytest.raises(InvalidBlockError, match="malformed"):
            channel.call("reserve", [b"\xc1 not msgpack", None])
        with pytest.raises(TierError, match="unknown control operation"):
            channel.call("drop_everything", [])
        with pytest.raises(TierError, match="TypeError"):  # wrong arguments: answered, not fatal
            channel.call("commit", [1, 2, 3])
        served.run(asyncio.sleep(0))
        served.store.check_invariants()  # the refused calls changed nothing
        assert served.store.cpu.num_leased_slots == 0
    finally:
        channel.close()


def test_one_clients_calls_run_in_the_order_sent_while_another_clients_interleave(served: Served) -> None:
    first = ControlChannel(served.server.endpoint, timeout_s=30)
    second = ControlChannel(served.server.endpoint, timeout_s=30)
    try:
        # Sent without waiting; earlier calls sleep longer, so any reordering would show.
        seqs = [first.send("note", [value, (10 - value) * 0.01]) for value in range(10)]
        assert second.call("note", [100, 0.0]) == 100  # not queued behind the first client's calls
        assert [first.wait(seq) for seq in seqs] == list(range(10))
        assert [value for value in served.order if value < 100] == list(range(10))
        assert served.order.index(100) < 9
    finally:
        first.close()
        second.close()


def raw_dealer(endpoint: str) -> zmq.Socket[bytes]:
    """A bare DEALER socket on the server, to send what a ControlChannel never would."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    return raw


def test_garbage_is_answered_or_dropped_and_the_reader_keeps_serving(served: Served) -> None:
    raw = raw_dealer(served.server.endpoint)
    channel = ControlChannel(served.server.endpoint, timeout_s=30)
    try:
        raw.send_multipart([b"one frame"])  # dropped: no seq to answer to
        raw.send_multipart([b"\x01" * 8, b"lookup", b"\xc1"])
        assert raw.poll(10_000)
        seq, status, payload = raw.recv_multipart()
        assert (seq, status) == (b"\x01" * 8, b"err")
        assert msgspec.msgpack.decode(payload)[1].startswith("malformed control arguments")
        raw.send_multipart([b"\x02" * 8, b"lookup", msgspec.msgpack.encode({"not": "an array"})])
        assert raw.poll(10_000) and raw.recv_multipart()[1] == b"err"
        assert channel.call("lookup", [[1, 2], 0]) == [0, []]  # still serving
    finally:
        raw.close(0)
        channel.close()


def test_a_flood_from_one_client_is_refused_past_the_queue_and_an_oversized_message_disconnects_it(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's calls are held up to MAX_QUEUED unanswered (the one running included) and answered with an
    error beyond it; a wrong frame count is answered when it names a seq; a message over
    MAX_MESSAGE_BYTES never reaches the reader (ZeroMQ drops its sender). Others are served throughout."""
    import kvstore.tiers.control as control_module

    monkeypatch.setattr(control_module, "MAX_QUEUED", 4)
    raw = raw_dealer(served.server.endpoint)
    other = ControlChannel(served.server.endpoint, timeout_s=30)
    try:
        raw.send_multipart([(0).to_bytes(8, "little"), b"stall", msgspec.msgpack.encode([])])
        for seq in range(1, 11):
            raw.send_multipart([seq.to_bytes(8, "little"), b"note", msgspec.msgpack.encode([seq, 0.0])])
        refused = []
        while len(refused) < 7 and raw.poll(10_000):
            seq, status, payload = raw.recv_multipart()
            assert status == b"err" and "more than 4 control calls waiting" in msgspec.msgpack.decode(payload)[1]
            refused.append(int.from_bytes(seq, "little"))
        assert refused == list(range(4, 11))  # the stalled call and three queued behind it are kept
        assert other.call("lookup", [[1], 0]) == [0, []]
        served.later(served.gate.set)
        answered = sorted(int.from_bytes(raw.recv_multipart()[0], "little") for _ in range(4) if raw.poll(10_000))
        assert answered == [0, 1, 2, 3]
        raw.send_multipart([b"\x07" * 8, b"lookup"])  # two frames: answered with an error naming the count
        assert raw.poll(10_000)
        seq, status, payload = raw.recv_multipart()
        assert (seq, status) == (b"\x07" * 8, b"err") and "2 frames, not 3" in msgspec.msgpack.decode(payload)[1]
    finally:
        raw.close(0)
    huge = raw_dealer(served.server.endpoint)
    try:
        huge.send_multipart([b"\x08" * 8, b"lookup", b"\x00" * (control_module.MAX_MESSAGE_BYTES + 1)])
        assert not huge.poll(1_000)  # never read, never answered
        assert other.call("lookup", [[1], 0]) == [0, []]
    finally:
        huge.close(0)
        other.close()


def test_a_server_that_goes_away_fails_the_waiting_call_at_once_not_at_its_timeout(served: Served) -> None:
    channel = ControlChannel(served.server.endpoint, timeout_s=60)
    try:
        seq = channel.send("stall", [])
        assert not channel.done(seq)
        started = time.monotonic()
        threading.Timer(0.2, lambda: served.run(served.server.aclose())).start()
        with pytest.raises(TierUnavailableError, match="gone"):
            channel.wait(seq)
        assert time.monotonic() - started < 10
        with pytest.raises(TierUnavailableError):  # and every later call, without sending
            channel.call("lookup", [[1], 0])
    finally:
        channel.close()
    with pytest.raises(TierUnavailableError, match="closed"):
        channel.send("lookup", [[1], 0])


def test_no_answer_in_time_is_a_timeout_and_the_late_answer_is_dropped(served: Served) -> None:
    channel = ControlChannel(served.server.endpoint, timeout_s=0.3)
    try:
        with pytest.raises(TierTimeoutError, match=r"0\.3 s"):
            channel.call("note", [1, 0.6])
        time.sleep(0.5)  # its answer arrives now, and must not be taken for the next call's
        assert channel.call("note", [2, 0.0]) == 2
        assert channel._answers == {} and channel._waiting == set()
    finally:
        channel.close()


def test_leases_granted_after_a_timeout_are_released_when_the_late_answer_comes(served: Served) -> None:
    """A reserve that times out still grants its leases on the tier: its late answer is read for their ids and
    a release is sent, so no slot stays pinned by a call nobody waits for any more."""
    from kvstore.tiers.client import _packed_ids

    metas, _ = make_blocks(3)
    channel = ControlChannel(served.server.endpoint, timeout_s=0.3)
    try:
        with pytest.raises(TierTimeoutError):
            channel.call("slow_reserve", [encode_metas(metas), 0.6], leases_of=_packed_ids)
        time.sleep(0.5)  # the answer is in by now
        assert channel.call("lookup", [[1], 0]) == [0, []]  # reads it, and sends the release behind this call
        assert channel.call("lookup", [[1], 0]) == [0, []]  # one client's calls run in order: released by now

        async def leased() -> int:
            return served.store.cpu.num_leased_slots

        assert served.run(leased()) == 0
        assert channel._late == {} and channel._answers == {}
    finally:
        channel.close()


def test_the_socket_file_is_private_replaces_a_dead_predecessors_and_goes_at_close(tmp_path: Path) -> None:
    stale = tmp_path / "arena-y.0123456789ab.ctl"
    stale.touch()
    other = tmp_path / "arena-z.0123456789ab.ctl"  # another arena's: left alone
    other.touch()

    async def start() -> ControlServer:
        server = ControlServer({}, str(tmp_path), "arena-y")
        server.start()
        return server

    loop = asyncio.new_event_loop()
    try:
        server = loop.run_until_complete(start())
        assert not stale.exists() and other.exists()
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        loop.run_until_complete(server.aclose())
        assert not server.path.exists()
    finally:
        loop.close()
    with pytest.raises(ValueError, match="too long"):
        ControlServer({}, str(tmp_path / ("d" * 120)), "arena-y")


def test_an_answer_already_in_when_its_wait_begins_is_taken_at_once(served: Served) -> None:
    """A call sent without waiting (a commit) whose answer is in the socket before anyone waits for it: the wait
    returns at once. (It once read the answer while checking the socket, then slept out the whole timeout.)"""
    channel = ControlChannel(served.server.endpoint, timeout_s=10)
    try:
        seqs = [channel.send("note", [value, 0.0]) for value in range(3)]
        time.sleep(0.3)  # every answer has arrived, none read
        started = time.monotonic()
        assert [channel.wait(seq) for seq in seqs] == [0, 1, 2]
        assert time.monotonic() - started < 2
    finally:
        channel.close()
