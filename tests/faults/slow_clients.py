"""Slow and idle HTTP clients (slowloris), on raw sockets, for the connection-limit fault tests.

Each client does one thing wrong -- connects and says nothing, sends half its
headers, sends its headers and half its body, drips its headers a byte at a
time, or idles after a response -- and :func:`held_for` measures how long the
server keeps the connection and what it answers before closing it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
BODY = b'{"prompt": [1, 2, 3], "max_tokens": 1}'


class Held(NamedTuple):
    seconds: float  # until the server closed the connection (or the bound ran out)
    closed: bool  # False: still open when the bound ran out
    answer: bytes  # what the server sent before closing


def _nothing(sock: socket.socket) -> None:
    pass


def _half_headers(sock: socket.socket) -> None:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")


def _half_body(sock: socket.socket) -> None:
    sock.sendall(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])


def _dripped_headers(sock: socket.socket) -> None:
    threading.Thread(target=_drip, args=(sock, HEAD + b"X-Slow: " + b"a" * 400), daemon=True).start()


def _drip(sock: socket.socket, data: bytes) -> None:
    for byte in data:  # one byte every 0.2 s: each arrives well within any per-read timeout
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return
        time.sleep(0.2)


def _idle_after_a_request(sock: socket.socket) -> None:
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")


CLIENTS: dict[str, Callable[[socket.socket], None]] = {
    "says nothing": _nothing,
    "half its headers": _half_headers,
    "half its body": _half_body,
    "drips its headers": _dripped_headers,
    "idles after a response": _idle_after_a_request,
}


def held_for(port: int, behave: Callable[[socket.socket], None], bound_s: float) -> Held:
    """Connect, ``behave``, then read until the server closes the connection or ``bound_s`` passes."""
    started = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=bound_s) as sock:
        behave(sock)
        deadline = started + bound_s
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return Held(time.monotonic() - started, True, answer)
            if not data:
                return Held(time.monotonic() - started, True, answer)
            answer += data
    return Held(time.monotonic() - started, False, answer)


def all_held(port: int, bound_s: float) -> dict[str, Held]:
    """Every client of :data:`CLIENTS` at once, each on its own connection."""
    results: dict[str, Held] = {}
    threads = [
        threading.Thread(target=lambda n=name, b=behave: results.__setitem__(n, held_for(port, b, bound_s)))
        for name, behave in CLIENTS.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(bound_s + 10)
    return results


def status_of(answer: bytes) -> int | None:
    """The status of the last response in ``answer`` (None: no response)."""
    at = answer.rfind(b"HTTP/1.1 ")
    return int(answer[at + 9 : at + 12]) if at >= 0 else None
