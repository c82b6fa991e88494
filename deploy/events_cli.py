"""``kvstore events tail``: print a KV event stream as JSON lines.

Works against any vLLM-compatible producer (ours or a vLLM server started
with ``--kv-events-config``). With ``--replay-endpoint`` it recovers gaps and
late joins exactly as the router does (replay, then snapshot); each recovery
prints a ``{"type": "Resync"}`` line before the state it re-sends. A CURVE
publisher needs ``--curve-server-key``; one that admits only listed clients
(``events.curve_allowed_client_keys``) also needs ``--curve-client-cert``,
the secret certificate file of a listed client (a file, not a flag value, so
that the secret key never shows in the process list).

While a recovery is under way the live stream is held back, so a replay
endpoint that never answers (a wrong port, a firewall) would leave the tool
silent while events arrive. Once :data:`SYNC_FAILURES_TO_WARN` recoveries
have timed out it prints one line on stderr naming the replay endpoint,
and keeps going: like ``tail -f``, it follows a producer that may come back
(a restarting worker answers later), and the line tells a user who mistyped
the endpoint what to fix.

When the reader of stdout goes away (``kvstore events tail ... | head -n 2``)
the tool stops quietly with exit code 0, its stdout pointed at /dev/null as
Python's documentation advises for SIGPIPE.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from typing import IO

import msgspec

from kvstore.errors import ConfigError, EventDecodeError
from kvstore.events import EventBatch
from kvstore.subscriber import EventListener, load_client_cert

SYNC_FAILURES_TO_WARN = 3  # recoveries that time out before the replay endpoint is called unreachable


class JsonLinesSink:
    """A BatchSink that writes one JSON object per event; stops after ``limit`` events, or when ``out`` can
    no longer be written (``closed``: its reader has gone)."""

    def __init__(self, out: IO[str], limit: int | None) -> None:
        self._out = out
        self._limit = limit
        self._encoder = msgspec.json.Encoder()
        self.count = 0
        self.closed = False
        self.done = threading.Event()

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        lines = []
        for event in batch.events:
            if self.done.is_set():
                break
            record = msgspec.to_builtins(event)
            record.update(producer=producer, seq=seq, ts=batch.ts)
            if batch.data_parallel_rank is not None:
                record["data_parallel_rank"] = batch.data_parallel_rank
            lines.append(self._encoder.encode(record).decode() + "\n")
            self.count += 1
            if self._limit is not None and self.count >= self._limit:
                self.done.set()
        self._write("".join(lines))

    def reset_producer(self, producer: str) -> None:
        self._write(self._encoder.encode({"type": "Resync", "producer": producer}).decode() + "\n")

    def _write(self, text: str) -> None:
        if self.closed:
            return
        try:
            self._out.write(text)
            self._out.flush()
        except OSError:  # BrokenPipeError: the reader has gone (| head); any other: nowhere to write
            self.closed = True
            self.done.set()

    def decode_error(self, producer: str, error: EventDecodeError) -> None:
        print(f"kvstore events tail: dropped an undecodable batch from {producer}: {error}", file=sys.stderr)


def _check_endpoint(value: str, flag: str) -> str:
    if not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"{flag} must be a ZeroMQ endpoint like tcp://127.0.0.1:5557, got {value!r}")
    return value


def run(args: argparse.Namespace) -> int:
    endpoint = _check_endpoint(args.endpoint, "--endpoint")
    replay = _check_endpoint(args.replay_endpoint, "--replay-endpoint") if args.replay_endpoint else None
    if args.count is not None and args.count < 1:
        raise ConfigError("--count must be >= 1")
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        raise ConfigError(f"--duration must be a number of seconds > 0, got {args.duration}")
    cert = args.curve_client_cert
    client_keys = None if cert is None else load_client_cert(cert, field="--curve-client-cert")
    sink = JsonLinesSink(sys.stdout, args.count)
    listener = EventListener(sink, on_decode_error=sink.decode_error)
    listener.add_producer(
        args.name, endpoint, replay, topic=args.topic, curve_server_key=args.curve_server_key,
        curve_client_keys=client_keys,
    )  # fmt: skip
    listener.start()
    deadline = None if args.duration is None else time.monotonic() + args.duration
    warned = False
    try:
        while not sink.done.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            sink.done.wait(0.1)
            if replay is not None and not warned:
                warned = _warn_when_sync_fails(listener, replay)
    finally:
        listener.close()
    if sink.closed:
        _discard_stdout()
    return 0


def _warn_when_sync_fails(listener: EventListener, replay: str) -> bool:
    """Print one stderr line (and return True) once recoveries from ``replay`` keep timing out."""
    failures = max((h.sync_timeouts for h in listener.health()), default=0)
    if failures < SYNC_FAILURES_TO_WARN:
        return False
    print(
        f"kvstore events tail: no answer from --replay-endpoint {replay} after {failures} tries; events are "
        "held until a recovery completes (is it the producer's replay endpoint?); still trying",
        file=sys.stderr,
    )
    return True


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush to a reader that has gone does not fail."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture): nothing of ours to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    events = subparsers.add_parser("events", help="KV event stream tools")
    events_sub = events.add_subparsers(dest="events_command", required=True, metavar="ACTION")
    tail = events_sub.add_parser("tail", help="print decoded KV events as JSON lines")
    tail.add_argument("--endpoint", required=True, help="the producer's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    tail.add_argument("--replay-endpoint", default=None, help="its ROUTER endpoint, for gap recovery")
    tail.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    tail.add_argument("--name", default="producer", help="label printed with each event")
    tail.add_argument(
        "--curve-server-key",
        default=None,
        metavar="KEY",
        help="the producer's CURVE public key (Z85), when it publishes with CURVE (events.curve_public_key); "
        "write --curve-server-key=KEY, since a Z85 key may begin with '-'",
    )
    tail.add_argument(
        "--curve-client-cert",
        default=None,
        metavar="FILE",
        help="the secret certificate file (zmq.auth.create_certificates' .key_secret) of a client the producer "
        "lists in events.curve_allowed_client_keys",
    )
    tail.add_argument("--count", type=int, default=None, help="stop after this many events")
    tail.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    tail.set_defaults(func=run)
