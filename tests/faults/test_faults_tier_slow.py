"""A slow tier (every call takes 5 s) and a killed tier under a worker that serves through the router.

One KV worker behind its HTTP front (``kvstore worker``'s app), a RouterService
whose health loop polls the worker's ``/metrics`` every 0.2 s and marks it
unhealthy after ONE failed poll, and the node's tier: a real TierStore
(LocalTierClient) behind :class:`SlowTier`, which makes every tier call sleep
5 s while ``slow`` is set -- a tier whose disk or actor has stalled.

While a tier call is stuck, requests must still get exactly the uncached
model's tokens, ``/metrics`` must answer without waiting for the call (no
scrape taken during a stuck call lasts until that call ends; the latencies
are printed), and the router must never see the replica unhealthy. Then the
tier is killed (its store closed: every call fails) and the same must hold.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
from faults_helpers import BLOCK, HttpFleet, fault_config, tokens, wait_for

from kvstore.hashing import BlockHasher, to_external
from kvstore.tiers.blocks import BlockMeta, SlotGrant, TierHit
from kvstore.tiers.client import LocalTierClient, Pending
from kvstore.tiers.link import TierLink
from kvstore.tiers.shared_memory import ArenaInfo
from kvstore.tiers.stats import TierStats
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from tests.ground_truth import reference_outputs

T = TypeVar("T")
DELAY_S = 5.0
WAITED_S = DELAY_S / 10  # a scrape this slow during a stuck call waited for it
MAX_TOKENS = 3
PROMPT_BLOCKS = 9


class SlowTier:
    """A TierClient: the real store's client, each call first sleeping ``DELAY_S`` while ``slow`` is set."""

    def __init__(self, inner: LocalTierClient) -> None:
        self.inner = inner
        self.slow = threading.Event()
        self.cut = threading.Event()  # set at the end: sleeps still running end now (the test stays bounded)
        self._lock = threading.Lock()
        self.stuck: dict[int, tuple[float, float | None]] = {}  # call number -> (started, ended)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self.slow.is_set():
            with self._lock:
                number = len(self.stuck)
                self.stuck[number] = (time.monotonic(), None)
            try:
                self.cut.wait(DELAY_S)
            finally:
                with self._lock:
                    self.stuck[number] = (self.stuck[number][0], time.monotonic())
        return fn(*args)

    def stuck_now(self) -> set[int]:
        with self._lock:
            return {n for n, (_, ended) in self.stuck.items() if ended is None}

    def arena_info(self) -> ArenaInfo:
        return self.inner.arena_info()

    def stats(self) -> TierStats:
        return self.inner.stats()

    def lookup(self, block_hashes: Sequence[int], start: int = 0) -> TierHit:
        return self._call(self.inner.lookup, block_hashes, start)

    def reserve(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant | None]:
        return self._call(self.inner.reserve, blocks, arena)

    def commit(self, lease_ids: Sequence[int]) -> int:
        return self._call(self.inner.commit, lease_ids)

    def commit_later(self, lease_ids: Sequence[int]) -> Pending:
        return self._call(self.inner.commit_later, lease_ids)

    def acquire(self, blocks: Sequence[BlockMeta], arena: int | None = None) -> list[SlotGrant]:
        return self._call(self.inner.acquire, blocks, arena)

    def release(self, lease_ids: Sequence[int]) -> None:
        self._call(self.inner.release, lease_ids)

    def release_later(self, lease_ids: Sequence[int]) -> Pending:
        return self._call(self.inner.release_later, lease_ids)


class Probe:
    """Scrapes the worker's /metrics and samples the router's health every 50 ms, from its own thread."""

    def __init__(self, fleet: HttpFleet, name: str, tier: SlowTier) -> None:
        self._fleet = fleet
        self._url = fleet.servers[name].url
        self._tier = tier
        self.scrapes: list[tuple[float, set[int], float]] = []  # (latency s, calls stuck at start, ended at)
        self.unhealthy_seen = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=30) as client:
            while not self._stop.wait(0.05):
                stuck = self._tier.stuck_now()
                started = time.monotonic()
                ok = client.get("/metrics").status_code == 200
                ended = time.monotonic()
                self.failed += not ok
                self.scrapes.append((ended - started, stuck, ended))
                if self._fleet.service.healthy_count() != 1:
                    self.unhealthy_seen += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def complete(fleet: HttpFleet, prompt: list[int]) -> list[int]:
    response = fleet.complete(prompt, MAX_TOKENS)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]


