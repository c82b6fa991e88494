"""Who serves whom in the prefix index: producers, their sources, replica slots and coverage masks.

A *replica* exists while its one GPU producer is registered and owns a
*slot*: bit ``slot`` of every replica mask. A *source* is one producer on one
medium and owns one bit of that medium's space: on GPU its replica's slot (a
GPU mask is a replica mask as it stands), on CPU and STORAGE a slot of that
medium's own source space. Tier sources are turned into replicas through
their *coverage* (the replica mask they serve), kept here and recomputed on
every registration change, so a replica joining a node never touches blocks.

Not thread-safe: :class:`~kvstore.router.index.PrefixIndex` holds its lock
around every call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from kvstore.events import Medium
from kvstore.router.rekey import Rekeyer

ProducerKind = Literal["gpu", "tier"]
PRODUCER_KINDS: tuple[ProducerKind, ...] = ("gpu", "tier")
TIER_MEDIA: tuple[Medium, ...] = (Medium.CPU, Medium.STORAGE)
"""The media with their own source space (a GPU bit is a replica slot)."""

_WIRE_MEDIA: dict[str, Medium] = {medium.value: medium for medium in Medium}
_MEMO_LIMIT = 65_536
"""Entries per memo before it is dropped: distinct holder sets seen in lookups, bounded by the fleet's sharing."""


class Source:
    """One producer's blocks on one medium: one bit of that medium's space."""

    __slots__ = ("bit", "coverage", "dups", "held", "medium", "producer")

    def __init__(self, producer: Producer, medium: Medium, bit: int) -> None:
        self.producer = producer
        self.medium = medium
        self.bit = bit  # on GPU the replica slot, else the slot in the medium's source space
        self.dups: dict[int, int] = {}  # hash -> stores beyond the first, not yet removed
        self.held = 0  # blocks carrying this source's bit
        self.coverage = 0  # replicas it serves, as a replica mask (kept for tier-space sources)


class Producer:
    """One event stream: what it serves, its sources, and the counters its stats report."""

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
        self.sources: dict[Medium, Source] = {}
        self.wire_sources: dict[str | None, Source] = {}  # medium as sent ("GPU", "cpu", None) -> source
        self.last_seq: int | None = None
        self.batches = 0
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.unknown_removals = 0
        self.rejected_events = 0


