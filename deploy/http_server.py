"""The HTTP server of every front a config starts (``kvstore serve``, ``kvstore router``, ``kvstore worker``).

uvicorn, with the ``router`` section's limits on what a connection may cost:

- ``header_timeout_s``: a request's headers must arrive within this of the
  connection opening (or of the request's first byte after a keep-alive
  pause). uvicorn has no such deadline: a connection that sends half a
  request line, or nothing, is held for as long as the client likes.
- ``body_timeout_s``: the whole body within this of the headers, however
  slowly it drips.
- ``keep_alive_s``: an idle keep-alive connection is closed (uvicorn's own).
- ``max_connections``: connections beyond it are answered 503 and closed on
  arrival, before they cost a request.
- ``drain_timeout_s``: on SIGINT or SIGTERM, requests in flight get this long;
  then their connections are closed (503 if no response has started), which
  the app sees as clients that hung up: their work is cancelled the usual
  way, not torn down mid-await. uvicorn's own graceful-shutdown timeout,
  a few seconds later, is only the backstop.

A connection past a deadline gets a 408 (if its request has no response
yet) and is closed; its request, if the app was already running it, sees
the disconnect as a client that hung up. The deadlines live on the
connection (:class:`GuardedHttpProtocol`), so they hold whatever the app does,
with or without an API key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvstore.errors import ConfigError
from kvstore.router.config import MAX_PORT, RouterConfig

_ERROR_TYPES = {408: "RequestTimeoutError", 503: "ServiceUnavailableError"}
_BACKSTOP_S = 5.0  # after the drain deadline closed the connections, their requests get this long to unwind


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools connection with deadlines on a request's headers and body, and a connection limit.

    httptools (llhttp, in C) rather than uvicorn's pure-Python h11: the router relays every chunk of every
    stream through here, and h11's per-event Python was a large share of what a stream costs it.

    A subclass made by :func:`guarded_protocol` sets :attr:`limits`. Phases of a connection: waiting for a
    request's headers (deadline ``header_timeout_s``), reading its body (``body_timeout_s``), then neither
    while the app answers; after a response, uvicorn's keep-alive timer closes an idle connection. Where the
    parser is in the current request (``_reading``) comes from its callbacks: ``idle`` before a request's
    first byte, ``headers`` from it, ``body`` once the headers are in, ``done`` once the request is.
    """

    limits: ClassVar[RouterConfig]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._reading = "idle"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"more than {self.limits.max_connections} open connections; try again later")
            return
        self._arm("headers", self.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = "headers"

    def on_headers_complete(self) -> None:
        self._reading = "body"
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = "done"
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server is stopping: an idle connection closes now, a busy one at the drain deadline."""
        super().shutdown()
        if not self.transport.is_closing():
            self._disarm()
            self._phase = "drain"
            self._deadline = self.loop.call_later(self.limits.drain_timeout_s, self._expire, "drain")

    def _follow(self) -> None:
        """Re-arm the deadline for the phase the request is in now."""
        if self.transport.is_closing():
            self._disarm()
            return
        reading = self._reading
        if reading == "body":
            self._arm("body", self.limits.body_timeout_s)
        elif reading == "headers":
            # Part of a request is here -- the first, or the next on a kept-alive connection: its headers are
            # due. (While a response is still going out, its successor's bytes wait in the same phase.)
            self._arm("headers", self.limits.header_timeout_s)
        elif self.cycle is not None and self.cycle.response_complete:
            self._disarm()  # idle after a response: uvicorn's keep-alive timer closes it
        elif reading == "done":
            self._disarm()  # the request is complete: the app is answering

    def _arm(self, phase: str, timeout_s: float) -> None:
        if self._phase == phase:
            return  # the deadline runs from the phase's start, not from its last byte
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(timeout_s, self._expire, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _expire(self, phase: str) -> None:
        self._deadline = None
        if phase == "drain":
            self._refuse(503, f"the server is shutting down; requests get {self.limits.drain_timeout_s:g} s to finish")
            return
        limit = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
        self._refuse(408, f"the request's {phase} did not arrive within {limit:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` if no response has started, then close the connection."""
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            body = json.dumps(
                {"error": {"message": message, "type": _ERROR_TYPES[status], "param": None, "code": status}}
            ).encode()
            head = (
                f"HTTP/1.1 {status} {'Request Timeout' if status == 408 else 'Service Unavailable'}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        if cycle is not None:
            cycle.disconnected = True  # the app's later writes are dropped; it sees a client that left
            cycle.message_event.set()
        self._disarm()
        self.transport.close()


def guarded_protocol(limits: RouterConfig) -> type[GuardedHttpProtocol]:
    """A :class:`GuardedHttpProtocol` with ``limits`` (uvicorn builds one per connection)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


def server_config(app: Any, limits: RouterConfig, **options: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` under ``limits`` (the ``router`` section); ``options`` go to uvicorn as is."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(limits),  # type: ignore[arg-type]
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=limits.drain_timeout_s + _BACKSTOP_S,  # type: ignore[arg-type]
        log_level=options.pop("log_level", "warning"),
        **options,
    )


def port_number(text: str) -> int:
    """argparse ``type`` of a ``--port``: 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to {MAX_PORT}, got {port}")
    return port


def bind_socket(host: str, port: int, what: str) -> socket.socket:
    """A listening socket on ``host:port`` for uvicorn (``server.run(sockets=[...])``), bound before anything
    is printed or started: a front prints the port it really has (``--port 0``), and a port it cannot have is
    one ConfigError line, not a banner followed by uvicorn's traceback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind {what} to {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
