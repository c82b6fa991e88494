"""Scheduler scenarios on a real block pool and manager: exact chunks, block ids, preemption order.

No model: each step's "sampled" tokens are made up, which is all the
scheduler sees of the model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import BlockRemoved
from kvstore.hashing import BlockHasher
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.worker_api import FinishReason, GenerateRequest
from kvstore.workers.scheduler import NoAdmissions, RequestState, Scheduler, SchedulerOutput


def make(num_blocks: int, block_size: int, *, budget: int, max_num_seqs: int = 8) -> Scheduler:
    pool = BlockPool(num_blocks, block_size=block_size)
    manager = KVCacheManager(pool, BlockHasher("sha256_cbor", "kvstore", block_size), watermark=0.0)
    return Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def add(scheduler: Scheduler, name: str, prompt: list[int], max_tokens: int) -> RequestState:
    state = RequestState(GenerateRequest(prompt, max_tokens, request_id=name), name, 0.0)
    scheduler.add(state)
    return state


def plan(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request, first position, tokens) per scheduled request."""
    return [(w.state.request_id, w.slice.start, w.num_new_tokens) for w in output.scheduled]


def step(scheduler: Scheduler, token: int) -> tuple[SchedulerOutput, list[RequestState]]:
    """One step, with the worker's side played as the worker does it: every row that reached its
    sequence's end samples ``token``, which ends the request at max_tokens."""
    output = scheduler.schedule(0.0)
    sampled = {}
    for row, work in enumerate(output.scheduled):
        if work.samples:
            sampled[row] = token
            work.state.output_token_ids.append(token)
            if len(work.state.output_token_ids) >= work.state.max_tokens:
                work.state.finish(FinishReason.LENGTH)
    finished = scheduler.update(output, sampled, 0.0)
    scheduler.check_invariants()
    return output, finished


def test_long_prefill_is_chunked_under_the_token_budget_and_decodes_go_first() -> None:
    s = make(16, 16, budget=32)
    a = add(s, "a", list(range(40)), 2)
    b = add(s, "b", list(range(100, 120)), 1)
    out, finished = step(s, 7)
    assert plan(out) == [("a", 0, 32)] and not finished and a.output_token_ids == []
    assert s.manager.block_ids(a.key) == [0, 1]
    out, finished = step(s, 8)
    assert plan(out) == [("a", 32, 8), ("b", 0, 20)]
    assert finished == [b] and b.output_token_ids == [8] and a.output_token_ids == [8]
    assert s.manager.block_ids(a.key) == [0, 1, 2] and s.manager.block_ids(b.key) == []
    out, finished = step(s, 9)
    assert plan(out) == [("a", 40, 1)] and finished == [a] and a.output_token_ids == [8, 9]
    assert not s.has_work and s.manager.pool.num_free_blocks == 16


def test_max_num_seqs_caps_admission() -> None:
    s = make(16, 4, budget=100, max_num_seqs=2)
    for name in "abc":
        add(s, name, [1, 2, 3], 3)
    out, _ = step(s, 0)
    assert [w.state.request_id for w in out.scheduled] == ["a", "b"] and len(s.waiting) == 1