class Registry:
    """Producers, replica slots and source spaces, with the masks lookups read."""

    def __init__(self) -> None:
        self.producers: dict[str, Producer] = {}
        self.replica_slot: dict[str, int] = {}
        self.all_replicas = 0  # mask of every registered replica
        self._replica_node: dict[str, str | None] = {}
        self._slot_names: list[str | None] = []  # None: a free slot
        self._space: dict[Medium, list[Source | None]] = {medium: [] for medium in TIER_MEDIA}
        self.cover_memo: dict[Medium, dict[int, int]] = {medium: {} for medium in TIER_MEDIA}
        """Per tier medium: source mask -> the replicas it covers (filled by :meth:`cover`)."""
        self._names_memo: dict[int, tuple[str, ...]] = {}

    # ------------------------------------------------------------- producers

    def add(
        self,
        name: str,
        kind: ProducerKind,
        replicas: tuple[str, ...],
        node: str | None,
        shared_storage: bool,
        rekeyer: Rekeyer | None,
    ) -> None:
        """Register a producer (:meth:`~kvstore.router.index.PrefixIndex.add_producer` has the rules).

        Raises ValueError, changing nothing, for a name already registered or
        an inconsistent registration.
        """
        if kind not in PRODUCER_KINDS:
            raise ValueError(f"producer kind must be one of {PRODUCER_KINDS}, got {kind!r}")
        if name in self.producers:
            raise ValueError(f"producer {name!r} is already registered; remove_producer() it first")
        if kind == "gpu":
            if len(replicas) != 1:
                raise ValueError(f"a gpu producer serves exactly one replica, got {list(replicas)}")
            if shared_storage:
                raise ValueError("shared_storage applies to tier producers only")
            (replica,) = replicas
            if replica in self.replica_slot:
                raise ValueError(f"replica {replica!r} already has a gpu producer")
            entry = Producer(name, kind, replica, None, node, False, rekeyer)
            self._add_replica(replica, node)
        else:
            if node is None and not replicas:
                raise ValueError("a tier producer needs its node (or an explicit list of replicas)")
            entry = Producer(name, kind, None, frozenset(replicas) or None, node, shared_storage, rekeyer)
        self.producers[name] = entry
        self._coverage_changed()

    def remove(self, entry: Producer) -> None:
        """Free a producer's bits and (for a GPU producer) its replica slot. Its blocks must be cleared first."""
        assert all(not source.held for source in entry.sources.values()), "clear a producer's blocks first"
        del self.producers[entry.name]
        for source in entry.sources.values():
            if source.medium != Medium.GPU:
                self._space[source.medium][source.bit] = None
        if entry.replica is not None:
            slot = self.replica_slot.pop(entry.replica)
            del self._replica_node[entry.replica]
            self._slot_names[slot] = None
            self.all_replicas &= ~(1 << slot)
        self._coverage_changed()

    def source(self, entry: Producer, wire_medium: str | None) -> Source | None:
        """The source an event's medium names, created on first use; None if the producer cannot have it.

        A GPU producer's events without a medium are GPU; a tier producer never holds GPU blocks.
        """
        if wire_medium is None:
            medium = Medium.GPU if entry.kind == "gpu" else None
        else:
            medium = _WIRE_MEDIA.get(wire_medium.upper())
        if medium is None or (medium == Medium.GPU and entry.kind == "tier"):
            return None
        source = entry.sources.get(medium)
        if source is None:
            source = self._new_source(entry, medium)
        entry.wire_sources[wire_medium] = source
        return source

    def _new_source(self, entry: Producer, medium: Medium) -> Source:
        if medium == Medium.GPU:
            assert entry.replica is not None
            source = Source(entry, medium, self.replica_slot[entry.replica])
        else:
            space = self._space[medium]
            bit = _free_slot(space)
            source = Source(entry, medium, bit)
            if bit == len(space):
                space.append(source)
            else:
                space[bit] = source
        entry.sources[medium] = source
        self._coverage_changed()
        return source

    def _add_replica(self, replica: str, node: str | None) -> None:
        slots = self._slot_names
        slot = _free_slot(slots)
        if slot == len(slots):
            slots.append(replica)
        else:
            slots[slot] = replica
        self.replica_slot[replica] = slot
        self._replica_node[replica] = node
        self.all_replicas |= 1 << slot

    # -------------------------------------------------------------- coverage

    def producer_coverage(self, entry: Producer) -> int:
        """The replicas a producer serves on any medium, as a replica mask."""
        if entry.kind == "gpu":
            assert entry.replica is not None
            return 1 << self.replica_slot[entry.replica]
        return self._tier_coverage(entry, Medium.CPU) | self._tier_coverage(entry, Medium.STORAGE)

    def _tier_coverage(self, entry: Producer, medium: Medium) -> int:
        if medium == Medium.STORAGE and entry.shared_storage:
            return self.all_replicas
        if entry.explicit_replicas is not None:
            members: Iterable[str] = (r for r in entry.explicit_replicas if r in self.replica_slot)
        else:
            members = (r for r, node in self._replica_node.items() if node == entry.node)
        mask = 0
        for replica in members:
            mask |= 1 << self.replica_slot[replica]
        return mask

    def _source_coverage(self, source: Source) -> int:
        entry = source.producer
        return self.producer_coverage(entry) if entry.kind == "gpu" else self._tier_coverage(entry, source.medium)

    def _coverage_changed(self) -> None:
        """Registration changed: recompute every tier-space source's coverage, drop the memos."""
        for medium, space in self._space.items():
            for source in space:
                if source is not None:
                    source.coverage = self._source_coverage(source)
            self.cover_memo[medium].clear()
        self._names_memo.clear()

    def cover(self, medium: Medium, sources: int) -> int:
        """The replicas a mask of ``medium``'s sources serves (memoised in :attr:`cover_memo`)."""
        space = self._space[medium]
        mask = 0
        rest = sources
        while rest:
            low = rest & -rest
            source = space[low.bit_length() - 1]
            assert source is not None, "a held bit belongs to a registered source"
            mask |= source.coverage
            rest ^= low
        memo = self.cover_memo[medium]
        if len(memo) >= _MEMO_LIMIT:
            memo.clear()
        memo[sources] = mask
        return mask

    def names_of(self, mask: int) -> tuple[str, ...]:
        """The replicas of a replica mask, in slot order (memoised)."""
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

    def sources(self) -> Iterable[Source]:
        """Every registered source."""
        for entry in self.producers.values():
            yield from entry.sources.values()

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Assert slots, spaces, coverage and memos agree with the producers; for tests."""
        assert self.all_replicas == sum(1 << slot for slot in self.replica_slot.values())
        assert {name: slot for slot, name in enumerate(self._slot_names) if name is not None} == self.replica_slot
        gpu_replicas = {entry.replica for entry in self.producers.values() if entry.kind == "gpu"}
        assert gpu_replicas == set(self.replica_slot) == set(self._replica_node), "a replica is its gpu producer's"
        bits: set[tuple[Medium, int]] = set()
        for entry in self.producers.values():
            for medium, source in entry.sources.items():
                assert source.medium == medium and source.producer is entry
                assert (medium, source.bit) not in bits, f"bit {source.bit} of {medium} has two sources"
                bits.add((medium, source.bit))
                if medium == Medium.GPU:
                    assert entry.replica is not None and source.bit == self.replica_slot[entry.replica]
                else:
                    assert self._space[medium][source.bit] is source
                    assert source.coverage == self._source_coverage(source), f"stale coverage of {entry.name}"
        for medium, space in self._space.items():
            assert sum(s is not None for s in space) == sum(1 for m, _ in bits if m == medium)
            for sources, mask in self.cover_memo[medium].items():
                covered = 0
                for slot, member in enumerate(space):
                    if sources >> slot & 1:
                        assert member is not None
                        covered |= member.coverage
                assert mask == covered, f"stale {medium} coverage memo"


def _free_slot(slots: list[str | None] | list[Source | None]) -> int:
    """The first free (None) position, or the end."""
    return next((i for i, taken in enumerate(slots) if taken is None), len(slots))
