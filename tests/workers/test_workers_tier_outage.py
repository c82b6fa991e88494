"""A worker whose tier goes away and comes back, in one process (LocalTierClient: a real store, arena and disk).

The Ray version -- a tier actor ``ray.kill``ed under two workers -- is
tests/faults/test_faults_tier_death.py; this one pins the worker-side logic:
the outage is noticed once and counted, spills are skipped (counted) and no
request waits on the tier, reconnection attempts back off and run off the
step loop, and a tier restarted on the same disk directory serves again.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from workers_testlib import Reference, random_tokens

from kvstore.deploy.config import Config, config_from_dict
from kvstore.hashing import BlockHasher, to_external
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.errors import TierUnavailableError
from kvstore.tiers.link import TierLink
from kvstore.worker_api import GenerateRequest
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker


def outage_config(tmp_path: Path) -> Config:
    # 16-token blocks of the toy model are 16 KiB; an 8-slot arena sends evicted blocks on to disk.
    return config_from_dict(
        {
            "cache": {"block_size": 16},
            "pool": {"num_blocks": 24},
            "events": {"enabled": False},
            "worker": {"device": "cpu"},
            "tiers": {"cpu_capacity_bytes": 4 * 32768, "disk_dir": str(tmp_path / "disk")},
        }
    )


class Tier:
    """The node's tier as a worker's reconnect factory sees it: a store that can be stopped and started."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.identity = cache_identity(config)
        self.client: LocalTierClient | None = None
        self.attempts: list[float] = []
        self.hang = threading.Event()  # set: a reconnect attempt blocks until it is cleared (a stuck tier)
        self.start()

    def start(self) -> None:
        self.client = LocalTierClient(
            self.config.tiers, self.identity, arena_name=f"kvstore-test-{uuid.uuid4().hex[:12]}"
        )

    def stop(self) -> None:
        assert self.client is not None
        self.client.close()  # its arena is unlinked, its loop stopped: every call now raises
        self.client = None

    def connect(self) -> TierLink:
        self.attempts.append(time.monotonic())
        while self.hang.is_set():
            time.sleep(0.01)
        if self.client is None:
            raise TierUnavailableError("no tier running")
        return TierLink(self.client, self.identity)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def metric(worker: KVWorker, name: str) -> float:
    for line in worker.metrics_text().decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in the worker's metrics")


def test_tier_outage_is_counted_skipped_and_recovered(tmp_path: Path, reference: Reference) -> None:
    tier = Tier(outage_config(tmp_path))
    assert tier.client is not None
    offload = TierOffload(TierLink(tier.client, tier.identity), reconnect=tier.connect, backoff_s=(0.02, 0.1))
    worker = KVWorker("outage", tier.config, offload=offload)
    rng = random.Random(3)
    docs = [random_tokens(rng, 8 * 16 + 3) for _ in range(10)]  # 9 blocks each: the 24-block pool evicts
    first_hashes = [to_external(h) for h in BlockHasher.from_config(tier.config.cache).hash_blocks(docs[0])]
    try:
        for doc in docs[:6]:
            request = GenerateRequest(doc, 4)
            assert worker.generate(request).output_token_ids == reference(request)
        assert metric(worker, "kvstore_tier_connected") == 1.0
        assert tier.client.lookup(first_hashes).media == ("STORAGE",) * 8  # spilled, then written back

        tier.stop()
        tier.hang.set()  # reconnection attempts hang (a stuck tier): requests must not wait for them
        request = GenerateRequest(docs[6], 4)
        assert worker.generate(request).output_token_ids == reference(request)  # notices the outage
        assert wait_for(lambda: len(tier.attempts) == 1)
        for doc in docs[7:]:  # served while the attempt hangs
            request = GenerateRequest(doc, 4)
            started = time.monotonic()
            assert worker.generate(request).output_token_ids == reference(request)
            assert time.monotonic() - started < 5.0
        assert not offload.connected and len(tier.attempts) == 1  # one attempt at a time, off the step loop
        assert metric(worker, "kvstore_tier_unavailable_total") == 1.0
        assert metric(worker, "kvstore_tier_connected") == 0.0
        skipped = metric(worker, "kvstore_tier_spill_skipped_blocks_total")
        assert skipped > 0 and metric(worker, "kvstore_tier_promote_skipped_total") > 0
        tier.hang.clear()
        assert wait_for(lambda: len(tier.attempts) >= 5)  # attempts go on, backing off to 0.1 s apart
        gaps = [b - a for a, b in zip(tier.attempts[1:], tier.attempts[2:], strict=False)]
        assert max(gaps) < 1.0 and metric(worker, "kvstore_tier_reconnect_failures_total") >= 4

        tier.start()  # same disk directory: the first documents' blocks are still there
        assert wait_for(lambda: offload.connected)
        assert metric(worker, "kvstore_tier_reconnects_total") == 1.0
        request = GenerateRequest(docs[0], 4)
        result = worker.generate(request)
        assert result.output_token_ids == reference(request)
        assert result.cached_tokens_by_medium == {"GPU": 0, "CPU": 0, "STORAGE": 8 * 16}
        assert metric(worker, "kvstore_tier_spill_skipped_blocks_total") == skipped
        assert metric(worker, "kvstore_tier_unavailable_total") == 1.0
        worker.check_invariants()
    finally:
        tier.hang.clear()
        worker.shutdown()
        offload.close()
        if tier.client is not None:
            tier.client.close()
