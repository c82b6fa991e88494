"""Per-request KV cache management on top of a :class:`BlockPool`.

The manager owns, for each admitted request, its block table (the pool
blocks holding its KV, in token order) and how many of those blocks are
registered in the prefix cache. It answers three questions a scheduler asks:

1. How much of this prompt is cached? (:meth:`get_computed_blocks`) --
   the longest run of leading blocks found in the cache, never the whole
   prompt: the last token is always recomputed so the model produces logits.
2. Can this request have room for N more tokens? (:meth:`allocate_slots`)
   -- returns the new blocks, or None when the pool cannot hold them
   (back-pressure, not an error). A new request must also leave a
   watermark of free blocks for the running ones.
3. The request is done or preempted: :meth:`free` releases its blocks tail
   first, so its unique suffix is evicted before any shared prefix.

Prefix-cache queries and hits are counted in tokens, as vLLM does, once per
admission (at a request's first successful :meth:`allocate_slots`): a
request that waits at the head of a full queue is looked up again every step,
and counting each lookup would inflate both numbers under memory pressure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvstore.block_pool import BlockPool, KVCacheBlock
from kvstore.hashing import BlockHash, BlockHasher


class CacheRequest:
    """What the manager needs to know about one request.

    ``token_ids`` grows as the request decodes (:meth:`append_tokens`);
    ``block_hashes`` covers its full blocks and is extended lazily by the
    manager. ``lora_name`` and ``cache_salt`` feed the hash's extra keys.
    """

    __slots__ = ("block_hashes", "cache_salt", "lora_name", "num_prompt_tokens", "request_id", "token_ids")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.block_hashes: list[BlockHash] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_tokens(self, token_ids: Sequence[int]) -> None:
        self.token_ids.extend(token_ids)


class PrefixHit(NamedTuple):
    blocks: tuple[KVCacheBlock, ...]  # cached blocks, in order, not yet referenced
    num_tokens: int  # tokens they cover: len(blocks) * block_size


NO_HIT = PrefixHit((), 0)


class PrefixCacheStats(NamedTuple):
    queries: int  # prompt tokens looked up
    hits: int  # of those, tokens found cached


class _RequestBlocks:
    __slots__ = ("blocks", "num_cached_blocks", "num_tokens")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_tokens = 0  # token slots reserved (computed or scheduled)
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache


class KVCacheManager:
    """Block tables for running requests over one pool. Not thread-safe."""

    def __init__(self, pool: BlockPool, hasher: BlockHasher, *, watermark: float = 0.01) -> None:
        if hasher.block_size != pool.block_size:
            raise ValueError(f"hasher block_size {hasher.block_size} != pool block_size {pool.block_size}")
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size
        self.watermark_blocks = int(watermark * pool.num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self._queries = 0
        self._hits = 0

    # ----------------------------------------------------------------- lookup

    def get_computed_blocks(self, request: CacheRequest) -> PrefixHit:
        """The longest cached prefix of the request, at most ``num_tokens - 1`` tokens.

        The returned blocks are only valid until the next pool mutation: pass
        them straight to :meth:`allocate_slots`, which takes references on
        them (and counts the lookup in the prefix-cache stats).
        """
        if not self.pool.enable_caching or request.request_id in self._requests:
            return NO_HIT
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.pool
        tokens = request.token_ids
        size = self.block_size
        hit: list[KVCacheBlock] = []
        parent: BlockHash | None = None
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = pool.get_cached_block(
                block_hash, parent_hash=parent, token_ids=tokens[index * size : (index + 1) * size]
            )
            if block is None:
                break
            hit.append(block)
            parent = block_hash
        return PrefixHit(tuple(hit), len(hit) * size)

    # ------------------------------------------------------------- allocation

    def allocate_slots(
        self, request: CacheRequest, num_new_tokens: int, hit: PrefixHit = NO_HIT, *, looked_up: bool = True
    ) -> list[KVCacheBlock] | None:
        """Reserve slots for ``num_new_tokens`` more tokens (after ``hit``'s tokens).

        On success: takes references on ``hit.blocks``, allocates the blocks
        still missing, registers newly full blocks in the prefix cache, and
        returns the newly allocated blocks. Returns None, changing nothing,
        when the pool cannot supply them (a new request must also leave the
        watermark free). ``hit`` is only accepted on a request's first call.
        ``looked_up`` False: the request was admitted without a lookup (it scores its prompt, so it may take no
        hit) and is not counted in the prefix-cache stats, as vLLM does not count it.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(request.request_id)
        is_new = state is None
        if state is not None and hit.blocks:
            raise ValueError(f"request {request.request_id!r} already has blocks; a prefix hit is only for admission")
        total_tokens = (0 if state is None else state.num_tokens) + hit.num_tokens + num_new_tokens
        held = 0 if state is None else len(state.blocks)
        num_required = -(-total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - held - len(hit.blocks))
        # Hit blocks sitting in the free queue stop being free once touched.
        num_rescued = sum(1 for b in hit.blocks if b.ref_cnt == 0)
        reserve = self.watermark_blocks if is_new else 0
        if self.pool.num_free_blocks - num_rescued - num_new_blocks < reserve:
            return None
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
            if self.pool.enable_caching and looked_up:  # a request that may take no hit asked the cache nothing
                self._queries += request.num_tokens
                self._hits += hit.num_tokens
        if hit.blocks:
            self.pool.touch(hit.blocks)
            state.blocks.extend(hit.blocks)
            state.num_cached_blocks = len(hit.blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        state.blocks.extend(new_blocks)
        state.num_tokens = total_tokens
        self._cache_full_blocks(request, state)
        return new_blocks

    def free(self, request: CacheRequest | str) -> None:
        """Release a finished or preempted request's blocks, tail first. Idempotent."""
        request_id = request if isinstance(request, str) else request.request_id
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.pool.free_blocks(reversed(state.blocks))

    # ---------------------------------------------------------------- queries

    def block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return [] if state is None else [b.block_id for b in state.blocks]

    def num_tokens_reserved(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return 0 if state is None else state.num_tokens

    @property
    def num_running(self) -> int:
        return len(self._requests)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._queries, self._hits)

    # -------------------------------------------------------------- internals

    def _update_hashes(self, request: CacheRequest) -> None:
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            hashes.extend(
                self.hasher.hash_blocks(
                    request.token_ids,
                    lora_name=request.lora_name,
                    cache_salt=request.cache_salt,
                    parent=hashes[-1] if hashes else None,
                    start_block=len(hashes),
                )
            )

    def _cache_full_blocks(self, request: CacheRequest, state: _RequestBlocks) -> None:
        if not self.pool.enable_caching:
            return
        num_full = min(state.num_tokens, request.num_tokens) // self.block_size
        if num_full <= state.num_cached_blocks:
            return
        self._update_hashes(request)
        self.pool.cache_full_blocks(
            state.blocks,
            request.block_hashes,
            state.num_cached_blocks,
            num_full,
            request.token_ids,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
        )
        state.num_cached_blocks = num_full

    def check_invariants(self, held: Mapping[int, int] | None = None) -> None:
        """Pool invariants plus: ref counts equal the number of block tables holding each block.

        ``held``: references taken outside the manager (an offloader's), by block id.
        """
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for block_id, count in (held or {}).items():
            refs[block_id] += count
        for request_id, state in self._requests.items():
            assert len(state.blocks) * self.block_size >= state.num_tokens, f"{request_id}: too few blocks"
            assert len(state.blocks) == -(-state.num_tokens // self.block_size), f"{request_id}: extra blocks"
            for block in state.blocks:
                refs[block.block_id] += 1
            for block in state.blocks[: state.num_cached_blocks]:
                assert block.block_hash is not None, f"{request_id}: block {block.block_id} should be cached"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs[block.block_id]} requests and holds"
            )
