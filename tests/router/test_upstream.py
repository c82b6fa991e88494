"""The relay's HTTP/1.1 client against scripted servers: framing, keep-alive, and what counts as no answer."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from kvstore.router.upstream import UpstreamAnswer, UpstreamError, UpstreamPool, UpstreamTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Script:
    """A TCP server answering each request with the next handler; records what each connection received."""

    def __init__(self, *handlers: Handler) -> None:
        self._handlers = list(handlers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Script:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/prefix"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self._handlers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                await self._handlers.pop(0)(reader, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def answer(raw: bytes, *, then_close: bool = False) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(raw)
        if then_close:
            await writer.drain()
            writer.close()

    return handler


def hang_up() -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    return handler


async def read(result: UpstreamAnswer) -> bytes:
    return b"".join([data async for data in result.body])


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
CHUNKS = b"6\r\ndata: \r\n3;ext=1\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n"


def run(coroutine: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 10))  # type: ignore[arg-type]


def test_a_chunked_answer_is_de_chunked_and_its_connection_reused() -> None:
    async def main() -> None:
        created = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"
        async with Script(answer(CHUNKED + CHUNKS), answer(created)) as s:
            pool = UpstreamPool(s.url, timeout_s=5)
            first = await pool.post("/v1/completions", b'{"a": 1}', {"x-h": "v"})
            assert first.status == 200 and first.headers["content-type"] == "text/event-stream"
            assert [data async for data in first.body] == [b"data: ", b"abc"]
            second = await pool.post("/v1/completions", b"{}", {})
            assert (second.status, await read(second)) == (201, b"ok")
            assert s.connections == 1, "the finished answer's connection was reused"
            head = s.requests[0].decode()
            assert head.startswith("POST /prefix/v1/completions HTTP/1.1\r\n")
            assert "\r\nx-h: v\r\n" in head and "\r\naccept-encoding: identity\r\n" in head
            assert head.endswith('content-length: 8\r\n\r\n{"a": 1}')
            await pool.close()

    run(main())


def test_informational_answers_are_skipped_and_repeated_headers_kept_apart_and_joined_for_lookups() -> None:
    raw = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nx: 1\r\nset-cookie: a=1; Expires=Wed, 21 Oct\r\n"
           b"X: 2\r\nSet-Cookie: b=2\r\ncontent-length: 3\r\n\r\nnah")  # fmt: skip
    fields = [("x", "1"), ("set-cookie", "a=1; Expires=Wed, 21 Oct"), ("x", "2"), ("set-cookie", "b=2"),
              ("content-length", "3")]  # fmt: skip
    await_main = _one_answer(
        raw, lambda a, body: (a.status, a.headers["x"], a.fields, body) == (404, "1, 2", fields, b"nah")
    )
    run(await_main)


def test_repeated_request_headers_and_a_query_string_are_sent_as_given() -> None:
    async def main() -> None:
        async with Script(answer(b"HTTP/1.1 204 No Content\r\n\r\n")) as s:
            pool = UpstreamPool(s.url, timeout_s=5)
            await read(await pool.post("/v1/completions?a=1&b=%20", b"{}", [("x-d", "1"), ("x-e", "e"), ("x-d", "2")]))
            head = s.requests[0].decode()
            assert head.startswith("POST /prefix/v1/completions?a=1&b=%20 HTTP/1.1\r\n")
            assert "\r\nx-d: 1\r\nx-e: e\r\nx-d: 2\r\n" in head
            await pool.close()

    run(main())


def test_a_body_to_the_end_of_the_connection_and_http_1_0_are_not_reused() -> None:
    async def main() -> None:
        for raw in (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"):
            async with Script(answer(raw, then_close=True), answer(raw, then_close=True)) as s:
                pool = UpstreamPool(s.url, timeout_s=5)
                for _ in range(2):
                    result = await pool.post("/x", b"", {})
                    assert await read(result) in (b"until the end", b"ok")
                assert s.connections == 2
                await pool.close()

    run(main())


def test_a_kept_connection_the_server_closed_is_replaced_without_an_error() -> None:
    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        async with Script(answer(ok), hang_up(), answer(ok)) as s:
            pool = UpstreamPool(s.url, timeout_s=5)
            assert await read(await pool.post("/x", b"1", {})) == b"ok"
            assert await read(await pool.post("/x", b"2", {})) == b"ok"  # the first connection died under it
            assert s.connections == 2 and [r[-1:] for r in s.requests] == [b"1", b"2", b"2"]
            await pool.close()

    run(main())


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (hang_up(), "closed before an answer"),
        (answer(b"SSH-2.0\r\n"), "not an HTTP/1.x status line"),
        # Headers a client could not be sent (the relay passes a replica's headers on): refused here.
        (answer(b"HTTP/1.1 200 OK\r\nX-Bad\xff\xfe: \x00\x01\r\ncontent-length: 2\r\n\r\n{}"), "malformed header line"),
        (answer(b"HTTP/1.1 200 OK\r\nx: a\x7fb\r\ncontent-length: 2\r\n\r\n{}"), "malformed header line"),
        (answer(b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n"), "malformed header line"),
        (answer(b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n{}"), "bad Content-Length '-5'"),
        (answer(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 50\r\n\r\n{}"), "bad Content-Length"),
    ],
)
def test_no_answer_is_an_upstream_error(handler: Handler, message: str) -> None:
    async def main() -> None:
        async with Script(handler) as s:
            with pytest.raises(UpstreamError, match=message):
                await UpstreamPool(s.url, timeout_s=5).post("/x", b"", {})

    run(main())


def test_a_bad_chunk_size_ends_the_body_with_a_plain_error() -> None:
    async def main() -> None:
        async with Script(answer(CHUNKED + b"ZZZ\r\n", then_close=True)) as s:
            result = await UpstreamPool(s.url, timeout_s=5).post("/x", b"", {})
            with pytest.raises(ValueError, match="bad chunk size line b'ZZZ"):
                await read(result)

    run(main())


def test_refused_and_silent_replicas_are_upstream_errors() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async def main() -> None:
        async with Script(silent) as s:
            url = s.url
            with pytest.raises(UpstreamTimeout, match=r"timed out: no status line within 0\.2 s"):
                await UpstreamPool(url, timeout_s=0.2).post("/x", b"", {})
            assert len(s.requests) == 1, "a request that timed out is never sent again"
        with pytest.raises(UpstreamError, match="ConnectionRefused"):
            await UpstreamPool(url, timeout_s=5).post("/x", b"", {})

    run(main())


def test_closing_an_answer_before_its_end_closes_the_connection() -> None:
    async def main() -> None:
        closed = asyncio.Event()

        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(CHUNKED)
            try:
                while True:
                    writer.write(b"1\r\nx\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.01)
            except ConnectionError:
                closed.set()

        async with Script(endless) as s:
            result = await UpstreamPool(s.url, timeout_s=5).post("/x", b"", {})
            assert await anext(aiter(result.body)) == b"x"
            await result.close()
            await asyncio.wait_for(closed.wait(), 5)

    run(main())


def test_a_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="http"):
        UpstreamPool("ftp://x", timeout_s=1)


async def _one_answer(raw: bytes, check: Callable[[UpstreamAnswer, bytes], bool]) -> None:
    async with Script(answer(raw)) as s:
        result = await UpstreamPool(s.url, timeout_s=5).post("/x", b"", {})
        assert check(result, await read(result))


def test_connections_idle_too_long_are_closed_not_reused() -> None:
    async def main() -> None:
        ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
        async with Script(*[answer(ok)] * 4) as s:
            pool = UpstreamPool(s.url, timeout_s=5, idle_s=0.1)
            first, second = await pool.post("/x", b"", {}), await pool.post("/x", b"", {})
            assert [await read(first), await read(second)] == [b"ok", b"ok"] and s.connections == 2
            await asyncio.sleep(0.2)
            assert await read(await pool.post("/x", b"", {})) == b"ok"
            assert s.connections == 3 and len(pool._idle) == 1, "both stale ones closed, the new one kept"
            await pool.close()

    run(main())


@pytest.mark.parametrize(
    "head",
    [
        CHUNKED,
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n",  # the body ends with the connection
    ],
    ids=["chunked", "content-length", "to-the-end"],
)
def test_a_body_that_stalls_times_out_and_a_slow_reader_does_not(head: bytes) -> None:
    first = b"6\r\ndata: \r\n" if head is CHUNKED else b"data: "

    def stalls(after: bytes) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(head + first)
            await writer.drain()
            await asyncio.sleep(after)
            writer.write(b"3\r\nabc\r\n0\r\n\r\n" if head is CHUNKED else b"abc")
            await writer.drain()
            await asyncio.sleep(5)

        return handler

    async def main() -> None:
        # The replica goes silent mid-body for longer than timeout_s: the body fails as timed out, in time.
        async with Script(stalls(after=5)) as s:
            answer = await UpstreamPool(s.url, timeout_s=0.3).post("/x", b"", {})
            started = asyncio.get_running_loop().time()
            chunks = []
            with pytest.raises(TimeoutError, match=r"no byte of the answer's body for 0\.3 s"):
                async for data in answer.body:
                    chunks.append(data)
            waited = asyncio.get_running_loop().time() - started
            assert chunks == [b"data: "] and 0.25 < waited < 1.0, (chunks, waited)
        # The replica is prompt but the reader holds each chunk longer than timeout_s: time it holds one does
        # not count against the replica.
        async with Script(stalls(after=0.05)) as s:
            answer = await UpstreamPool(s.url, timeout_s=0.3).post("/x", b"", {})
            got = b""
            async for data in answer.body:
                got += data
                await asyncio.sleep(0.5)
                if len(got) == 9:
                    break
            assert got == b"data: abc"
            await answer.close()

    run(main())


class Poison:
    """A keep-alive HTTP server that answers every request but a poisoned one, which it reads and then drops
    without an answer -- by a reset (``abort``) or by closing the connection cleanly -- and counts."""

    def __init__(self, drop: str) -> None:
        self.drop = drop
        self.poisoned = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if b"poison" in await reader.readexactly(length):
                    self.poisoned += 1
                    await asyncio.sleep(0.02)
                    if self.drop == "reset":  # a close that discards the connection: the peer gets a reset
                        writer.get_extra_info("socket").setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                    writer.close()
                    return
                await asyncio.sleep(0.05)  # long enough for the requests of a burst to overlap
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.mark.parametrize(("drop", "times"), [("reset", 1), ("close", 2)])
def test_a_request_the_replica_took_and_dropped_is_not_sent_again_on_every_pooled_connection(
    drop: str, times: int
) -> None:
    """A replica that read a request and then dropped its connection without answering has the request: it is
    not written again on each idle pooled connection in turn. A reset is no answer, and final; a clean close
    before any byte is what a replica closing an idle connection looks like, so that alone is resent -- once,
    on a new connection."""

    async def main() -> None:
        poison = Poison(drop)
        pool = UpstreamPool(await poison.start(), timeout_s=5)
        burst = await asyncio.gather(*[pool.post("/x", b"{}", {}) for _ in range(8)])
        assert [await read(answer) for answer in burst] == [b"ok"] * 8 and len(pool._idle) == 8
        with pytest.raises(UpstreamError):
            await pool.post("/x", b'{"user": "poison"}', {})
        assert poison.poisoned == times
        assert await read(await pool.post("/x", b"{}", {})) == b"ok", "the pool serves on"
        await pool.close()
        assert poison.server is not None
        poison.server.close()

    run(main())
