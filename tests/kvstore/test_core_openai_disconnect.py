"""``until_disconnected``: work runs in the caller's task, a client that leaves cancels it, nothing else changes.

A real ASGI receive channel stands in for the server's: the test decides when
the client's disconnect arrives.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from kvstore.openai.http import ClientDisconnected, until_disconnected


class Client:
    """The ASGI receive side of one request: its body was read, the next message is the disconnect."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def request(self) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, self.receive)


def test_work_runs_in_the_callers_task_and_its_result_comes_back() -> None:
    async def main() -> None:
        client = Client()
        caller = asyncio.current_task()
        ran_in: list[asyncio.Task[Any] | None] = []

        async def work() -> int:
            ran_in.append(asyncio.current_task())
            await asyncio.sleep(0.01)
            return 7

        assert await until_disconnected(client.request(), work()) == 7
        assert ran_in == [caller]
        client.left.set()  # a disconnect after the work is done cancels nothing
        await asyncio.sleep(0.01)
        assert caller is not None and caller.cancelling() == 0
        await asyncio.sleep(0)  # the task can still await: no cancellation is pending

    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_work_and_the_caller_goes_on() -> None:
    async def main() -> None:
        client = Client()
        cleaned_up = asyncio.Event()

        async def work() -> int:
            try:
                await asyncio.sleep(30)
            finally:
                cleaned_up.set()  # what the relay does here: close the upstream connection
            return 1

        asyncio.get_running_loop().call_later(0.02, client.left.set)
        with pytest.raises(ClientDisconnected):
            await until_disconnected(client.request(), work())
        assert cleaned_up.is_set()
        caller = asyncio.current_task()
        assert caller is not None and caller.cancelling() == 0  # the cancellation was the watcher's, taken back
        await asyncio.sleep(0.01)  # and the caller can go on awaiting

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_passes_through() -> None:
    async def main() -> None:
        client = Client()

        async def work() -> None:
            await asyncio.sleep(30)

        task = asyncio.create_task(until_disconnected(client.request(), work()))
        await asyncio.sleep(0.01)
        task.cancel()  # the server shutting down, say: not a client that left
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