def test_out_of_blocks_preempts_the_last_running_request_which_is_recomputed_later() -> None:
    s = make(4, 4, budget=100)
    a = add(s, "a", [1, 2, 3, 4, 5, 6, 7], 6)
    b = add(s, "b", [11, 12, 13, 14, 15, 16, 17], 6)
    out, _ = step(s, 50)  # both prefill: a -> [0, 1], b -> [2, 3]
    assert plan(out) == [("a", 0, 7), ("b", 0, 7)]
    assert s.manager.block_ids(a.key) == [0, 1] and s.manager.block_ids(b.key) == [2, 3]
    out, _ = step(s, 51)  # both decode into their second block (now full and cached)
    assert plan(out) == [("a", 7, 1), ("b", 7, 1)]
    s.manager.pool.take_events()

    out, _ = step(s, 52)  # a needs a third block: b, the last running, is preempted
    assert plan(out) == [("a", 8, 1)] and out.preempted == [b]
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0 and list(s.waiting) == [b]
    assert b.output_token_ids == [50, 51] and b.num_tokens == 9  # kept: they are recomputed, not regenerated
    # b's blocks were freed tail first, so its last block was reused (evicted) before its first.
    assert s.manager.block_ids(a.key) == [0, 1, 3]
    assert [type(e) for e in s.manager.pool.take_events()] == [BlockRemoved]
    assert s.manager.pool.free_block_ids() == [2]

    while a in s.running:  # b cannot come back while a holds 3 of the 4 blocks
        out, _ = step(s, 60)
        assert [w.state for w in out.scheduled] == [a] and list(s.waiting) == [b]
    assert a.output_token_ids == [50, 51, 52, 60, 60, 60]

    out, _ = step(s, 70)  # b is readmitted: its first block is still cached, the rest is recomputed
    assert plan(out) == [("b", 4, 5)] and b.cached_tokens_by_medium == {"GPU": 0, "CPU": 0, "STORAGE": 0}
    while s.has_work:
        step(s, 71)
    assert b.output_token_ids == [50, 51, 70, 71, 71, 71] and s.num_preemptions == 1


def test_a_request_preempts_itself_when_it_is_the_last_running() -> None:
    s = make(3, 4, budget=100)
    a = add(s, "a", [1, 2, 3, 4], 3)
    b = add(s, "b", [5, 6, 7, 8], 3)
    step(s, 1)  # a -> [0], b -> [1]
    out, _ = step(s, 2)  # a takes the last free block; b finds none and, being last, preempts itself
    assert plan(out) == [("a", 4, 1)] and out.preempted == [b] and s.running == [a]
    assert s.manager.block_ids(a.key) == [0, 2]
    while s.has_work:
        step(s, 3)
    assert a.output_token_ids == [1, 2, 3] and b.output_token_ids == [1, 3, 3] and b.num_preemptions == 1


class HeldStores(NoAdmissions):
    """The part of the offloader the scheduler sees when stores hold blocks: pool references, then release."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.held: list[KVCacheBlock] = []

    def hold(self, blocks: list[KVCacheBlock]) -> None:
        self.pool.touch(blocks)
        self.held += blocks

    def release(self) -> None:
        self.pool.free_blocks(self.held)
        self.held = []

    @property
    def store_held_blocks(self) -> int:
        return len(self.held)

    def held_refs(self) -> Mapping[int, int]:
        return Counter(b.block_id for b in self.held)


def test_a_running_request_waits_for_blocks_held_by_stores_instead_of_preempting() -> None:
    s = make(6, 4, budget=100)
    stores = HeldStores(s.manager.pool)
    s.offloader = stores
    a = add(s, "a", [1, 2, 3, 4, 5, 6, 7], 6)
    b = add(s, "b", [11, 12, 13, 14, 15, 16, 17], 6)
    c = add(s, "c", [21, 22, 23, 24], 1)
    out, finished = step(s, 50)  # a -> [0, 1], b -> [2, 3], c -> [4] and done: its cached block is free
    assert finished == [c] and s.manager.pool.free_block_ids() == [5, 4]
    stores.hold([s.manager.pool.blocks[4]])  # ... and held while its store runs
    step(s, 51)  # both decode into their second block
    out, _ = step(s, 52)  # a takes block 5; b finds only the held block: it waits, it is not preempted
    assert plan(out) == [("a", 8, 1)] and out.preempted == [] and s.running == [a, b]
    assert s.num_preemptions == 0 and b.num_computed_tokens == 8
    stores.release()  # the store ended: the block is free again (still cached: b's allocation evicts it)
    out, _ = step(s, 53)
    assert plan(out) == [("a", 9, 1), ("b", 8, 1)] and out.preempted == []
    assert s.manager.block_ids(b.key) == [2, 3, 4] and s.num_preemptions == 0
