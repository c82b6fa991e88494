"""The paged KV block pool, with vLLM v1 prefix-caching semantics.

Data structures
---------------
- ``blocks``: a fixed list of :class:`KVCacheBlock`, allocated once; a
  block's id is its index (and its slot in the worker's KV tensor).
- ``_free``: the free queue, least recently used at the head. It is an
  ``OrderedDict`` keyed by block id because a cache hit must take a free
  block out of the *middle* of the queue in O(1); OrderedDict is a
  C-implemented doubly linked list plus hash map, so pop-head, append-tail
  and remove-middle are all O(1) without a Python-level linked list.
- ``_cached``: block hash -> block, or -> {block id: block} when one hash is
  held by several blocks (two requests computed the same block at once).

Invariants (checked by :meth:`BlockPool.check_invariants`)
-----------------------------------------------------------
1. Every block is either in the free queue (ref_cnt == 0) or referenced
   (ref_cnt > 0), never both, never neither.
2. A block has a hash iff it is in ``_cached`` under that hash; a cached
   block keeps its tokens and parent hash (the collision guard).
3. Cached free blocks stay cached until popped for reuse (lazy eviction):
   that is what makes a freed prefix still hit.

Lifecycle
---------
``get_new_blocks`` pops from the head and evicts the popped block's hash,
if any, handing the block to the eviction hook *before* it is reused (so a
tier can copy its KV out) and emitting ``BlockRemoved``. ``touch`` takes hit
blocks out of the free queue. ``free_blocks`` appends blocks that reach
ref_cnt 0 in the order given -- callers pass a request's blocks tail first,
so its unique suffix is evicted before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Medium
from kvstore.hashing import BlockHash, ExternalBlockHash, published_extra_keys, to_external


class KVCacheBlock:
    """Bookkeeping for one block of KV memory (the KV itself lives with the worker)."""

    __slots__ = (
        "block_hash", "block_id", "external_hash", "extra_keys", "lora_name", "parent_hash", "ref_cnt", "token_ids",
    )  # fmt: skip

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # The fields below are set together when the block is cached, cleared on eviction.
        self.block_hash: BlockHash | None = None
        self.external_hash: ExternalBlockHash | None = None
        self.parent_hash: BlockHash | None = None
        # A tuple, not a list: CPython stops GC-tracking tuples of ints, and the pool holds
        # hundreds of thousands of these, which as lists every collection would walk.
        self.token_ids: tuple[int, ...] = ()
        self.lora_name: str | None = None
        self.extra_keys: tuple[str, ...] | None = None  # its entry in BlockStored.extra_keys (hashing)

    def __repr__(self) -> str:
        state = f"hash={self.external_hash:#x}" if self.external_hash is not None else "uncached"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, {state})"


EvictionHook = Callable[[Sequence[KVCacheBlock]], None]
"""Called with cached blocks about to be reused, hashes and tokens still set.