def test_a_slow_then_killed_tier_never_stalls_serving_metrics_or_health(tmp_path: Path) -> None:
    config = fault_config(
        pool={"num_blocks": 24},
        tiers={"cpu_capacity_bytes": 64 * 32768, "disk_dir": str(tmp_path / "disk")},
    )
    identity = cache_identity(config)
    rng = random.Random(23)
    prompts = [tokens(rng, PROMPT_BLOCKS * BLOCK + 3) for _ in range(11)]
    expected = reference_outputs(prompts, MAX_TOKENS)
    hashes = [to_external(h) for h in BlockHasher.from_config(config.cache).hash_blocks(prompts[0])]

    # A call in flight when the store is closed waits out the client's deadline: keep it short.
    inner = LocalTierClient(config.tiers, identity, arena_name=f"kvstore-test-{uuid.uuid4().hex[:12]}", timeout_s=2.0)
    tier = SlowTier(inner)
    offload = TierOffload(TierLink(tier, identity))  # type: ignore[arg-type]
    fleet = HttpFleet(["w0"], config)
    fleet.workers["w0"].attach_offload(offload)
    probe: Probe | None = None
    try:
        # 1. A healthy tier: the first prompts' blocks are stored in it as the small pool evicts them.
        for i in range(4):
            assert complete(fleet, prompts[i]) == expected[i]
        assert wait_for(lambda: inner.lookup(hashes).num_blocks == PROMPT_BLOCKS)

        # 2. The tier stalls: every call takes 5 s. Serve a prompt it holds (its lookup is stuck) and new ones.
        tier.slow.set()
        probe = Probe(fleet, "w0", tier)
        slow_started = time.monotonic()
        wrong = [i for i in (0, 4, 5, 6) if complete(fleet, prompts[i]) != expected[i]]
        assert not wrong, f"prompts {wrong} got other tokens than the uncached model"
        assert wait_for(lambda: len(tier.stuck) > 0, timeout=10)  # the worker did call the stalled tier
        first_stuck = min(tier.stuck)
        assert wait_for(lambda: sum(1 for _, s, _ in probe.scrapes if first_stuck in s) >= 5, timeout=10)
        slow_s = time.monotonic() - slow_started

        # 3. The tier dies (its store closed): every call now fails at once.
        tier.cut.set()
        tier.slow.clear()
        inner.close()
        wrong = [i for i in range(7, 11) if complete(fleet, prompts[i]) != expected[i]]
        assert not wrong, f"prompts {wrong} got other tokens than the uncached model"
        assert wait_for(lambda: not offload.connected, timeout=20)
        for i in (0, 7):  # and again, with the tier known to be down
            assert complete(fleet, prompts[i]) == expected[i]
        probe.stop()

        # No scrape taken while a tier call was stuck waited for it. A scrape that waited would have run until
        # the call ended (seconds); one that started a moment before the call ended by chance ends just after it
        # in its usual few milliseconds, and proves nothing. So a scrape waited when it outlived a stuck call and
        # took over WAITED_S doing so: a tenth of the stall, hundreds of times a normal scrape.
        during = [(latency, stuck, ended) for latency, stuck, ended in probe.scrapes if stuck]
        waited = [
            (latency, n)
            for latency, stuck, ended in during
            for n in stuck
            if (tier.stuck[n][1] or float("inf")) <= ended and latency > WAITED_S
        ]
        assert during and not waited, f"{len(waited)} of {len(during)} scrapes waited for a stuck tier call"
        assert probe.failed == 0
        assert probe.unhealthy_seen == 0 and fleet.service.healthy_count() == 1, "the router saw it unhealthy"
        latencies = sorted(latency for latency, _, _ in probe.scrapes)
        page = fleet.workers["w0"].metrics_text().decode()
        assert 'kvstore_tier_connected{replica="w0"} 0.0' in page
        assert 'kvstore_requests_total{outcome="failed",replica="w0"} 0.0' in page
        print(
            f"\nslow tier: {len(tier.stuck)} tier calls stalled {DELAY_S:.0f} s each; 4 requests served exactly in "
            f"{slow_s:.2f} s; {len(during)} /metrics scrapes during stalled calls, none waited; then killed: 6 "
            f"requests exact; /metrics over {len(latencies)} scrapes: median "
            f"{statistics.median(latencies) * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms; router: healthy "
            f"throughout"
        )
    finally:
        tier.cut.set()
        if probe is not None:
            probe.stop()
        fleet.close()
        offload.close()
        inner.close()
