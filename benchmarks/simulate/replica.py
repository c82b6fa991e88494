"""The two halves of a simulated replica: its block cache and its work queue.

:class:`BlockCache` is a finite LRU cache of blocks -- a real
:class:`~kvstore.block_pool.BlockPool`, driven as a worker's KV cache manager
drives it -- that hands every store and eviction, as the pool's own
``BlockStored``/``BlockRemoved`` events, to a publish callback (the
simulator applies them to a real :class:`~kvstore.router.index.PrefixIndex`).
Requests are not kept running in the cache: a prompt's blocks are looked up,
allocated, cached and freed at once, so the pool is a pure LRU of prompts
with vLLM's eviction order (a request's tail before its shared prefix).
The simulator does this when it routes the request: prefill is FIFO, so any
later request on that replica is scheduled after those blocks are computed.

:class:`PrefillServer` is the replica's clock: prefill in arrival order,
in steps under a token budget, at a fixed throughput.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import KVEvent
from kvstore.hashing import BlockHash

Publish = Callable[[list[KVEvent]], None]


class BlockCache:
    """An LRU cache of ``capacity_blocks`` blocks that publishes what it stores and evicts."""

    def __init__(self, capacity_blocks: int, block_size: int, publish: Publish | None = None) -> None:
        self.pool = BlockPool(capacity_blocks, block_size=block_size)
        self.block_size = block_size
        self._publish = publish

    @property
    def capacity_blocks(self) -> int:
        return self.pool.num_blocks

    def serve(self, digests: Sequence[BlockHash], token_ids: Sequence[int]) -> int:
        """Serve one prompt: count its cached prefix, cache the rest, publish the events.

        ``token_ids`` covers the full blocks of ``digests``. A prompt longer
        than the cache is cached up to the cache's capacity. Returns the
        number of leading blocks that were cached before the call.
        """
        pool = self.pool
        hits: list[KVCacheBlock] = []
        for digest in digests:
            block = pool.get_cached_block(digest)
            if block is None:
                break
            hits.append(block)
        num_blocks = min(len(digests), pool.num_blocks)
        pool.touch(hits)
        blocks = hits + pool.get_new_blocks(max(0, num_blocks - len(hits)))
        pool.cache_full_blocks(blocks, digests, len(hits), num_blocks, token_ids)
        pool.free_blocks(reversed(blocks))
        events = pool.take_events()
        if events and self._publish is not None:
            self._publish(events)
        return len(hits)


class PrefillServer:
    """One replica's prefill, served in arrival order in steps of at most ``step_tokens`` tokens.

    An approximation of continuous batching: a step packs the head of the
    FIFO (the rest of a partly computed prompt, then the next prompts) up
    to the token budget and lasts ``tokens / prefill_tps`` seconds; a
    request that arrives mid-step joins at the next step. A request's first
    token comes at the end of the step that computes its last prompt token.
    Decode is not modelled here: it is memory-bound and batched, so the
    simulator lets it run beside prefill at a per-request rate.

    Steps follow each other while the FIFO holds work, so the outstanding
    prefill falls at exactly ``prefill_tps`` while the replica is busy and
    jumps up by a prompt's tokens at each submit: :meth:`outstanding` and its
    time integral (:meth:`take_area`) follow from the last submit alone.

    Invariants: ``queued_tokens`` is the sum of ``remaining`` over the FIFO;
    ``step_end`` is None exactly when the FIFO is empty.
    """

    __slots__ = (
        "_area",
        "_fifo",
        "_level",
        "_level_t",
        "_step_tokens_now",
        "prefill_tps",
        "queued_tokens",
        "step_end",
        "step_tokens",
    )

    def __init__(self, prefill_tps: float, step_tokens: int) -> None:
        if prefill_tps <= 0 or step_tokens < 1:
            raise ValueError(f"need prefill_tps > 0 and step_tokens >= 1, got {prefill_tps}, {step_tokens}")
        self.prefill_tps = prefill_tps
        self.step_tokens = step_tokens
        self._fifo: deque[list[int]] = deque()  # [request id, prefill tokens not yet computed]
        self.queued_tokens = 0
        self.step_end: float | None = None
        self._step_tokens_now = 0  # tokens the current step computes
        self._level = 0.0  # outstanding tokens at time _level_t
        self._level_t = 0.0
        self._area = 0.0  # integral of outstanding tokens over time since the last take_area

    def submit(self, request_id: int, prefill_tokens: int, now: float) -> float | None:
        """Queue a prompt with ``prefill_tokens`` (>= 1) to compute; returns the new step's end if one starts."""
        assert prefill_tokens >= 1, prefill_tokens
        self._integrate(now)
        self._level += prefill_tokens
        self._fifo.append([request_id, prefill_tokens])
        self.queued_tokens += prefill_tokens
        if self.step_end is None:
            return self._start_step(now)
        return None

    def end_step(self) -> tuple[list[int], float | None]:
        """Finish the current step: (requests whose prefill completed in it, the next step's end or None)."""
        assert self.step_end is not None, "no step is running"
        now = self.step_end
        budget = self._step_tokens_now
        done: list[int] = []
        fifo = self._fifo
        while budget > 0:
            head = fifo[0]
            take = min(budget, head[1])
            head[1] -= take
            budget -= take
            if head[1] == 0:
                done.append(head[0])
                fifo.popleft()
        self.queued_tokens -= self._step_tokens_now
        self.step_end = None
        return done, (self._start_step(now) if fifo else None)

    def outstanding(self, now: float) -> float:
        """Prefill tokens not yet computed at ``now`` (``now`` not before the last submit)."""
        return max(0.0, self._level - self.prefill_tps * (now - self._level_t))

    def take_area(self, now: float) -> float:
        """Token-seconds of outstanding prefill since the previous call (or the start); resets the sum."""
        self._integrate(now)
        area, self._area = self._area, 0.0
        return area

    def _integrate(self, now: float) -> None:
        dt = now - self._level_t
        if dt <= 0:
            return
        level, rate = self._level, self.prefill_tps
        drained = rate * dt
        if drained < level:
            self._area += (level - drained / 2) * dt
            self._level = level - drained
        else:
            self._area += level * level / (2 * rate)
            self._level = 0.0
        self._level_t = now

    def _start_step(self, now: float) -> float:
        self._step_tokens_now = min(self.step_tokens, self.queued_tokens)
        self.step_end = now + self._step_tokens_now / self.prefill_tps
        return self.step_end
