"""Property test: random scheduler traffic on a small pool keeps every invariant.

The machine plays a scheduler over a :class:`KVCacheManager`: admit (prefix hit
+ allocation), decode (append a token, allocate its slot; preempt when the pool
is full), finish, preempt, re-admit a preempted request, and reset the prefix
cache. After every step it checks the manager's and pool's invariants and a
model: the multiset of cached hashes obtained by replaying the pool's
BlockStored / BlockRemoved / AllBlocksCleared events equals the pool's own
cached hashes, the tokens recorded by the events match the blocks', and every
prefix hit is exactly the longest cached prefix (capped at prompt length - 1).
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.block_pool import BlockPool
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.hashing import BlockHasher, to_external
from kvstore.kv_cache_manager import CacheRequest, KVCacheManager

VOCAB = st.integers(min_value=0, max_value=2)  # tiny vocabulary: prefixes collide often


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, CacheRequest] = {}
        self.preempted: dict[str, CacheRequest] = {}
        self.model: Counter[int] = Counter()  # cached external hashes, rebuilt from events only
        self.model_tokens: dict[int, list[int]] = {}
        self.counter = 0

    @initialize(
        num_blocks=st.integers(min_value=8, max_value=64),
        block_size=st.integers(min_value=2, max_value=4),
        watermark=st.sampled_from([0.0, 0.05, 0.1]),
        algo=st.sampled_from(["sha256_cbor", "xxh3_128"]),
    )
    def setup(self, num_blocks: int, block_size: int, watermark: float, algo: str) -> None:
        self.pool = BlockPool(num_blocks, block_size=block_size)
        self.manager = KVCacheManager(self.pool, BlockHasher(algo, "kvstore", block_size), watermark=watermark)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ helpers

    def _snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (
            pool.free_block_ids(),
            [b.ref_cnt for b in pool.blocks],
            sorted((b.block_id, b.block_hash) for b in pool.cached_blocks()),  # type: ignore[type-var]
            self.manager.num_running,
        )

    def _admit(self, request: CacheRequest) -> bool:
        pool, manager = self.pool, self.manager
        hit = manager.get_computed_blocks(request)
        self._check_hit(request, hit.blocks, hit.num_tokens)
        before = self._snapshot()
        new = manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
        if new is None:
            # Back-pressure changes nothing at all.
            assert self._snapshot() == before
            assert pool.take_events() == []
            return False
        assert manager.block_ids(request.request_id)[: len(hit.blocks)] == [b.block_id for b in hit.blocks]
        assert manager.num_tokens_reserved(request.request_id) == request.num_tokens
        return True

    def _check_hit(self, request: CacheRequest, blocks: tuple, num_tokens: int) -> None:
        size = self.pool.block_size
        assert num_tokens == len(blocks) * size
        assert num_tokens <= max(0, request.num_tokens - 1)
        for i, block in enumerate(blocks):
            assert block.block_hash == request.block_hashes[i]
            assert list(block.token_ids) == request.token_ids[i * size : (i + 1) * size]
        # Maximal: the next block (if it may be a hit at all) is not cached per the event model.
        max_blocks = (request.num_tokens - 1) // size
        if len(blocks) < max_blocks:
            assert self.model[to_external(request.block_hashes[len(blocks)])] == 0

    def _prompt(self, data: st.DataObject) -> list[int]:
        # Often reuse (a prefix of) an existing request's tokens, then diverge.
        pool_of_prompts = [r.token_ids for r in (*self.running.values(), *self.preempted.values())]
        base: list[int] = []
        if pool_of_prompts and data.draw(st.booleans()):
            src = data.draw(st.sampled_from(pool_of_prompts))
            base = src[: data.draw(st.integers(min_value=0, max_value=len(src)))]
        tail = data.draw(st.lists(VOCAB, min_size=0 if base else 1, max_size=10))
        return [*base, *tail]

    # -------------------------------------------------------------------- rules

    @rule(data=st.data(), salt=st.sampled_from([None, None, None, "t1"]), lora=st.sampled_from([None, None, "L"]))
    def admit(self, data: st.DataObject, salt: str | None, lora: str | None) -> None:
        self.counter += 1
        request = CacheRequest(f"r{self.counter}", self._prompt(data), cache_salt=salt, lora_name=lora)
        if self._admit(request):
            self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=VOCAB)
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[rid]
        request.append_tokens([token])
        if self.manager.allocate_slots(request, 1) is None:
            # No room for the new token: preempt by recompute, as the scheduler does.
            self.manager.free(request)
            self.preempted[rid] = self.running.pop(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(self.running.pop(rid))
        assert self.manager.block_ids(rid) == []

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(rid)
        self.preempted[rid] = self.running.pop(rid)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.preempted)))
        if self._admit(self.preempted[rid]):
            self.running[rid] = self.preempted.pop(rid)

    @rule(data=st.data())
    def hold_and_release(self, data: st.DataObject) -> None:
        """An offloader's hold: cached free blocks from the head are referenced, then released to the tail.

        While held they are not free (no allocation can reuse them) and the manager's check counts them.
        """
        pool = self.pool
        head = [b for b in itertools.islice(pool.iter_free(), 8) if b.block_hash is not None]
        held = head[: data.draw(st.integers(min_value=0, max_value=len(head)))]
        pool.touch(held)
        assert not {b.block_id for b in held} & set(pool.free_block_ids())
        self.manager.check_invariants({b.block_id: 1 for b in held})
        pool.free_blocks(held)
        assert pool.free_block_ids()[len(pool.free_block_ids()) - len(held) :] == [b.block_id for b in held]

    @rule()
    def reset(self) -> None:
        all_free = self.pool.num_free_blocks == self.pool.num_blocks
        cached_before = self.pool.num_cached_blocks
        ok = self.pool.reset_prefix_cache()
        assert ok == all_free
        assert self.pool.num_cached_blocks == (0 if ok else cached_before)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        pool = self.pool
        for event in pool.take_events():
            if isinstance(event, BlockStored):
                size = event.block_size
                assert size == pool.block_size and len(event.token_ids) == size * len(event.block_hashes)
                for i, h in enumerate(event.block_hashes):
                    self.model[h] += 1
                    self.model_tokens[h] = event.token_ids[i * size : (i + 1) * size]
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert self.model[h] > 0, "BlockRemoved for a hash that is not cached"
                    self.model[h] -= 1
                    if not self.model[h]:
                        del self.model[h]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.model.clear()
        actual = Counter(b.external_hash for b in pool.cached_blocks())
        assert actual == self.model
        for block in pool.cached_blocks():
            assert list(block.token_ids) == self.model_tokens[block.external_hash]  # type: ignore[index]
        assert pool.usage == 1 - pool.num_free_blocks / pool.num_blocks
        assert self.manager.num_running == len(self.running)
        for rid, request in self.running.items():
            assert self.manager.num_tokens_reserved(rid) == request.num_tokens


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = PoolMachine.TestCase
