"""Scenario tests for BlockPool + KVCacheManager: exact block ids, free-queue order, ref counts, hits, events.

Every scenario starts from a fresh pool whose free queue is ``[0, 1, ..., n-1]``,
so the block ids a request gets are fully determined by the operations before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.hashing import BlockHash, BlockHasher, to_external
from kvstore.kv_cache_manager import CacheRequest, KVCacheManager, PrefixHit


def make(
    num_blocks: int, block_size: int, *, watermark: float = 0.0, on_evict=None
) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, block_size=block_size, on_evict=on_evict)
    manager = KVCacheManager(pool, BlockHasher("sha256_cbor", "kvstore", block_size), watermark=watermark)
    return pool, manager


def admit(manager: KVCacheManager, request: CacheRequest) -> tuple[PrefixHit, list[int] | None]:
    """Admission as a scheduler does it: look up the prefix, then reserve the rest of the prompt."""
    hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    manager.check_invariants()
    return hit, None if new is None else [b.block_id for b in new]


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def ext(hashes: Sequence[BlockHash]) -> list[int]:
    return [to_external(h) for h in hashes]


def cached_ids(pool: BlockPool) -> list[int]:
    return sorted(b.block_id for b in pool.cached_blocks())


# --------------------------------------------------------------------------- prefix sharing


def test_shared_prefix_between_two_requests() -> None:
    pool, manager = make(10, 4)
    a = CacheRequest("a", list(range(10)))  # 2 full blocks + 2 tokens
    hit, new = admit(manager, a)
    assert hit.num_tokens == 0 and new == [0, 1, 2]
    assert cached_ids(pool) == [0, 1]  # block 2 is partial
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9]

    b = CacheRequest("b", [*range(8), 100, 101, 102])
    hit, new = admit(manager, b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]
    assert hit.num_tokens == 8
    assert new == [3]
    assert manager.block_ids("b") == [0, 1, 3]
    assert refs(pool) == [2, 2, 1, 1, 0, 0, 0, 0, 0, 0]
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9]
    assert manager.prefix_cache_stats == (10 + 11, 8)  # counted in tokens

    manager.free(a)  # reversed: 2 reaches 0, 1 and 0 are still held by b
    manager.check_invariants()
    assert refs(pool) == [1, 1, 0, 1, 0, 0, 0, 0, 0, 0]
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2]
    manager.free(b)
    manager.check_invariants()
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert refs(pool) == [0] * 10
    assert cached_ids(pool) == [0, 1]  # lazily evicted: freed blocks stay cached
    manager.free(b)  # idempotent
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]


@pytest.mark.parametrize(
    ("prompt_len", "hit_blocks"),
    [(8, 1), (9, 2), (5, 1), (4, 0), (12, 2), (13, 3), (16, 3)],
)
def test_full_hit_recomputes_last_token(prompt_len: int, hit_blocks: int) -> None:
    pool, manager = make(16, 4)
    tokens = list(range(1, 17))
    first = CacheRequest("first", tokens)  # caches 4 full blocks: 0, 1, 2, 3
    admit(manager, first)
    manager.free(first)
    assert cached_ids(pool) == [0, 1, 2, 3]

    again = CacheRequest("again", tokens[:prompt_len])
    hit, new = admit(manager, again)
    assert hit.num_tokens == hit_blocks * 4
    assert hit.num_tokens <= prompt_len - 1
    assert [b.block_id for b in hit.blocks] == list(range(hit_blocks))
    assert new is not None
    assert len(hit.blocks) + len(new) == -(-prompt_len // 4)


def test_full_hit_recompute_duplicates_the_last_block() -> None:
    pool, manager = make(8, 4)
    tokens = list(range(8))
    first = CacheRequest("first", tokens)
    admit(manager, first)  # blocks 0, 1 cached
    manager.free(first)
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]

    again = CacheRequest("again", tokens)
    hit, new = admit(manager, again)
    assert [b.block_id for b in hit.blocks] == [0]
    assert new == [2]  # the last block is recomputed into a fresh block...
    h1 = again.block_hashes[1]
    assert pool.blocks[2].block_hash == h1 == pool.blocks[1].block_hash  # ...cached under the same hash
    assert pool.num_cached_blocks == 3
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 1]


# --------------------------------------------------------------------------- eviction order


def test_eviction_is_lru_and_a_requests_tail_goes_first() -> None:
    pool, manager = make(6, 2)
    a = CacheRequest("a", [1, 2, 3, 4, 5, 6])
    assert admit(manager, a)[1] == [0, 1, 2]
    b = CacheRequest("b", [1, 2, 7, 8, 9, 10])
    hit, new = admit(manager, b)
    assert [blk.block_id for blk in hit.blocks] == [0] and new == [3, 4]
    pool.take_events()

    manager.free(a)  # tail first: 2, 1; block 0 is still held by b
    assert pool.free_block_ids() == [5, 2, 1]
    manager.free(b)
    assert pool.free_block_ids() == [5, 2, 1, 4, 3, 0]
    a_ext, b_ext = ext(a.block_hashes), ext(b.block_hashes)

    evicted_order = []
    for step in range(6):
        req = CacheRequest(f"x{step}", [50 + step])  # one partial block: never cached
        hit, new = admit(manager, req)
        assert new == [[5, 2, 1, 4, 3, 0][step]]
        evicted_order += [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    # a's unique tail (newest block first), then b's tail, and the shared prefix last.
    assert evicted_order == [a_ext[2], a_ext[1], b_ext[2], b_ext[1], a_ext[0]]
    assert pool.num_cached_blocks == 0
    assert pool.num_evictions == 5


def test_hit_rescues_a_block_from_the_middle_of_the_free_queue() -> None:
    pool, manager = make(8, 2)
    a = CacheRequest("a", [1, 2, 3, 4, 5])
    assert admit(manager, a)[1] == [0, 1, 2]
    b = CacheRequest("b", [9, 9, 9])
    assert admit(manager, b)[1] == [3, 4]
    manager.free(a)
    manager.free(b)
    assert pool.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]

    c = CacheRequest("c", [1, 2, 3, 4, 6])
    hit, new = admit(manager, c)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]
    assert hit.num_tokens == 4
    assert new == [5]
    assert manager.block_ids("c") == [0, 1, 5]
    assert pool.free_block_ids() == [6, 7, 2, 4, 3]  # 1 and 0 left from the middle, order kept
    assert refs(pool) == [1, 1, 0, 0, 0, 1, 0, 0]
    assert pool.num_evictions == 0


def test_duplicate_hash_held_by_two_blocks_survives_evicting_one() -> None:
    pool, manager = make(8, 2)
    a = CacheRequest("a", [1, 2, 3, 4, 5])
    b = CacheRequest("b", [1, 2, 3, 4, 5])
    # Both looked up before either was computed: neither hits, both compute the same blocks.
    hit_a = manager.get_computed_blocks(a)
    hit_b = manager.get_computed_blocks(b)
    assert hit_a.num_tokens == hit_b.num_tokens == 0
    assert [x.block_id for x in manager.allocate_slots(a, 5, hit_a) or []] == [0, 1, 2]
    assert [x.block_id for x in manager.allocate_slots(b, 5, hit_b) or []] == [3, 4, 5]
    manager.check_invariants()
    h0, h1 = a.block_hashes
    assert b.block_hashes == [h0, h1]
    assert pool.blocks[0].block_hash == pool.blocks[3].block_hash == h0
    assert pool.blocks[1].block_hash == pool.blocks[4].block_hash == h1
    assert pool.num_cached_blocks == 4
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [ext([h0, h1])] * 2

    manager.free(a)
    manager.free(b)
    assert pool.free_block_ids() == [6, 7, 2, 1, 0, 5, 4, 3]
    filler = CacheRequest("filler", [7, 7, 7, 7, 7, 7, 7])  # 4 blocks: pops 6, 7, 2, 1
    hit, new = admit(manager, filler)
    assert hit.num_tokens == 0 and new == [6, 7, 2, 1]
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [ext([h1])]  # block 1 evicted; block 4 still holds h1
    assert pool.blocks[1].block_hash is None  # reused for filler's partial last block
    assert pool.blocks[4].block_hash == h1

    d = CacheRequest("d", [1, 2, 3, 4, 9])
    hit, new = admit(manager, d)
    assert [blk.block_id for blk in hit.blocks] == [0, 4]
    assert hit.num_tokens == 4
    assert new == [5]  # free queue was [0, 5, 4, 3]: 0 and 4 rescued, 5 popped
    assert pool.free_block_ids() == [3]


# --------------------------------------------------------------------------- what is cached


def test_partial_blocks_are_never_cached() -> None:
    pool, manager = make(8, 4)
    req = CacheRequest("r", [1, 2, 3, 4, 5, 6, 7])
    assert admit(manager, req)[1] == [0, 1]
    assert cached_ids(pool) == [0]
    assert pool.blocks[1].block_hash is None and not pool.blocks[1].token_ids
    assert len(req.block_hashes) == 1
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == ext(req.block_hashes) and stored.token_ids == [1, 2, 3, 4]

    # Reserving slots ahead of the tokens (lookahead) caches nothing new either.
    assert [b.block_id for b in manager.allocate_slots(req, 2) or []] == [2]
    manager.check_invariants()
    assert manager.num_tokens_reserved("r") == 9
    assert cached_ids(pool) == [0] and pool.take_events() == []

    req.append_tokens([8])  # now block 1 is full and its slots are reserved
    assert manager.allocate_slots(req, 0) == []
    manager.check_invariants()
    assert cached_ids(pool) == [0, 1]
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == ext(req.block_hashes[1:2])
    assert stored.parent_block_hash == to_external(req.block_hashes[0])
    assert stored.token_ids == [5, 6, 7, 8]


def test_cache_salt_isolates_tenants() -> None:
    pool, manager = make(16, 2)
    prompt = [1, 2, 3, 4, 5]
    alice = CacheRequest("alice", prompt, cache_salt="alice")
    admit(manager, alice)
    bob = CacheRequest("bob", prompt, cache_salt="bob")
    hit, _ = admit(manager, bob)
    assert hit.num_tokens == 0
    plain = CacheRequest("plain", prompt)
    hit, _ = admit(manager, plain)
    assert hit.num_tokens == 0
    # Every block of the chain differs, although the salt is only in block 0's extra keys.
    assert len({*alice.block_hashes, *bob.block_hashes, *plain.block_hashes}) == 6
    hasher = manager.hasher
    assert alice.block_hashes[1] == hasher.hash_block(alice.block_hashes[0], [3, 4], None)
    assert pool.num_cached_blocks == 6

    alice2 = CacheRequest("alice2", prompt, cache_salt="alice")
    hit, _ = admit(manager, alice2)
    assert hit.num_tokens == 4
    assert [b.block_id for b in hit.blocks] == manager.block_ids("alice")[:2]


def test_different_lora_names_never_share() -> None:
    pool, manager = make(16, 2)
    prompt = [1, 2, 3, 4, 5]
    x = CacheRequest("x", prompt, lora_name="x")
    admit(manager, x)
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored) and stored.lora_name == "x"
    for rid, lora in (("y", "y"), ("base", None)):
        hit, _ = admit(manager, CacheRequest(rid, prompt, lora_name=lora))
        assert hit.num_tokens == 0
    assert pool.num_cached_blocks == 6
    hit, _ = admit(manager, CacheRequest("x2", prompt, lora_name="x"))
    assert [b.block_id for b in hit.blocks] == manager.block_ids("x")[:2]


def test_block_stored_carries_the_extra_keys_as_vllm_publishes_them() -> None:
    pool, manager = make(16, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    req = CacheRequest("t", prompt, lora_name="L", cache_salt="S")
    admit(manager, req)
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    # One entry per block, untagged: the LoRA name on each, the salt on the first only.
    assert stored.lora_name == "L" and stored.extra_keys == [("L", "S"), ("L",), ("L",)]
    # A later run of the same request: no salt (not its first block).
    req.append_tokens([8])
    assert manager.allocate_slots(req, 1) is not None
    (later,) = pool.take_events()
    assert isinstance(later, BlockStored) and later.extra_keys == [("L",)]
    # The snapshot restates each block with its own entry.
    snap = {e.block_hashes[0]: e.extra_keys for e in pool.snapshot_events()}
    assert snap == {to_external(h): [k] for h, k in zip(req.block_hashes, [("L", "S"), ("L",), ("L",), ("L",)],
                                                        strict=True)}  # fmt: skip
    # Salt only, and none at all (the field is left out, as the common case costs nothing on the wire).
    admit(manager, CacheRequest("s", prompt, cache_salt="S2"))
    admit(manager, CacheRequest("p", [9, 9, 9, 9]))
    salted, plain = pool.take_events()
    assert isinstance(salted, BlockStored) and salted.extra_keys == [("S2",), None, None]
    assert isinstance(plain, BlockStored) and plain.extra_keys is None
    # Evicted blocks forget their keys with their hash (the invariants check it).
    for rid in ("t", "s", "p"):
        manager.free(rid)
    admit(manager, CacheRequest("big", list(range(100, 130))))
    manager.check_invariants()


# --------------------------------------------------------------------------- admission and reset


def test_watermark_makes_admission_return_none_and_change_nothing() -> None:
    pool, manager = make(10, 2, watermark=0.2)  # keep 2 blocks free for running requests
    assert manager.watermark_blocks == 2
    a = CacheRequest("a", list(range(10)))
    assert admit(manager, a)[1] == [0, 1, 2, 3, 4]
    manager.free(a)
    pool.take_events()
    before = (pool.free_block_ids(), refs(pool), cached_ids(pool), pool.num_evictions)

    # Hits 4 free blocks and needs 5 new ones: 10 - 4 - 5 leaves 1 free, under the watermark of 2.
    big = CacheRequest("big", [*range(8), 90, 91, 92, 93, 94, 95, 96, 97, 98])
    hit = manager.get_computed_blocks(big)
    assert hit.num_tokens == 8
    assert manager.allocate_slots(big, big.num_tokens - hit.num_tokens, hit) is None
    manager.check_invariants()
    assert (pool.free_block_ids(), refs(pool), cached_ids(pool), pool.num_evictions) == before
    assert pool.take_events() == []
    assert manager.num_running == 0 and manager.block_ids("big") == []

    # Exactly at the watermark is allowed: 4 hit + 4 new leaves 2 free.
    fits = CacheRequest("fits", [*range(8), 90, 91, 92, 93, 94, 95, 96])
    hit, new = admit(manager, fits)
    assert hit.num_tokens == 8 and new == [5, 6, 7, 8]
    assert pool.num_free_blocks == 2
    # A running request may dip into the watermark; a new one may not.
    fits.append_tokens([97, 98])
    assert [b.block_id for b in manager.allocate_slots(fits, 2) or []] == [9]
    assert manager.allocate_slots(CacheRequest("tiny", [5]), 1) is None
    manager.check_invariants()
    assert pool.num_free_blocks == 1


def test_reset_prefix_cache() -> None:
    pool, manager = make(6, 2)
    a = CacheRequest("a", [1, 2, 3, 4, 5])
    admit(manager, a)
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # blocks are referenced
    assert cached_ids(pool) == [0, 1] and pool.take_events() == []

    manager.free(a)
    order = pool.free_block_ids()
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None and not b.token_ids and b.parent_hash is None for b in pool.blocks)
    assert pool.free_block_ids() == order
    manager.check_invariants()
    hit, _ = admit(manager, CacheRequest("again", [1, 2, 3, 4, 5]))
    assert hit.num_tokens == 0


def test_eviction_hook_sees_blocks_before_reuse() -> None:
    seen: list[tuple[int, int | None, tuple[int, ...], bool]] = []
    pool: BlockPool

    def hook(blocks: Sequence[KVCacheBlock]) -> None:
        for b in blocks:
            assert b.block_hash is not None
            still_cached = pool.get_cached_block(b.block_hash) is b
            seen.append((b.block_id, b.external_hash, tuple(b.token_ids), still_cached))

    pool, manager = make(3, 2, on_evict=hook)
    a = CacheRequest("a", [1, 2, 3, 4])
    admit(manager, a)
    manager.free(a)
    assert pool.free_block_ids() == [2, 1, 0]
    h = ext(a.block_hashes)

    x = CacheRequest("x", [9, 9, 9])
    assert admit(manager, x)[1] == [2, 1]
    assert seen == [(1, h[1], (3, 4), True)]  # the hook ran while block 1 still held its KV identity
    assert pool.blocks[1].block_hash != a.block_hashes[1]
    assert [e for e in pool.take_events() if isinstance(e, BlockRemoved)] == [BlockRemoved([h[1]], "GPU")]


def test_hash_collision_is_counted_and_not_served() -> None:
    pool, manager = make(8, 2)
    h0, h1 = manager.hasher.hash_blocks([1, 2, 3, 4, 5])

    # A block whose stored tokens differ, cached under victim's first hash.
    (fake,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([fake], [h0], 0, 1, [7, 7])
    hit = manager.get_computed_blocks(CacheRequest("v1", [1, 2, 3, 4, 5]))
    assert hit == PrefixHit((), 0)
    assert pool.num_hash_collisions == 1

    # Same tokens but a different parent is a collision too.
    (fake2,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([fake2], [h1], 0, 1, [3, 4])  # parent None, but h1's parent is h0
    assert pool.get_cached_block(h1, parent_hash=h0, token_ids=[3, 4]) is None
    assert pool.num_hash_collisions == 2
    pool.check_invariants()
    # The genuine check passes when the stored tokens and parent match.
    assert pool.get_cached_block(h1, parent_hash=None, token_ids=[3, 4]) is fake2


# --------------------------------------------------------------------------- events


def test_pool_events() -> None:
    pool, manager = make(4, 4)
    req = CacheRequest("r", list(range(9)))
    admit(manager, req)
    h = req.block_hashes
    assert pool.take_events() == [
        BlockStored(
            block_hashes=ext(h[:2]),
            parent_block_hash=None,
            token_ids=list(range(8)),
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    assert pool.take_events() == []  # drained
    for tok in (9, 10, 11):  # decode until block 2 fills
        req.append_tokens([tok])
        assert manager.allocate_slots(req, 1) == []
    assert pool.take_events() == [
        BlockStored(
            block_hashes=ext(h[2:3]),
            parent_block_hash=int.from_bytes(h[1][-8:], "big"),  # low 64 bits, big-endian
            token_ids=[8, 9, 10, 11],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
    ]
    req.append_tokens([12])
    assert [b.block_id for b in manager.allocate_slots(req, 1) or []] == [3]
    manager.free(req)
    assert pool.free_block_ids() == [3, 2, 1, 0]
    other = CacheRequest("o", list(range(100, 116)))  # 4 blocks: evicts 2, 1, 0 in that order
    admit(manager, other)
    events = pool.take_events()
    assert events[:3] == [BlockRemoved([to_external(h[i])], "GPU") for i in (2, 1, 0)]
    assert len(events) == 4 and isinstance(events[3], BlockStored)
    assert events[3].block_hashes == ext(other.block_hashes) and events[3].parent_block_hash is None
    assert events[3].token_ids == list(range(100, 116))
    assert pool.take_events() == []


def test_prefix_stats_count_each_request_once_at_admission() -> None:
    _pool, manager = make(8, 2, watermark=0.0)
    a = CacheRequest("a", list(range(6)))  # 3 blocks
    admit(manager, a)
    assert manager.prefix_cache_stats == (6, 0)
    manager.free(a)

    # A request that cannot be admitted (needs 9 blocks of 8) is looked up step after step:
    # none of those lookups count, since it was never served.
    waiting = CacheRequest("waiting", [*range(6), *range(100, 112)])
    for _ in range(3):
        hit = manager.get_computed_blocks(waiting)
        assert hit.num_tokens == 6
        assert manager.allocate_slots(waiting, waiting.num_tokens - hit.num_tokens, hit) is None
    assert manager.prefix_cache_stats == (6, 0)

    # Admitted once: counted once, with its hit; later allocations for it count nothing.
    b = CacheRequest("b", [*range(6), 50, 51, 52])
    hit, new = admit(manager, b)
    assert hit.num_tokens == 6 and new is not None
    assert manager.prefix_cache_stats == (6 + 9, 6)
    b.append_tokens([53])
    assert manager.allocate_slots(b, 1) is not None
    assert manager.prefix_cache_stats == (15, 6)
