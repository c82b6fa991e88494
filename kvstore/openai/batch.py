"""A completions request with a batch of prompts, served as one request per prompt.

vLLM's ``/v1/completions`` takes ``prompt`` as a list of prompts (strings or token-id lists) and answers
them in one body or stream: choice ``i`` is choice ``i % n`` of prompt ``i // n``, and the usage is the
sum over prompts. Our fronts run each prompt as its own request (each routed, cached and scheduled on its
own) and join their outputs here:

- :func:`merge_streams` runs the prompts' chunk streams side by side and yields their chunks as they come,
  each choice renumbered, then one last chunk with the prompts' stats combined (:func:`combine_stats`).
  A stream that fails cancels the others and raises its error; closing the merged stream (the client went
  away) cancels them all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

import msgspec

from kvstore.events import MEDIA
from kvstore.worker_api import RequestStats, StreamChunk


def combine_stats(stats: Sequence[RequestStats]) -> RequestStats:
    """One request's stats for a batch: tokens and cached tokens summed, times of the slowest prompt, every
    replica named (comma-separated, in prompt order, once each)."""
    replicas = list(dict.fromkeys(s.replica for s in stats))
    cached = {medium: sum(s.cached_tokens_by_medium.get(medium, 0) for s in stats) for medium in MEDIA}
    return RequestStats(
        ",".join(replicas),
        sum(s.prompt_tokens for s in stats),
        sum(s.completion_tokens for s in stats),
        cached,
        max(s.queue_s for s in stats),
        max(s.ttft_s for s in stats),
        max(s.total_s for s in stats),
        sum(s.preempted for s in stats),
    )


async def merge_streams(
    streams: Sequence[AsyncGenerator[StreamChunk, None]], n: int, request_id: str
) -> AsyncGenerator[StreamChunk, None]:
    """The prompts' streams as one (see the module docstring); prompt ``p``'s choice ``c`` becomes ``p * n + c``."""
    queue: asyncio.Queue[tuple[int, StreamChunk | None, BaseException | None]] = asyncio.Queue()

    async def pump(prompt: int, stream: AsyncGenerator[StreamChunk, None]) -> None:
        try:
            async for chunk in stream:
                await queue.put((prompt, chunk, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put((prompt, None, exc))
            return
        finally:
            await stream.aclose()
        await queue.put((prompt, None, None))

    tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
    stats: list[RequestStats | None] = [None] * len(streams)
    try:
        left = len(streams)
        while left:
            prompt, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                left -= 1
                continue
            if chunk.stats is not None:
                stats[prompt] = chunk.stats
            if chunk.deltas:
                shift = prompt * n
                deltas = chunk.deltas
                if shift:
                    deltas = [msgspec.structs.replace(d, index=d.index + shift) for d in deltas]
                yield StreamChunk(request_id, deltas)
        if any(s is None for s in stats):
            raise ValueError("a prompt's stream ended without its stats")
        yield StreamChunk(request_id, [], combine_stats([s for s in stats if s is not None]))
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)


def joined(
    streams: Sequence[AsyncGenerator[StreamChunk, None]], n: int, request_id: str
) -> AsyncGenerator[StreamChunk, None]:
    """The one output of a request's prompts: a single prompt's stream as it is, a batch's merged."""
    return streams[0] if len(streams) == 1 else merge_streams(streams, n, request_id)


def batch_ids(request_id: str, count: int) -> list[str]:
    """Each prompt's own request id (its worker and logs see it): the batch's id, then ``-<prompt>``."""
    return [request_id] if count == 1 else [f"{request_id}-{index}" for index in range(count)]
