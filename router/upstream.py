"""HTTP/1.1 to one external replica, for relaying a client's request: the body in, the answer out, nothing read.

The router forwards every completion to a replica and relays the answer
chunk by chunk, so this is its hot path: for a stream of N tokens it runs
once per request and N times per chunk. A general client (httpx) spends
most of the router's CPU here -- a connection pool scanned per request,
several layers of async iterators per chunk -- so the relay has its own
small client instead. It does only what relaying needs:

- ``POST`` with a body of known length; the answer's status and headers as
  soon as they arrive, its body as the replica frames it (chunked, by
  Content-Length, or to the end of the connection), de-chunked;
- keep-alive connections, reused while idle and younger than ``idle_s``
  (under uvicorn's 5 s keep-alive, so the replica does not close one as it
  is reused); one kept per stream in flight, never a cap -- a vLLM replica
  serves hundreds of streams at once;
- ``https://`` with the system's trust store.

Closing an answer before its end closes its connection: that is how a
replica (vLLM) learns that the client went away and aborts the request.

Headers go both ways as lists of (name, value) pairs, in order and
repeated as they came (``set-cookie``); an answer also has them as a
mapping for looking one up (repeated values joined with ", ").

Errors: :class:`UpstreamError` when the replica gave no answer -- refused,
reset or timed out before its status line, or a malformed answer;
:class:`UpstreamTimeout` (one of them) when the request was sent and no
status line came within ``timeout_s``. Its connection is closed, which is
how vLLM learns to abort it; the caller must not send it again (vLLM writes
a plain answer's status line only once the whole decode is done: the
replica is slow, not gone). Sent once means once: a request is written a
second time only when the replica provably never took it -- a pooled
connection that ends (a clean EOF, not a reset) before any byte of an answer,
which is the replica having closed it while idle -- and then once at most,
on a new connection. A pooled connection is checked before reuse (its end
already seen, its transport closing: it is dropped). Timeouts: ``connect_s``
to connect, ``timeout_s`` for the status line and for each read of the body
(:class:`_Stall`; a read that waits longer fails the body with TimeoutError).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

_HEAD_LIMIT = 64 * 1024  # status line and headers; more is a malformed answer
_READ = 64 * 1024  # the most read at once from a body framed by length or by the connection's end


class UpstreamError(Exception):
    """The replica gave no (well-formed) answer; nothing of it reached the client."""


class UpstreamTimeout(UpstreamError):
    """The request went out and no status line came back in time; its connection is closed (the replica aborts)."""


Header = tuple[str, str]


class _Connection:
    __slots__ = ("idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        self.writer.close()


class UpstreamAnswer(NamedTuple):
    """The replica's status and headers (names lower-cased); ``body`` yields its bytes, ``close`` drops the rest.

    ``fields``: the headers as they came, in order, a repeated one repeated; ``headers``: the same as a mapping
    for lookups, a repeated header's values joined with ", " (wrong for ``set-cookie``: relay ``fields``).
    """

    status: int
    headers: Mapping[str, str]
    body: AsyncIterator[bytes]
    close: _Closer
    fields: list[Header]


class _Closer:
    """Ends an answer: a connection read to its end goes back to the pool, any other is closed."""

    __slots__ = ("_connection", "_pool", "done")

    def __init__(self, pool: UpstreamPool, connection: _Connection) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self.done = False  # the body was read to its end and the connection may be reused

    async def __call__(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self.done:
            self._pool.release(connection)
        else:
            connection.close()


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to one base URL (``http://host:port[/prefix]`` or ``https://``)."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_s: float = 5.0, idle_s: float = 4.0) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {base_url!r}")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        self._authority = url.netloc.rsplit("@", 1)[-1].encode("ascii")
        self._timeout = timeout_s
        self._connect = connect_s
        self._idle_s = idle_s
        self._idle: deque[_Connection] = deque()

    async def post(self, target: str, body: bytes, headers: Mapping[str, str] | Iterable[Header]) -> UpstreamAnswer:
        """POST ``body`` to the prefix + ``target`` (a path, with its ``?query`` if any) with ``headers``.

        ``headers``: a mapping or (name, value) pairs, sent in order (none of them about the connection or
        the length). Returns once the status line and headers arrived. Raises UpstreamError, UpstreamTimeout
        (module docstring).
        """
        head = self._head(target, len(body), headers.items() if isinstance(headers, Mapping) else headers)
        fresh = False
        while True:
            connection, reused = await self._get(fresh=fresh)
            sent = False
            try:
                connection.writer.write(head + body)
                sent = True
                async with asyncio.timeout(self._timeout):
                    try:
                        first = await connection.reader.readuntil(b"\r\n")
                    except asyncio.IncompleteReadError as exc:
                        if reused and not fresh and not exc.partial:
                            # A clean end before any byte of an answer on a pooled connection: the replica had
                            # closed it while idle, and so never took the request (one that took it and failed
                            # answers 5xx, or resets). Once, on a new connection: never a loop over the pool.
                            connection.close()
                            fresh = True
                            continue
                        raise
                    status, answer_fields = await _read_head(connection.reader, first)
            except TimeoutError:
                connection.close()  # vLLM aborts a request whose connection closed
                if sent:
                    raise UpstreamTimeout(f"timed out: no status line within {self._timeout:g} s") from None
                raise UpstreamError("timed out") from None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
                connection.close()
                raise UpstreamError(_describe(exc)) from None
            except BaseException:  # cancelled (the client left): the replica learns it from the closed connection
                connection.close()
                raise
            answer_headers = _joined(answer_fields)
            closer = _Closer(self, connection)
            return UpstreamAnswer(
                status,
                answer_headers,
                self._body(connection, status, answer_headers, closer),
                closer,
                answer_fields,
            )

    def release(self, connection: _Connection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.append(connection)

    async def close(self) -> None:
        while self._idle:
            self._idle.popleft().close()

    def _head(self, target: str, length: int, headers: Iterable[Header]) -> bytes:
        lines = [b"POST ", (self._prefix + target).encode("ascii"), b" HTTP/1.1\r\nhost: ", self._authority, b"\r\n"]
        for name, value in headers:
            lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        lines.append(b"accept-encoding: identity\r\ncontent-length: %d\r\n\r\n" % length)
        return b"".join(lines)

    async def _get(self, *, fresh: bool = False) -> tuple[_Connection, bool]:
        """An idle pooled connection still open (the most recent first), else -- or when ``fresh`` -- a new one."""
        now = time.monotonic()
        idle = self._idle
        while idle and now - idle[0].idle_since >= self._idle_s:  # the oldest first: a burst's leftovers
            idle.popleft().close()
        while idle and not fresh:
            connection = idle.pop()  # the most recent: the least likely to have been closed by the replica
            if not connection.reader.at_eof() and not connection.writer.is_closing():
                return connection, True
            connection.close()
        try:
            async with asyncio.timeout(self._connect):
                reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._ssl, limit=_HEAD_LIMIT)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(_describe(exc)) from None
        return _Connection(reader, writer), False

    async def _body(
        self, connection: _Connection, status: int, headers: Mapping[str, str], closer: _Closer
    ) -> AsyncIterator[bytes]:
        reader = connection.reader
        keep = headers.get("connection", "").lower() != "close"
        stall = _Stall(connection, self._timeout)
        now = stall.clock
        try:
            if status in (204, 304):
                pass
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                while True:
                    stall.reading_since = now()
                    size = _chunk_size(await reader.readuntil(b"\r\n"))
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    stall.reading_since = None
                    yield data[:-2]
            elif (length := headers.get("content-length")) is not None:
                left = int(length)
                while left > 0:
                    stall.reading_since = now()
                    data = await reader.read(min(left, _READ))
                    stall.reading_since = None
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                keep = False  # the body ends with the connection
                while True:
                    stall.reading_since = now()
                    data = await reader.read(_READ)
                    stall.reading_since = None
                    if not data:
                        break
                    yield data
            if stall.expired:  # the abort looked like the end of a body that ends with the connection
                raise TimeoutError(f"no byte of the answer's body for {self._timeout:g} s")
            closer.done = keep
        except (OSError, asyncio.IncompleteReadError):
            if stall.expired:
                raise TimeoutError(f"no byte of the answer's body for {self._timeout:g} s") from None
            raise
        finally:
            stall.cancel()
            await closer()


class _Stall:
    """Aborts an answer's connection once one read of its body has waited ``timeout_s``.

    One timer per answer rather than a timeout scope per read: a stream's
    every chunk is a read, and arming and cancelling a timer each time was a
    visible share of what relaying a chunk costs. The body's reader marks
    when a read starts (``reading_since``) and clears it when the read
    returned -- the time the consumer holds the chunk (a slow client) does not
    count. The timer, when it fires, re-arms for what is left of the current
    read's allowance, or aborts the connection: the pending read then fails,
    and the body raises TimeoutError.
    """

    __slots__ = ("_handle", "_loop", "_timeout", "_transport", "clock", "expired", "reading_since")

    def __init__(self, connection: _Connection, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout_s
        self._transport = connection.writer.transport
        self.clock = self._loop.time
        self.expired = False
        self.reading_since: float | None = None
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(timeout_s, self._check)

    def _check(self) -> None:
        since = self.reading_since
        waited = 0.0 if since is None else self.clock() - since
        if waited >= self._timeout:
            self.expired = True
            self._handle = None
            self._transport.abort()
        else:
            self._handle = self._loop.call_later(self._timeout - waited, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def _read_head(reader: asyncio.StreamReader, status_line: bytes) -> tuple[int, list[Header]]:
    """The status and headers of the next final (non-1xx) answer on ``reader``, whose first line was read.

    Headers come as they were sent, in order (names lower-cased), a repeated one repeated.
    """
    while True:
        if not status_line.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(status_line[9:12])
        fields: list[Header] = []
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            if not _HEADER_LINE.fullmatch(line):  # a name that is no token, a control byte in a value
                raise ValueError(f"malformed header line {line[:80]!r}")
            name, _, value = line.decode("latin-1").partition(":")
            fields.append((name.lower(), value.strip(" \t\r\n")))
        if status_line.startswith(b"HTTP/1.0") and not any(name == "connection" for name, _ in fields):
            fields.append(("connection", "close"))  # HTTP/1.0's default, said: the connection is not reused
        lengths = [value for name, value in fields if name == "content-length"]
        length = ", ".join(lengths) if lengths else None
        if length is not None and not (length.isascii() and length.isdigit()):  # negative, two values, text
            raise ValueError(f"bad Content-Length {length[:40]!r}")
        if status >= 200:
            return status, fields
        status_line = await reader.readuntil(b"\r\n")


def _joined(fields: list[Header]) -> dict[str, str]:
    """``fields`` as a mapping for lookups: a repeated header's values joined with ", " (RFC 9110's list form)."""
    headers: dict[str, str] = {}
    for name, value in fields:
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


# RFC 9110: a header name is a token; a value has no control bytes but horizontal tab.
_HEADER_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00-\x08\x0a-\x1f\x7f]*\r\n")


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip()
    if not digits or len(digits) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in digits):
        raise ValueError(f"bad chunk size line {line[:40]!r}")
    return int(digits, 16)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the connection closed before an answer"
    if isinstance(exc, asyncio.LimitOverrunError):
        return "the answer's headers are too long"
    return f"{type(exc).__name__}: {exc}"