Contract: the blocks' KV memory is handed to a new owner as soon as the hook
returns, so the hook must have copied out (or refused) everything it wants
by then. It must not call back into the pool.
"""


def _no_eviction_hook(blocks: Sequence[KVCacheBlock]) -> None:
    return None


class BlockPool:
    """A fixed pool of KV blocks with ref counts, an LRU free queue and a prefix cache.

    Not thread-safe: one owner (a worker's step loop) drives it and drains
    its events with :meth:`take_events`.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int,
        enable_caching: bool = True,
        medium: Medium = Medium.GPU,
        on_evict: EvictionHook | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.medium = medium
        self.on_evict: EvictionHook = on_evict or _no_eviction_hook
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._events: list[KVEvent] = []
        self.num_evictions = 0
        self.num_hash_collisions = 0

    # ----------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 if isinstance(v, KVCacheBlock) else len(v) for v in self._cached.values())

    def iter_free(self) -> Iterator[KVCacheBlock]:
        """The free queue from its head (next to be reused) on, lazily; do not mutate the pool while iterating."""
        return iter(self._free.values())

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be reused) first."""
        return list(self._free)

    def get_cached_block(
        self,
        block_hash: BlockHash,
        *,
        parent_hash: BlockHash | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> KVCacheBlock | None:
        """A block cached under ``block_hash``, or None.

        With ``token_ids`` (and ``parent_hash``), a block whose stored tokens or
        parent differ is a hash collision: it is counted and not returned, so
        wrong KV is never served.
        """
        entry = self._cached.get(block_hash)
        if entry is None:
            return None
        block = entry if isinstance(entry, KVCacheBlock) else next(iter(entry.values()))
        if token_ids is not None and (block.token_ids != tuple(token_ids) or block.parent_hash != parent_hash):
            self.num_hash_collisions += 1
            return None
        return block

    def cached_blocks(self) -> Iterator[KVCacheBlock]:
        """Every cached block (each duplicate too), for snapshots and tier scans."""
        for entry in self._cached.values():
            if isinstance(entry, KVCacheBlock):
                yield entry
            else:
                yield from entry.values()

    def snapshot_events(self) -> list[BlockStored]:
        """The whole cache as BlockStored events, one per cached block (duplicates too)."""
        events = []
        for block in self.cached_blocks():
            assert block.external_hash is not None
            events.append(
                BlockStored(
                    block_hashes=[block.external_hash],
                    parent_block_hash=None if block.parent_hash is None else to_external(block.parent_hash),
                    token_ids=list(block.token_ids),
                    block_size=self.block_size,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=block.lora_name,
                    extra_keys=None if block.extra_keys is None else [block.extra_keys],
                )
            )
        return events

    # --------------------------------------------------------------- mutation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, ref_cnt 1 each.

        Popped blocks that were cached are evicted first (hook, then
        BlockRemoved). Raises ValueError if fewer blocks are free: callers
        check :attr:`num_free_blocks` (the manager turns that into None).
        """
        free = self._free
        if num_blocks > len(free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(free)} free")
        popleft = free.popitem
        new_blocks = []
        evicted = []
        for _ in range(num_blocks):
            block = popleft(last=False)[1]
            block.ref_cnt = 1
            new_blocks.append(block)
            if block.block_hash is not None:
                evicted.append(block)
        if evicted:
            self._evict(evicted)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks, rescuing free ones from the queue."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the tail in this order."""
        free = self._free
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        ``blocks[:num_cached_blocks]`` are already cached (prefix hits or
        earlier steps); ``block_hashes`` and ``token_ids`` cover at least
        ``num_full_blocks`` blocks, which were hashed with ``lora_name`` and
        ``cache_salt``. Emits one BlockStored for the run, with the blocks'
        extra keys as vLLM publishes them.
        """
        if num_full_blocks <= num_cached_blocks or not self.enable_caching:
            return
        size = self.block_size
        parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
        cached = self._cached
        external: list[int] = []
        extra: list[tuple[str, ...] | None] | None = None
        if lora_name is not None or cache_salt:
            extra = [published_extra_keys(i, lora_name, cache_salt) for i in range(num_cached_blocks, num_full_blocks)]
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            assert block.block_hash is None, f"block {block.block_id} is cached already"
            block_hash = block_hashes[index]
            ext = to_external(block_hash)
            block.block_hash = block_hash
            block.external_hash = ext
            block.parent_hash = parent
            block.token_ids = tuple(token_ids[index * size : (index + 1) * size])
            block.lora_name = lora_name
            if extra is not None:  # else None already: a block's keys are cleared with its hash
                block.extra_keys = extra[index - num_cached_blocks]
            entry = cached.get(block_hash)
            if entry is None:
                cached[block_hash] = block
            elif isinstance(entry, KVCacheBlock):
                cached[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
            external.append(ext)
            parent = block_hash
        self._events.append(
            BlockStored(
                block_hashes=external,
                parent_block_hash=None if num_cached_blocks == 0 else to_external(block_hashes[num_cached_blocks - 1]),
                token_ids=list(token_ids[num_cached_blocks * size : num_full_blocks * size]),
                block_size=size,
                lora_id=None,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=extra,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is referenced.

        Returns False (and changes nothing) while requests hold blocks; on
        success emits AllBlocksCleared.
        """
        if len(self._free) != self.num_blocks:
            return False
        for block in self.cached_blocks():
            self._clear_hash(block)
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Hand the events emitted since the last call to the owner (and forget them)."""
        events, self._events = self._events, []
        return events

    # -------------------------------------------------------------- internals

    def _evict(self, blocks: list[KVCacheBlock]) -> None:
        self.on_evict(blocks)
        cached = self._cached
        medium = self.medium
        events = self._events
        for block in blocks:
            block_hash = block.block_hash
            assert block_hash is not None
            entry = cached[block_hash]
            if isinstance(entry, KVCacheBlock):
                del cached[block_hash]
            else:
                del entry[block.block_id]
                if len(entry) == 1:
                    cached[block_hash] = next(iter(entry.values()))
            events.append(BlockRemoved(block_hashes=[block.external_hash], medium=medium))  # type: ignore[list-item]
            # Inlined _clear_hash: eviction is the pool's hottest loop.
            block.block_hash = block.external_hash = block.parent_hash = block.lora_name = block.extra_keys = None
            block.token_ids = ()
        self.num_evictions += len(blocks)

    @staticmethod
    def _clear_hash(block: KVCacheBlock) -> None:
        block.block_hash = None
        block.external_hash = None
        block.parent_hash = None
        block.token_ids = ()
        block.lora_name = None
        block.extra_keys = None

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent; raises AssertionError naming the fault."""
        assert len(self.blocks) == self.num_blocks
        for block_id, block in self._free.items():
            assert block.block_id == block_id, f"free queue key {block_id} holds block {block.block_id}"
            assert block.ref_cnt == 0, f"block {block_id} is free with ref_cnt {block.ref_cnt}"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free={in_free}"
            )
            if block.block_hash is None:
                assert block.external_hash is None and not block.token_ids and block.parent_hash is None
                assert block.lora_name is None and block.extra_keys is None, f"block {block.block_id}: stale keys"
                continue
            assert self.enable_caching, "caching is off but a block has a hash"
            entry = self._cached.get(block.block_hash)
            held = entry is block or (isinstance(entry, dict) and entry.get(block.block_id) is block)
            assert held, f"block {block.block_id} has a hash the cache map does not hold for it"
            assert block.external_hash == to_external(block.block_hash)
            assert len(block.token_ids) == self.block_size, f"cached block {block.block_id} is not full"
        for block_hash, entry in self._cached.items():
            members = [entry] if isinstance(entry, KVCacheBlock) else list(entry.values())
            assert members, f"empty cache entry for {block_hash!r}"
            assert isinstance(entry, KVCacheBlock) or len(entry) >= 2, "singleton dict entry not collapsed"
            for block in members:
                assert block.block_hash == block_hash, f"block {block.block_id} listed under a hash it lacks"
