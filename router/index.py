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
- A *source* is one producer on one medium; it owns one bit of that medium.
- A block is indexed per 64-bit external block hash while any source holds
  it. Lookups need no parent links: a chained hash proves its whole prefix.

The jobs live in their own modules: who serves whom
(:mod:`~kvstore.router.index_registry`), applying events and the block maps
(:mod:`~kvstore.router.index_events`), lookups
(:mod:`~kvstore.router.index_lookup`) and counters and dumps
(:mod:`~kvstore.router.index_stats`). Foreign producers (``rekey=True``) are
re-keyed by :mod:`kvstore.router.rekey` from the token ids in their events.

Invariants (checked by :meth:`PrefixIndex.check_invariants`)
--------------------------------------------------------------
1. A block's mask on a medium is never zero while it is mapped; a set bit
   belongs to a registered source of that medium; ``source.dups`` only lists
   hashes carrying the source's bit, with counts >= 1; ``source.held`` is the
   number of blocks carrying its bit.
2. The replica mask, slots, source spaces, coverage masks and their memos
   agree with the registered producers.

Thread safety: one lock; every public method takes it. Results are fresh
objects the caller owns. Clearing a producer (restart, ``AllBlocksCleared``,
removal) scans the maps of the media it holds, under the lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from kvstore.config import CacheConfig
from kvstore.events import EventBatch
from kvstore.hashing import BlockHasher
from kvstore.router.index_events import apply_events, check_blocks, clear, new_block_maps
from kvstore.router.index_lookup import MediumCounts, PrefixLookup
from kvstore.router.index_registry import ProducerKind, Registry
from kvstore.router.index_stats import IndexStats, count_blocks, dump, index_stats
from kvstore.router.rekey import Rekeyer


class PrefixIndex:
    """Cached blocks across replicas and media, rebuilt from KV events.

    Register a producer (:meth:`add_producer`) before subscribing to it.
    Batches of unknown producers are dropped and counted, never raised on:
    they arrive on the listener thread, which must not die.
    """

    def __init__(self, cache: CacheConfig | None = None) -> None:
        """``cache`` gives our hash function (algorithm, seed, block size) for re-keying."""
        self._hasher = BlockHasher.from_config(cache or CacheConfig())
        self._lock = threading.Lock()
        self._registry = Registry()
        self._blocks = new_block_maps()
        self._lookup = PrefixLookup(self._registry, self._blocks)
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
        with self._lock:
            rekeyer = Rekeyer(self._hasher) if rekey else None
            self._registry.add(producer, kind, names, node, shared_storage, rekeyer)

    def remove_producer(self, producer: str) -> bool:
        """Forget a producer, every block it holds, and (for a GPU producer) its replica.

        Returns False when it was not registered.
        """
        with self._lock:
            entry = self._registry.producers.get(producer)
            if entry is None:
                return False
            clear(self._blocks, entry)
            self._registry.remove(entry)
            return True

    def producers(self) -> list[str]:
        with self._lock:
            return list(self._registry.producers)

    def replicas(self) -> list[str]:
        """Registered replicas (those with a GPU producer)."""
        with self._lock:
            return list(self._registry.replica_slot)

    # ---------------------------------------------------------- BatchSink

    def apply_batch(self, producer: str, seq: int, batch: EventBatch) -> None:
        """Apply one batch of a producer's events, in order.

        Unknown producers are counted and dropped; unusable events (a medium
        the producer cannot have, a foreign run that cannot be re-keyed) are
        counted per producer and skipped.
        """
        with self._lock:
            entry = self._registry.producers.get(producer)
            if entry is None:
                self._unknown_producer_batches += 1
                return
            entry.last_seq = seq
            entry.batches += 1
            apply_events(self._blocks, self._registry, entry, batch.events)

    def reset_producer(self, producer: str) -> None:
        """Forget every block of one producer (it restarted, or a snapshot follows)."""
        with self._lock:
            entry = self._registry.producers.get(producer)
            if entry is not None:
                clear(self._blocks, entry)

    # -------------------------------------------------------------- lookup

    def lookup(self, block_hashes: Iterable[int]) -> dict[str, MediumCounts]:
        """Per replica, how much of the prefix ``block_hashes`` (our external hashes) it can serve.

        A block counts once, from the best medium the replica has it on
        (GPU > CPU > STORAGE); a replica's prefix ends at the first block it
        holds on no medium. Replicas with an empty prefix are omitted (read
        them as :data:`~kvstore.router.index_lookup.NO_MATCH`). The hashes are
        read no further than the first block no replica holds (a lazy
        iterator computes no more).
        """
        with self._lock:
            return self._lookup(block_hashes)

    # ---------------------------------------------------------- inspection

    def dump(self) -> dict[str, dict[str, Counter[int]]]:
        """Per producer, per medium, the multiset of block hashes it holds (ours, re-keyed).

        Producers and media holding nothing are omitted. O(blocks): for tests and debugging.
        """
        with self._lock:
            return dump(self._blocks, self._registry)

    def __len__(self) -> int:
        """Distinct block hashes held anywhere (a scan while tier blocks are held)."""
        with self._lock:
            return count_blocks(self._blocks)

    def stats(self) -> IndexStats:
        with self._lock:
            return index_stats(self._blocks, self._registry, self._unknown_producer_batches)

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (module docstring); O(blocks), for tests."""
        with self._lock:
            self._registry.check_invariants()
            check_blocks(self._blocks, self._registry)
