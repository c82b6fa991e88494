"""CURVE client allow-lists (ZAP) when publishers share a ZeroMQ context, as a worker and its tier do.

Real publishers and raw CURVE SUB sockets on loopback: a listed client hears
its publisher, an unlisted one does not, and a publisher without a list
still admits any client holding its server key -- the one ZAP handler of the
context must not change that.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvstore import curve_auth
from kvstore.config import EventsConfig
from kvstore.errors import ConfigError
from kvstore.publisher import ZmqEventPublisher
from kvstore.subscriber import load_client_cert

Keys = tuple[str, str]  # (public, secret), Z85


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def keypair() -> Keys:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def curve_publisher(ctx: zmq.Context[zmq.Socket[bytes]], server: Keys, allowed: tuple[str, ...]) -> ZmqEventPublisher:
    config = EventsConfig(curve_public_key=server[0], curve_secret_key=server[1], curve_allowed_client_keys=allowed)
    return ZmqEventPublisher(config, context=ctx)


def hears(ctx: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher, server: Keys, client: Keys) -> bool:
    """Whether a CURVE SUB with ``client``'s keys receives anything within 1.5 s of batches every 20 ms."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.curve_serverkey = server[0].encode()
    sub.curve_publickey, sub.curve_secretkey = client[0].encode(), client[1].encode()
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            publisher.publish([])
            if sub.poll(20):
                return True
        return False
    finally:
        sub.close(linger=0)


def test_publishers_sharing_a_context_each_keep_their_own_admission(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    server_a, server_b, server_c = keypair(), keypair(), keypair()
    listed_a, listed_b, nobody = keypair(), keypair(), keypair()
    a = curve_publisher(ctx, server_a, (listed_a[0],))
    b = curve_publisher(ctx, server_b, (listed_b[0],))
    open_to_all = curve_publisher(ctx, server_c, ())
    try:
        assert hears(ctx, a, server_a, listed_a) and not hears(ctx, a, server_a, listed_b)
        assert hears(ctx, b, server_b, listed_b) and not hears(ctx, b, server_b, listed_a)
        assert not hears(ctx, a, server_a, nobody)
        assert hears(ctx, open_to_all, server_c, nobody)  # no list: any client with the server key
        a.close()
        b.close()
        assert id(ctx) not in curve_auth._contexts  # the handler went with the last list
        # The handler's inproc ZAP endpoint goes with its socket, which ZeroMQ closes in the background: a
        # handshake started in that moment asks a handler that will never answer, and stalls (that client alone,
        # until its handshake times out). A new client after it is let through, as with no handler at all.
        assert any(hears(ctx, open_to_all, server_c, nobody) for _ in range(3))
    finally:
        for publisher in (a, b, open_to_all):
            publisher.close()


def test_a_client_certificate_path_that_is_no_certificate_file_is_one_clear_error(tmp_path: Path) -> None:
    """A directory, a FIFO (whose read would wait forever for a writer) or a huge file named as the client
    certificate: a ConfigError naming the field, at once."""
    fifo = tmp_path / "cert.fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.key_secret"
    huge.write_bytes(b"#" * (1 << 20))
    for path, message in [(tmp_path, "not a regular file"), (fifo, "not a regular file"),
                          (huge, "larger than a CURVE certificate"), (tmp_path / "none", "no file")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message) as info:
            load_client_cert(str(path), field="router.curve_client_cert")
        assert str(info.value).startswith("router.curve_client_cert: ")
