"""The router follows a node tier's event stream through its death and restart (RouterService.poll_tiers).

Two real ZeroMQ publishers stand for two incarnations of one tier actor: the
one that dies, and the one Ray restarts on new ports. The locator is what
the launcher gives the service (where the tier publishes now, or an error
when it does not answer); here the test decides its answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from kvstore.deploy.config import config_from_dict
from kvstore.events import BlockStored
from kvstore.openai.protocol import ModelLimits
from kvstore.openai.tokenizer import ByteTokenizer
from kvstore.publisher import Snapshot, ZmqEventPublisher
from kvstore.router.service import ProducerSpec, RouterService
from tests.router.router_helpers import held, wait_for

BLOCK = 16


class Tier:
    """One incarnation of a tier actor's event stream: CPU blocks published as they arrive, and snapshots."""

    def __init__(self) -> None:
        self.stored: list[BlockStored] = []
        self.publisher = ZmqEventPublisher(
            config_from_dict({}).events, snapshot_source=lambda: Snapshot(self.publisher.last_seq, list(self.stored))
        )

    def store(self, hashes: list[int], parent: int | None = None) -> None:
        event = BlockStored(hashes, parent, list(range(BLOCK * len(hashes))), BLOCK, None, "CPU", None)
        self.stored.append(event)
        self.publisher.publish([event])

    @property
    def where(self) -> tuple[str, str | None]:
        return self.publisher.endpoint, self.publisher.replay_endpoint


def test_a_dead_tier_leaves_the_index_and_a_restarted_one_is_followed_to_its_new_ports() -> None:
    config = config_from_dict({"cache": {"block_size": BLOCK}})
    service = RouterService(config, ByteTokenizer(), ModelLimits(None, None))
    old, new = Tier(), Tier()
    answer: dict[str, Any] = {"where": old.where}

    async def locate() -> tuple[str, str | None]:
        where = answer["where"]
        if isinstance(where, Exception):
            raise where
        return where  # type: ignore[no-any-return]

    def cpu_blocks() -> Counter[int]:
        return held(service.index, "tier-n1", "CPU")

    service.add_tier_producer("node-1", ProducerSpec("tier-n1", *old.where), locate=locate)
    service.listener.start()
    try:
        time.sleep(0.5)  # PUB/SUB: a batch published before the subscription is connected is not delivered
        old.store([11, 12, 13])
        assert wait_for(lambda: cpu_blocks() == Counter([11, 12, 13]))

        asyncio.run(service.poll_tiers())  # where it was: nothing changes
        assert cpu_blocks() == Counter([11, 12, 13])

        answer["where"] = TimeoutError("the tier actor did not answer")
        asyncio.run(service.poll_tiers())  # down: its blocks cannot be served, so they leave the index
        assert wait_for(lambda: cpu_blocks() == Counter())
        old.store([14], parent=13)  # a dying incarnation's last batch must not bring them back
        asyncio.run(service.poll_tiers())
        time.sleep(0.3)
        assert cpu_blocks() == Counter()

        # Restarted on new ports: the scan republishes what survived, the next spill arrives live.
        new.store([21, 22])
        answer["where"] = new.where
        asyncio.run(service.poll_tiers())
        assert service.tier_producers()["tier-n1"].endpoint == new.publisher.endpoint
        time.sleep(0.5)  # the new subscription connects
        new.store([23], parent=22)
        assert wait_for(lambda: cpu_blocks() == Counter([21, 22, 23]))

        # Moved while up: resubscribe to the other stream; nothing of the previous one is kept.
        answer["where"] = old.where
        asyncio.run(service.poll_tiers())
        time.sleep(0.5)
        old.store([15], parent=14)
        assert wait_for(lambda: cpu_blocks() == Counter([11, 12, 13, 14, 15]))
        service.index.check_invariants()
    finally:
        service.listener.close()
        old.publisher.close()
        new.publisher.close()
