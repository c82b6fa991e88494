"""The router's prefix index: which replica holds which block, on which medium.

Rebuilt from KV events (it is a :class:`~kvstore.subscriber.BatchSink`, so
an :class:`~kvstore.subscriber.EventListener` feeds it directly) and queried
by the router for every request.

Model
-----
- A *replica* is something the router sends requests to. It exists while
  the GPU producer that serves it is registered (a KV worker or an external
  vLLM server; exactly one GPU producer per replica).
- A *producer* is one event stream. A ``"gpu"`` producer serves its one
  replica, whatever medium its events name (a vLLM server offloading to its
  own CPU memory publishes medium ``CPU``: for that replica only). A
  ``"tier"`` producer (a tier actor: media ``CPU`` and ``STORAGE``) serves
  every replica on its node -- or, for ``STORAGE`` with ``shared_storage``,
  every replica of the cluster -- including replicas registered later.
- A *source* is one producer on one medium; it owns one bit (below).
- A *block node* exists per 64-bit external block hash while any source
  holds the block. It has a parent link and children; a node whose parent
  is not indexed is an *orphan* (listed in ``_orphans`` under the parent's
  hash, and adopted when the parent appears), so children are always exact.
  Lookups need only the flat map: a chained hash proves its whole prefix.

Representation (why it is fast in pure Python)
----------------------------------------------
At a million blocks every dict access is a cache miss, and CPython's cyclic
GC re-scans every live container it tracks. So each block is one entry of
one dict, ``_nodes[hash]``, holding an immutable tuple of ints::

    (parent hash | None, gpu, cpu, storage, children)

=========  ===================================================================
``gpu``    bitmask of replicas holding the block on GPU (bit = replica slot;
           a GPU source's bit *is* its replica's slot)
``cpu``,   bitmask of the *sources* holding it on that medium (bit = the
``storage``  source's slot in that medium's space), turned into replicas by
           each source's coverage mask at lookup (memoised per mask)
children   None, one child hash, or a set of them (for branching nodes)
=========  ===================================================================

Tuples of ints stop being GC-tracked after their first collection, so a
million nodes cost the collector nothing; an update replaces the tuple. A
source stores a block at most once in its bit; further stores of the same
hash by the same source (duplicates, as when two requests computed the same
block) are counted in ``source.dups`` and undone first by removals. Every
bit belongs to exactly one source, so a removal clears exactly its own bit,
and coverage changes (a replica joining a node) never touch blocks.

Foreign producers (``rekey=True``) are re-keyed by :mod:`kvstore.router.rekey` from
the token ids in their events.

Invariants (checked by :meth:`PrefixIndex.check_invariants`)
--------------------------------------------------------------
1. A node's masks are never all zero; a set bit belongs to a registered
   source of that medium; ``source.dups`` only lists hashes whose node has
   the source's bit, with counts >= 1; ``source.held`` is the number of
   nodes with its bit.
2. A node's children are exactly the nodes naming it as parent; nodes whose
   parent is not indexed are exactly those in ``_orphans[parent]``.
3. The replica mask, slots and tier-source counts agree with the registry.

Thread safety: one lock; every public method takes it. Results are fresh
objects the caller owns. Clearing a producer (restart, ``AllBlocksCleared``,
removal) scans every node: about 0.3 s per million under the lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

from kvstore.config import CacheConfig
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Medium
from kvstore.hashing import BlockHasher
from kvstore.router.rekey import RekeyedStore, Rekeyer

ProducerKind = Literal["gpu", "tier"]
PRODUCER_KINDS: tuple[ProducerKind, ...] = ("gpu", "tier")

# Positions in a node tuple; a medium's slot is its position.
_PARENT, GPU, CPU, STORAGE, _CHILDREN = 0, 1, 2, 3, 4
_MEDIUM_NAMES = {GPU: Medium.GPU, CPU: Medium.CPU, STORAGE: Medium.STORAGE}
_MEDIUM_SLOT: dict[str, int] = {name.value: slot for slot, name in _MEDIUM_NAMES.items()}
_MEMO_LIMIT = 65_536

Node = tuple[Any, int, int, int, Any]
"""(parent hash or None, gpu mask, cpu mask, storage mask, children: None, a hash or a set)."""


class MediumCounts(NamedTuple):
    """How many leading blocks of a prompt a replica can serve, by each block's best medium."""

    gpu: int
    cpu: int
    storage: int

    @property
    def total(self) -> int:
        """The prefix length, in blocks."""
        return self.gpu + self.cpu + self.storage


