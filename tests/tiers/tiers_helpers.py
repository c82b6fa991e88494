"""Helpers of the tier tests: a small identity, chained blocks with random KV, real stores and links.

The default identity's block is exactly 4096 bytes, so on a file system
that takes O_DIRECT the disk tier uses it (tmp_path is on the real disk);
``ODD_IDENTITY`` (1024-byte blocks) exercises the buffered path.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

from kvstore.config import EventsConfig
from kvstore.events import EventBatch, EventDecoder, KVEvent
from kvstore.hashing import BlockHasher
from kvstore.kv_layout import KVLayout
from kvstore.publisher import END_SEQ
from kvstore.tiers.blocks import BlockMeta, SlotGrant
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.config import TierConfig
from kvstore.tiers.disk_format import header_len
from kvstore.tiers.errors import TierUnavailableError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.link import Promoted, TierLink
from kvstore.tiers.store import TierStore

IDENTITY = CacheIdentity(
    model="test-model",
    layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_size=4),
    hash_algo="sha256_cbor",
    hash_seed="kvstore",
)
ODD_IDENTITY = msgspec.structs.replace(IDENTITY, layout=msgspec.structs.replace(IDENTITY.layout, head_dim=16))
LOOPBACK = "tcp://127.0.0.1:*"


def arena_name() -> str:
    return f"kvstore-test-{uuid.uuid4().hex[:12]}"


def make_blocks(
    num_blocks: int, *, identity: CacheIdentity = IDENTITY, first_token: int = 0, seed: int = 0
) -> tuple[list[BlockMeta], torch.Tensor]:
    """``num_blocks`` chained blocks (distinct tokens from ``first_token``) and random KV for them."""
    hasher = BlockHasher(identity.hash_algo, identity.hash_seed, identity.block_size)
    tokens = list(range(first_token, first_token + num_blocks * identity.block_size))
    metas = BlockMeta.chain(hasher.hash_blocks(tokens), tokens, identity.block_size)
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn((num_blocks, *identity.layout.block_shape), generator=generator).to(identity.torch_dtype)
    return metas, data


def tier_config(tmp_path: Path, *, cpu_blocks: int, disk_blocks: int | None = None, **fields: Any) -> TierConfig:
    """A config with room for ``cpu_blocks`` in CPU and ``disk_blocks`` files on disk (None: no disk)."""
    identity = fields.pop("identity", IDENTITY)
    disk: dict[str, Any] = {}
    if disk_blocks is not None:
        file_bytes = header_len(identity.block_size) + identity.block_bytes
        disk = {"disk_dir": str(tmp_path / "disk"), "disk_capacity_bytes": disk_blocks * file_bytes}
    return TierConfig(
        cpu_capacity_bytes=cpu_blocks * identity.block_bytes, io_deadline_s=5.0, copy_threads=2, **disk, **fields
    )


def new_store(
    config: TierConfig, *, identity: CacheIdentity = IDENTITY, events: EventsConfig | None = None
) -> TierStore:
    return TierStore(config, identity, events=events, arena_name=arena_name())


@contextmanager
def linked_tier(
    config: TierConfig, *, identity: CacheIdentity = IDENTITY, events: EventsConfig | None = None
) -> Iterator[tuple[LocalTierClient, TierLink]]:
    """A node's tier in process and a worker's link to it: the path a worker's spills and promotions take.

    ``client.store`` may be inspected between calls (the store's loop is idle then).
    """
    client = LocalTierClient(config, identity, events=events, arena_name=arena_name())
    try:
        link = TierLink(client, identity)
        try:
            yield client, link
        finally:
            link.close()
    finally:
        client.close()


def spill_all(link: TierLink, metas: Sequence[BlockMeta], data: torch.Tensor) -> int:
    """Spill ``metas[i]`` from row ``i`` of ``data`` in one call; how many the tier newly stored.

    The link's commit is then answered (``settle``), so the store may be inspected directly.
    """
    stored = link.spill(metas, data, range(len(metas)))
    link.settle()
    return stored


def promote_all(link: TierLink, metas: Sequence[BlockMeta]) -> tuple[Promoted, torch.Tensor]:
    """Promote the longest held prefix of ``metas`` into rows 0, 1, ... of a new pool; what came, and those rows."""
    identity = link.identity
    pool = torch.zeros((len(metas), *identity.layout.block_shape), dtype=identity.torch_dtype)
    rows = iter(range(len(metas)))
    promoted = link.promote(metas, pool, lambda n: list(islice(rows, n)))
    link.settle()  # its releases answered: the store may be inspected directly
    return promoted, pool[: len(promoted.block_ids)]


def hashes(metas: Sequence[BlockMeta]) -> list[int]:
    return [m.block_hash for m in metas]


def request_events(endpoint: str, request: bytes, timeout_s: float = 5.0) -> list[tuple[int, EventBatch]]:
    """Ask a publisher's ROUTER for a replay (8-byte start) or a snapshot; (seq, batch) up to the end."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    decoder = EventDecoder()
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", request])
        replies = []
        while True:
            assert dealer.poll(int(timeout_s * 1000)), "no reply from the publisher"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return replies
            replies.append((int.from_bytes(frames[2], "big"), decoder.decode(frames[3]).batch))
    finally:
        dealer.close()


def all_events(endpoint: str) -> list[KVEvent]:
    """Every event published so far (from the replay buffer), in order."""
    return [event for _, batch in request_events(endpoint, (0).to_bytes(8, "big")) for event in batch.events]


def child_read_slot(name: str, shm_dir: str, slot: int, write_back: bytes) -> bytes:
    """Run in a spawned process: map the arena by name, return slot ``slot``, then overwrite slot 0."""
    from kvstore.tiers.shared_memory import SharedSlots

    slots = SharedSlots.attach(name, shm_dir=shm_dir)
    try:
        seen = bytes(slots.view(slot))
        slots.tensor[0, : len(write_back)] = torch.frombuffer(bytearray(write_back), dtype=torch.uint8)
        return seen
    finally:
        slots.close()


class AnswersInFlight:
    """A real client whose commits and releases sent without waiting run at once, in the order sent, but whose
    answers -- the store's, or ``refuse``'s error for the next one -- arrive only at :meth:`arrive` (and, with
    ``arrive_on_reserve``, while a later reserve waits for its own, as on the tier's control socket).

    ``calls`` records the reserves and acquires, and each answer read before it arrived (``"waited for
    commit"``: a round trip the caller sat through); reserve number ``gone_at_reserve`` (from 1) finds the tier
    gone. ``ordered`` is what the client declares."""

    def __init__(self, inner: LocalTierClient, *, ordered: bool, arrive_on_reserve: bool = False) -> None:
        self.inner = inner
        self.ordered = ordered
        self.arrive_on_reserve = arrive_on_reserve
        self.calls: list[str] = []
        self.refuse: BaseException | None = None
        self.gone_at_reserve: int | None = None
        self.sent: list[InFlightAnswer] = []  # every answer, in the order sent
        self._unanswered: list[InFlightAnswer] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def reserves(self) -> int:
        return self.calls.count("reserve")

    @property
    def waited(self) -> int:
        return sum(call.startswith("waited for") for call in self.calls)

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        if self.arrive_on_reserve:
            self.arrive()
        self.calls.append("reserve")
        if self.reserves == self.gone_at_reserve:
            raise TierUnavailableError("injected: the tier went away")
        return self.inner.reserve(blocks, arena)

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        self.calls.append("acquire")
        return self.inner.acquire(blocks, arena)

    def commit_later(self, lease_ids: Sequence[int]) -> InFlightAnswer:
        return self._later("commit", self.inner.commit(lease_ids))

    def release_later(self, lease_ids: Sequence[int]) -> InFlightAnswer:
        return self._later("release", self.inner.release(lease_ids))

    def _later(self, op: str, answer: Any) -> InFlightAnswer:
        error, self.refuse = self.refuse, None
        pending = InFlightAnswer(self, op, answer, error)
        self._unanswered.append(pending)
        self.sent.append(pending)
        return pending

    def arrive(self) -> None:
        for pending in self._unanswered:
            pending.arrived = True
        self._unanswered = []


class InFlightAnswer:
    """One answer of :class:`AnswersInFlight` (a Pending)."""

    def __init__(self, tier: AnswersInFlight, op: str, answer: Any, error: BaseException | None) -> None:
        self.tier, self.op, self.answer, self.error = tier, op, answer, error
        self.arrived = False

    def done(self) -> bool:
        return self.arrived

    def result(self) -> Any:
        if not self.arrived:  # reading an answer not yet in means waiting for it
            self.tier.calls.append(f"waited for {self.op}")
            self.arrived = True
        if self.error is not None:
            raise self.error
        return self.answer