NO_MATCH = MediumCounts(0, 0, 0)


class ProducerStats(NamedTuple):
    kind: ProducerKind
    replicas: tuple[str, ...]  # replicas it serves now (on any medium)
    last_seq: int | None  # seq of the last batch applied
    batches: int
    stored_blocks: int  # blocks listed in its BlockStored events
    removed_blocks: int  # blocks listed in its BlockRemoved events
    held_blocks: int  # distinct (medium, hash) it holds now
    unknown_removals: int  # removals of blocks it did not hold (lost events, or stale)
    rejected_events: int  # a medium it cannot have, or a foreign run that cannot be re-keyed
    parked_blocks: int  # foreign blocks waiting for their parent (re-keying)


class IndexStats(NamedTuple):
    nodes: int  # distinct block hashes held anywhere
    entries: int  # distinct (source, hash) pairs
    replicas: int
    producers: int
    unknown_producer_batches: int  # batches of unregistered producers, dropped
    per_producer: dict[str, ProducerStats]


class _Source:
    """One producer's blocks on one medium: one bit of that medium's space."""

    __slots__ = ("bit", "coverage", "dups", "held", "medium", "producer")

    def __init__(self, producer: _Producer, medium: int, bit: int) -> None:
        self.producer = producer
        self.medium = medium  # GPU, CPU or STORAGE (its position in a node tuple)
        self.bit = bit  # on GPU the replica slot, else the slot in the medium's source space
        self.dups: dict[int, int] = {}  # hash -> stores beyond the first, not yet removed
        self.held = 0  # nodes carrying this source's bit
        self.coverage = 0  # replicas it serves, as a replica bitmask


class _Producer:
    __slots__ = (
        "batches",
        "explicit_replicas",
        "kind",
        "last_seq",
        "name",
        "node",
        "rejected_events",
        "rekeyer",
        "removed_blocks",
        "replica",
        "shared_storage",
        "sources",
        "stored_blocks",
        "unknown_removals",
        "wire_sources",
    )

    def __init__(
        self,
        name: str,
        kind: ProducerKind,
        replica: str | None,
        explicit_replicas: frozenset[str] | None,
        node: str | None,
        shared_storage: bool,
        rekeyer: Rekeyer | None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.replica = replica  # the replica a GPU producer serves
        self.explicit_replicas = explicit_replicas  # a tier producer's fixed replica set, if given
        self.node = node
        self.shared_storage = shared_storage
        self.rekeyer = rekeyer  # set for a foreign producer
        self.sources: dict[int, _Source] = {}  # medium slot -> source
        self.wire_sources: dict[str | None, _Source] = {}  # medium as sent ("GPU", "cpu", None) -> source
        self.last_seq: int | None = None
        self.batches = 0
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.unknown_removals = 0
        self.rejected_events = 0


class PrefixIndex:
    """Prefix tree of cached blocks across replicas and media, rebuilt from KV events.

    Register a producer (:meth:`add_producer`) before subscribing to it.
    Batches of unknown producers are dropped and counted, never raised on:
    they arrive on the listener thread, which must not die.
    """

    def __init__(self, cache: CacheConfig | None = None) -> None:
        """``cache`` gives our hash function (algorithm, seed, block size) for re-keying."""
        self._hasher = BlockHasher.from_config(cache or CacheConfig())
        self._lock = threading.Lock()
        self._nodes: dict[int, Node] = {}
        self._orphans: dict[int, set[int]] = {}
        self._producers: dict[str, _Producer] = {}
        self._replica_slot: dict[str, int] = {}
        self._replica_node: dict[str, str | None] = {}
        self._slot_names: list[str | None] = []
        self._all_replicas = 0
        # Source spaces of CPU and STORAGE, by slot (None = free). GPU bits are replica slots.
        self._space: dict[int, list[_Source | None]] = {CPU: [], STORAGE: []}
        self._cover_memo: dict[int, dict[int, int]] = {CPU: {}, STORAGE: {}}
        self._names_memo: dict[int, tuple[str, ...]] = {}
        self._gpu_counts_cache: list[MediumCounts] = []
        self._num_tier_sources = 0
        self._unknown_producer_batches = 0

    # ------------------------------------------------------------ registry

    def add_producer(
        self,
        producer: str,
        kind: ProducerKind,
        replicas: Iterable[str] = (),
        node: str | None = None,
        *,
        shared_storage: bool = False,
        rekey: bool = False,
    ) -> None:
        """Register an event stream and the replicas it serves.

        - ``kind="gpu"``: ``replicas`` is exactly one replica name, registered
          here (a replica has one GPU producer). ``node`` is the node it runs
          on, so that node's tier producers serve it too.
        - ``kind="tier"``: serves every replica on ``node``, now and later,
          or exactly ``replicas`` when given. With ``shared_storage`` its
          STORAGE blocks serve every replica of the cluster.
        - ``rekey``: the producer hashes differently (another algorithm or
          seed); its blocks are re-keyed from their token ids.

        Raises ValueError for a name already registered or an inconsistent
        registration (nothing is changed then).
        """
        names = tuple(replicas)
        if kind not in PRODUCER_KINDS:
            raise ValueError(f"producer kind must be one of {PRODUCER_KINDS}, got {kind!r}")
        with self._lock:
            if producer in self._producers:
                raise ValueError(f"producer {producer!r} is already registered; remove_producer() it first")
            rekeyer = Rekeyer(self._hasher) if rekey else None
            if kind == "gpu":
                if len(names) != 1:
                    raise ValueError(f"a gpu producer serves exactly one replica, got {list(names)}")
                if shared_storage:
                    raise ValueError("shared_storage applies to tier producers only")
                (replica,) = names
                if replica in self._replica_slot:
                    raise ValueError(f"replica {replica!r} already has a gpu producer")
                entry = _Producer(producer, kind, replica, None, node, False, rekeyer)
                self._add_replica(replica, node)
            else:
                if node is None and not names:
                    raise ValueError("a tier producer needs its node (or an explicit list of replicas)")
                entry = _Producer(producer, kind, None, frozenset(names) or None, node, shared_storage, rekeyer)
            self._producers[producer] = entry
            self._coverage_changed()

    def remove_producer(self, producer: str) -> bool:
        """Forget a producer, every block it holds, and (for a GPU producer) its replica.

        Returns False when it was not registered.
        """
        with self._lock:
            entry = self._producers.pop(producer, None)
            if entry is None:
                return False
            self._clear(entry)
            for source in entry.sources.values():
                if source.medium != GPU:
                    self._space[source.medium][source.bit] = None
                    self._num_tier_sources -= 1
            if entry.replica is not None:
                self._remove_replica(entry.replica)
            self._coverage_changed()
            return True

    def producers(self) -> list[str]:
        with self._lock:
            return list(self._producers)

    def replicas(self) -> list[str]:
        """Registered replicas (those with a GPU producer)."""
        with self._lock:
            return list(self._replica_slot)

    # ---------------------------------------------------------- BatchSink

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        """Apply one batch of a producer's events, in order.

        Unknown producers are counted and dropped; unusable events (a medium
        the producer cannot have, a foreign run that cannot be re-keyed) are
        counted per producer and skipped.
        """
        with self._lock:
            entry = self._producers.get(producer)
            if entry is None:
                self._unknown_producer_batches += 1
                return
            entry.last_seq = seq
            entry.batches += 1
            wire_get = entry.wire_sources.get
            # Pools emit one BlockRemoved per evicted block: consecutive removals of one source are
            # gathered and applied as one run (same result, a fraction of the per-event cost).
            removing: _Source | None = None
            removals: list[int] = []
            for event in batch.events:
                kind = type(event)
                if kind is BlockRemoved:
                    medium = event.medium  # type: ignore[union-attr]
                    source = wire_get(medium) or self._source(entry, medium)
                    if source is None:
                        entry.rejected_events += 1
                        continue
                    if source is not removing:
                        if removing is not None:
                            self._apply_removed(entry, removing, removals)
                        removing, removals = source, []
                    removals += event.block_hashes  # type: ignore[union-attr]
                    continue
                if removing is not None:
                    self._apply_removed(entry, removing, removals)
                    removing, removals = None, []
                if kind is BlockStored:
                    medium = event.medium  # type: ignore[union-attr]
                    source = wire_get(medium) or self._source(entry, medium)
                    if source is None:
                        entry.rejected_events += 1
                    else:
                        self._apply_stored(entry, source, event)  # type: ignore[arg-type]
                elif kind is AllBlocksCleared:
                    self._clear(entry)
            if removing is not None:
                self._apply_removed(entry, removing, removals)

    def reset_producer(self, producer: str) -> None:
        """Forget every block of one producer (it restarted, or a snapshot follows)."""
        with self._lock:
            entry = self._producers.get(producer)
            if entry is not None:
                self._clear(entry)

    # -------------------------------------------------------------- lookup

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, MediumCounts]:
        """Per replica, how much of the prefix ``block_hashes`` (our external hashes) it can serve.

        A block counts once, from the best medium the replica has it on
        (GPU > CPU > STORAGE); a replica's prefix ends at the first block it
        holds on no medium. Replicas with an empty prefix are omitted (read
        them as :data:`NO_MATCH`). One pass over the blocks carries the
        bitmask of replicas still matching; building the result costs
        O(replicas) per change of that set, never O(replicas x blocks).
        """
        with self._lock:
            alive = self._all_replicas
            if not alive or not block_hashes:
                return {}
            if self._num_tier_sources == 0:
                return self._lookup_gpu_only(block_hashes, alive)
            return self._lookup_tiered(block_hashes, alive)

    def _lookup_gpu_only(self, block_hashes: Sequence[int], alive: int) -> dict[str, MediumCounts]:
        nodes_get = self._nodes.get
        segments: list[tuple[int, int]] = []  # (prefix length, replicas whose prefix has that length)
        length = 0
        for block_hash in block_hashes:
            node = nodes_get(block_hash)
            held = 0 if node is None else node[GPU] & alive
            if held != alive:
                if length:
                    segments.append((length, alive & ~held))
                alive = held
                if not alive:
                    break
            length += 1
        if alive:
            segments.append((length, alive))
        if len(segments) == 1:
            length, mask = segments[0]
            return dict.fromkeys(self._names_of(mask), self._gpu_counts(length))
        result: dict[str, MediumCounts] = {}
        for length, mask in segments:
            result.update(dict.fromkeys(self._names_of(mask), self._gpu_counts(length)))
        return result

    def _gpu_counts(self, length: int) -> MediumCounts:
        """The (immutable, shared) MediumCounts of a GPU-only prefix of ``length`` blocks."""
        cache = self._gpu_counts_cache
        while len(cache) <= length:
            cache.append(MediumCounts(len(cache), 0, 0))
        return cache[length]

    def _lookup_tiered(self, block_hashes: Sequence[int], alive: int) -> dict[str, MediumCounts]:
        nodes_get = self._nodes.get
        cpu_memo = self._cover_memo[CPU]
        storage_memo = self._cover_memo[STORAGE]
        runs: list[list[int]] = []  # [length, gpu, cpu, storage replica masks], consecutive equal blocks merged
        run: list[int] | None = None
        for block_hash in block_hashes:
            node = nodes_get(block_hash)
            if node is None:
                break
            gpu = node[GPU]
            cpu = node[CPU]
            if cpu:
                cpu = cpu_memo.get(cpu, -1)
                if cpu < 0:
                    cpu = self._cover(CPU, node[CPU])
            storage = node[STORAGE]
            if storage:
                storage = storage_memo.get(storage, -1)
                if storage < 0:
                    storage = self._cover(STORAGE, node[STORAGE])
            held = (gpu | cpu | storage) & alive
            if not held:
                break
            gpu &= held
            cpu &= held & ~gpu
            storage = held & ~gpu & ~cpu
            if run is not None and run[1] == gpu and run[2] == cpu and run[3] == storage:
                run[0] += 1
            else:
                run = [1, gpu, cpu, storage]
                runs.append(run)
            alive = held
        totals: dict[str, list[int]] = {}
        for length, *masks in runs:
            for position, mask in enumerate(masks):
                if mask:
                    for name in self._names_of(mask):
                        acc = totals.get(name)
                        if acc is None:
                            acc = totals[name] = [0, 0, 0]
                        acc[position] += length
        return {name: MediumCounts(*acc) for name, acc in totals.items()}

    # --------------------------------------------------------------- dumps

    def dump(self) -> dict[str, dict[str, Counter[int]]]:
        """Per producer, per medium name, the multiset of block hashes it holds (ours, re-keyed).

        Producers and media holding nothing are omitted. O(nodes): for tests and debugging.
        """
        with self._lock:
            out: dict[str, dict[str, Counter[int]]] = {}
            for name, entry in self._producers.items():
                media: dict[str, Counter[int]] = {}
                for source in entry.sources.values():
                    if not source.held:
                        continue
                    bit = 1 << source.bit
                    position = source.medium
                    held = Counter({h: 1 for h, node in self._nodes.items() if node[position] & bit})
                    held.update(source.dups)
                    media[_MEDIUM_NAMES[position]] = held
                if media:
                    out[name] = media
            return out

    def parent(self, block_hash: int) -> int | None:
        """The parent hash of an indexed block (None for a root). Raises KeyError if not indexed."""
        with self._lock:
            return self._nodes[block_hash][_PARENT]

    def children(self, block_hash: int) -> frozenset[int]:
        """The indexed blocks whose parent is ``block_hash`` (indexed or not)."""
        with self._lock:
            node = self._nodes.get(block_hash)
            kids = self._orphans.get(block_hash) if node is None else node[_CHILDREN]
            if kids is None:
                return frozenset()
            return frozenset(kids) if isinstance(kids, set) else frozenset((kids,))

    def __len__(self) -> int:
        """Number of block nodes (distinct hashes held anywhere)."""
        return len(self._nodes)

    def stats(self) -> IndexStats:
        with self._lock:
            per_producer = {}
            entries = 0
            for name, entry in self._producers.items():
                held = sum(s.held for s in entry.sources.values())
                entries += held
                rekeyer = entry.rekeyer
                per_producer[name] = ProducerStats(
                    entry.kind,
                    self._names_of(self._producer_coverage(entry)),
                    entry.last_seq,
                    entry.batches,
                    entry.stored_blocks,
                    entry.removed_blocks,
                    held,
                    entry.unknown_removals + (0 if rekeyer is None else rekeyer.unknown_removals),
                    entry.rejected_events + (0 if rekeyer is None else rekeyer.rejected),
                    0 if rekeyer is None else rekeyer.parked_blocks,
                )
            return IndexStats(
                len(self._nodes),
                entries,
                len(self._replica_slot),
                len(self._producers),
                self._unknown_producer_batches,
                per_producer,
            )

    # ------------------------------------------------------------ applying

    def _source(self, entry: _Producer, wire_medium: str | None) -> _Source | None:
        """The source an event's medium names, created on first use; None if the producer cannot have it."""
        default = GPU if entry.kind == "gpu" else None
        slot = default if wire_medium is None else _MEDIUM_SLOT.get(wire_medium.upper())
        if slot is None or (slot == GPU and entry.kind == "tier"):
            return None
        source = entry.sources.get(slot)
        if source is None:
            source = self._new_source(entry, slot)
        entry.wire_sources[wire_medium] = source
        return source

    def _new_source(self, entry: _Producer, medium: int) -> _Source:
        if medium == GPU:
            assert entry.replica is not None
            source = _Source(entry, GPU, self._replica_slot[entry.replica])
        else:
            space = self._space[medium]
            bit = next((i for i, s in enumerate(space) if s is None), len(space))
            source = _Source(entry, medium, bit)
            if bit == len(space):
                space.append(source)
            else:
                space[bit] = source
            self._num_tier_sources += 1
        entry.sources[medium] = source
        self._coverage_changed()
        return source

    def _apply_stored(self, entry: _Producer, source: _Source, event: BlockStored) -> None:
        entry.stored_blocks += len(event.block_hashes)
        if entry.rekeyer is None:
            self._store(source, event.block_hashes, event.parent_block_hash)
            return
        for action in entry.rekeyer.stored(event, source.medium):
            target = entry.sources[action.medium]
            if isinstance(action, RekeyedStore):
                self._store(target, action.block_hashes, action.parent)
            else:
                self._remove(entry, target, action.block_hashes)

    def _apply_removed(self, entry: _Producer, source: _Source, block_hashes: list[int]) -> None:
        entry.removed_blocks += len(block_hashes)
        if entry.rekeyer is not None:
            block_hashes = entry.rekeyer.removed(block_hashes)
        self._remove(entry, source, block_hashes)

    def _store(self, source: _Source, block_hashes: Iterable[int], parent: int | None) -> None:
        """The hot path: one run of chained blocks stored by one source."""
        nodes = self._nodes
        nodes_get = nodes.get
        orphans = self._orphans
        medium = source.medium
        bit = 1 << source.bit
        dups = source.dups
        added = 0
        parent_node = None if parent is None else nodes_get(parent)
        for block_hash in block_hashes:
            node = nodes_get(block_hash)
            if node is None:
                if parent == block_hash:
                    parent = None  # a malformed self-parent would make a cycle
                if medium == GPU:
                    node = (parent, bit, 0, 0, None)
                elif medium == CPU:
                    node = (parent, 0, bit, 0, None)
                else:
                    node = (parent, 0, 0, bit, None)
                if parent is not None:
                    if parent_node is None:
                        orphans.setdefault(parent, set()).add(block_hash)
                    else:
                        up, gpu, cpu, storage, kids = parent_node
                        if kids is None:
                            nodes[parent] = (up, gpu, cpu, storage, block_hash)
                        elif type(kids) is int:
                            nodes[parent] = (up, gpu, cpu, storage, {kids, block_hash})
                        else:
                            kids.add(block_hash)
                if orphans:
                    adopted = orphans.pop(block_hash, None)
                    if adopted is not None:
                        up, gpu, cpu, storage, _ = node
                        node = (up, gpu, cpu, storage, next(iter(adopted)) if len(adopted) == 1 else adopted)
                nodes[block_hash] = node  # type: ignore[assignment]
                added += 1
            else:
                up, gpu, cpu, storage, kids = node
                if medium == GPU:
                    if gpu & bit:
                        dups[block_hash] = dups.get(block_hash, 0) + 1
                    else:
                        node = (up, gpu | bit, cpu, storage, kids)
                        nodes[block_hash] = node
                        added += 1
                elif medium == CPU:
                    if cpu & bit:
                        dups[block_hash] = dups.get(block_hash, 0) + 1
                    else:
                        node = (up, gpu, cpu | bit, storage, kids)
                        nodes[block_hash] = node
                        added += 1
                elif storage & bit:
                    dups[block_hash] = dups.get(block_hash, 0) + 1
                else:
                    node = (up, gpu, cpu, storage | bit, kids)
                    nodes[block_hash] = node
                    added += 1
            parent = block_hash
            parent_node = node
        source.held += added

    def _remove(self, entry: _Producer, source: _Source, block_hashes: Iterable[int]) -> None:
        nodes = self._nodes
        nodes_get = nodes.get
        medium = source.medium
        bit = 1 << source.bit
        keep = ~bit
        dups = source.dups
        removed = 0
        unknown = 0
        for block_hash in block_hashes:
            node = nodes_get(block_hash)
            if node is None or not node[medium] & bit:
                unknown += 1
                continue
            if dups:
                extra = dups.get(block_hash)
                if extra is not None:
                    if extra > 1:
                        dups[block_hash] = extra - 1
                    else:
                        del dups[block_hash]
                    continue
            removed += 1
            up, gpu, cpu, storage, kids = node
            if medium == GPU:
                gpu &= keep
            elif medium == CPU:
                cpu &= keep
            else:
                storage &= keep
            if gpu or cpu or storage:
                nodes[block_hash] = (up, gpu, cpu, storage, kids)
            else:
                self._delete_node(block_hash, up, kids)
        source.held -= removed
        entry.unknown_removals += unknown

    def _delete_node(self, block_hash: int, parent: int | None, kids: int | set[int] | None) -> None:
        nodes = self._nodes
        del nodes[block_hash]
        if parent is not None:
            parent_node = nodes.get(parent)
            if parent_node is not None:
                up, gpu, cpu, storage, siblings = parent_node
                if isinstance(siblings, set):
                    siblings.discard(block_hash)
                    if len(siblings) == 1:
                        nodes[parent] = (up, gpu, cpu, storage, next(iter(siblings)))
                else:
                    nodes[parent] = (up, gpu, cpu, storage, None)
            else:
                orphans = self._orphans[parent]
                orphans.discard(block_hash)
                if not orphans:
                    del self._orphans[parent]
        if kids is not None:
            self._orphans[block_hash] = kids if isinstance(kids, set) else {kids}

    def _clear(self, entry: _Producer) -> None:
        """Drop every block of a producer (AllBlocksCleared, reset, removal): one scan of all nodes."""
        if entry.rekeyer is not None:
            entry.rekeyer.clear()
        sources = [s for s in entry.sources.values() if s.held]
        if not sources:
            return
        keep = {GPU: ~0, CPU: ~0, STORAGE: ~0}
        for source in sources:
            keep[source.medium] &= ~(1 << source.bit)
            source.dups.clear()
            source.held = 0
        keep_gpu, keep_cpu, keep_storage = keep[GPU], keep[CPU], keep[STORAGE]
        drop_gpu, drop_cpu, drop_storage = ~keep_gpu, ~keep_cpu, ~keep_storage
        nodes = self._nodes
        touched = [h for h, n in nodes.items() if n[GPU] & drop_gpu or n[CPU] & drop_cpu or n[STORAGE] & drop_storage]
        for block_hash in touched:
            up, gpu, cpu, storage, kids = nodes[block_hash]  # re-read: deleting a child rewrites its parent
            gpu &= keep_gpu
            cpu &= keep_cpu
            storage &= keep_storage
            if gpu or cpu or storage:
                nodes[block_hash] = (up, gpu, cpu, storage, kids)
            else:
                self._delete_node(block_hash, up, kids)

    # ------------------------------------------------------ replicas, coverage

    def _add_replica(self, replica: str, node: str | None) -> None:
        slots = self._slot_names
        slot = next((i for i, name in enumerate(slots) if name is None), len(slots))
        if slot == len(slots):
            slots.append(replica)
        else:
            slots[slot] = replica
        self._replica_slot[replica] = slot
        self._replica_node[replica] = node
        self._all_replicas |= 1 << slot

    def _remove_replica(self, replica: str) -> None:
        slot = self._replica_slot.pop(replica)
        del self._replica_node[replica]
        self._slot_names[slot] = None
        self._all_replicas &= ~(1 << slot)

    def _producer_coverage(self, entry: _Producer) -> int:
        if entry.kind == "gpu":
            assert entry.replica is not None
            return 1 << self._replica_slot[entry.replica]
        return self._tier_coverage(entry, CPU) | self._tier_coverage(entry, STORAGE)

    def _tier_coverage(self, entry: _Producer, medium: int) -> int:
        if medium == STORAGE and entry.shared_storage:
            return self._all_replicas
        if entry.explicit_replicas is not None:
            members: Iterable[str] = (r for r in entry.explicit_replicas if r in self._replica_slot)
        else:
            members = (r for r, node in self._replica_node.items() if node == entry.node)
        mask = 0
        for replica in members:
            mask |= 1 << self._replica_slot[replica]
        return mask

    def _coverage_changed(self) -> None:
        """Registration changed: recompute every tier-space source's coverage, drop the memos."""
        for medium, space in self._space.items():
            for source in space:
                if source is not None:
                    entry = source.producer
                    source.coverage = (
                        self._producer_coverage(entry) if entry.kind == "gpu" else self._tier_coverage(entry, medium)
                    )
            self._cover_memo[medium].clear()
        self._names_memo.clear()

    def _cover(self, medium: int, sources: int) -> int:
        """Replicas served by a mask of sources on CPU or STORAGE (memoised until registration changes)."""
        space = self._space[medium]
        mask = 0
        rest = sources
        while rest:
            low = rest & -rest
            source = space[low.bit_length() - 1]
            assert source is not None, "a held bit belongs to a registered source"
            mask |= source.coverage
            rest ^= low
        memo = self._cover_memo[medium]
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[sources] = mask
        return mask

    def _names_of(self, mask: int) -> tuple[str, ...]:
        names = self._names_memo.get(mask)
        if names is None:
            found = []
            rest = mask
            while rest:
                low = rest & -rest
                name = self._slot_names[low.bit_length() - 1]
                assert name is not None, "a live replica bit has a name"
                found.append(name)
                rest ^= low
            names = tuple(found)
            if len(self._names_memo) >= _MEMO_LIMIT:
                self._names_memo.clear()
            self._names_memo[mask] = names
        return names

    # ---------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (module docstring); O(nodes), for tests."""
        with self._lock:
            live = {GPU: 0, CPU: 0, STORAGE: 0}
            held: dict[int, int] = {}
            for entry in self._producers.values():
                for medium, source in entry.sources.items():
                    assert source.medium == medium and source.producer is entry
                    if medium == GPU:
                        assert entry.replica is not None and source.bit == self._replica_slot[entry.replica]
                    else:
                        assert self._space[medium][source.bit] is source
                    bit = 1 << source.bit
                    assert not live[medium] & bit, f"bit {source.bit} of medium {medium} has two sources"
                    live[medium] |= bit
                    held[id(source)] = 0
                    for block_hash, extra in source.dups.items():
                        node = self._nodes.get(block_hash)
                        assert extra >= 1 and node is not None and node[medium] & bit, f"stale dup {block_hash:#x}"
            sources_by_bit = {
                (entry_source.medium, entry_source.bit): entry_source
                for entry in self._producers.values()
                for entry_source in entry.sources.values()
            }
            derived: dict[int, set[int]] = {}
            for block_hash, (parent, gpu, cpu, storage, _) in self._nodes.items():
                assert gpu or cpu or storage, f"node {block_hash:#x} is held by nobody"
                for medium, mask in ((GPU, gpu), (CPU, cpu), (STORAGE, storage)):
                    assert not mask & ~live[medium], f"node {block_hash:#x}: bit of no source on medium {medium}"
                    rest = mask
                    while rest:
                        low = rest & -rest
                        held[id(sources_by_bit[medium, low.bit_length() - 1])] += 1
                        rest ^= low
                if parent is not None:
                    assert parent != block_hash
                    derived.setdefault(parent, set()).add(block_hash)
            for entry in self._producers.values():
                for source in entry.sources.values():
                    assert source.held == held[id(source)], f"{entry.name}: held {source.held} != {held[id(source)]}"
            for block_hash, node in self._nodes.items():
                kids = node[_CHILDREN]
                have = set() if kids is None else kids if isinstance(kids, set) else {kids}
                assert not isinstance(kids, set) or len(kids) >= 2, "a singleton children set is not collapsed"
                assert have == derived.get(block_hash, set()), f"children of {block_hash:#x} are not exact"
            want_orphans = {p: kids for p, kids in derived.items() if p not in self._nodes}
            assert self._orphans == want_orphans, "orphans are not exactly the children of absent parents"
            assert self._all_replicas == sum(1 << s for s in self._replica_slot.values())
            assert self._num_tier_sources == sum(1 for space in self._space.values() for s in space if s is not None)
