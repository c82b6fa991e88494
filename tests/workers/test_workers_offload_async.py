"""The offloader keeps the tier off the step loop: loads wait in LOADING, stores hold blocks until done.

``GatedTier`` is the dict-backed tier of test_workers_offload_seam with gates:
a test can hold its load or store call on the offload thread and watch the
worker go on serving, then open the gate (or let the worker give up) and
check the KV that came back is exact and every hold was dropped.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from test_workers_offload_seam import DictTier
from test_workers_tier_outage import metric, outage_config
from workers_testlib import Reference, make_config, random_tokens

from kvstore.events import Medium
from kvstore.hashing import BlockHasher, to_external
from kvstore.tiers.blocks import BlockMeta
from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.errors import LeaseError, TierUnavailableError
from kvstore.tiers.identity import CacheIdentity
from kvstore.tiers.link import TierLink
from kvstore.worker_api import GenerateRequest
from kvstore.workers.config import cache_identity
from kvstore.workers.tier_offload import TierOffload
from kvstore.workers.worker import KVWorker
from tests.tiers.tiers_helpers import AnswersInFlight


class GatedTier(DictTier):
    """A DictTier whose loads (or stores) wait for ``gate`` once ``closed`` is set, and can be made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.in_load = threading.Event()
        self.in_store = threading.Event()
        self.gate_stores = False
        self.fail_loads = False

    def store(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> int:
        if self.gate_stores:
            self.in_store.set()
            assert self.gate.wait(30)
        return super().store(blocks, kv, block_ids)

    def load(self, blocks: Sequence[BlockMeta], kv: torch.Tensor, block_ids: Sequence[int]) -> tuple[Medium, ...]:
        self.in_load.set()
        assert self.gate.wait(30)
        if self.fail_loads:
            raise RuntimeError("injected load fault")
        return super().load(blocks, kv, block_ids)


def evicted_doc(worker: KVWorker, rng: random.Random, reference: Reference | None = None) -> list[int]:
    """A 6-block document computed, then pushed out of the 24-block pool by others (at least its first block)."""
    doc = random_tokens(rng, 96)
    first = to_external(BlockHasher.from_config(worker.config.cache).hash_blocks(doc)[0])
    for prompt in [doc, *(random_tokens(rng, 96) for _ in range(12))]:
        request = GenerateRequest(prompt, 2)
        result = worker.generate(request)
        assert reference is None or result.output_token_ids == reference(request)
        assert worker.drain_offload()
        if first not in worker.cached_hashes():
            return doc
    raise AssertionError("the document never left the pool")


def test_a_loading_request_waits_while_others_step(reference: Reference) -> None:
    tier = GatedTier()
    worker = KVWorker("loading", make_config(num_blocks=24))
    worker.attach_offload(tier, wait_s=60.0)  # the gate holds the load: never give up on it here
    try:
        rng = random.Random(5)
        doc = evicted_doc(worker, rng, reference)
        assert tier.stored > 0

        tier.gate.clear()
        waiting = GenerateRequest([*doc, 3, 4, 5], 4)
        stream = worker.submit(waiting)
        assert tier.in_load.wait(10)  # its load runs on the offload thread and is held there
        page = worker.metrics_text().decode()
        assert 'kvstore_worker_offload_in_flight{kind="load",replica="loading"} 1.0' in page
        for _ in range(3):  # other requests (too short to ask the tier) are admitted and finish meanwhile
            other = GenerateRequest(random_tokens(rng, 10), 3)
            assert worker.generate(other).output_token_ids == reference(other)
        assert not stream.done()
        tier.gate.set()
        result = stream.result()
        assert result.output_token_ids == reference(waiting)
        by_medium = result.cached_tokens_by_medium
        assert by_medium["CPU"] > 0 and by_medium["GPU"] + by_medium["CPU"] == 96, by_medium  # the whole document
        assert tier.threads == {"kv-offload"}
        worker.check_invariants()
    finally:
        tier.gate.set()
        worker.shutdown()


def test_a_loaded_request_that_cannot_be_admitted_yet_never_locks_out_the_queue(reference: Reference) -> None:
    """A partial load leaves a READY request holding half a small pool; a long decode then runs the pool dry,
    preempts itself and cannot come back while those holds stand. With nothing running, the scheduler drops
    them: both requests finish, with exact outputs (before: both waited forever)."""
    rng = random.Random(1)
    doc = random_tokens(rng, 18 * 16 + 5)
    long_decode = random_tokens(rng, 8 * 16)
    tier = DictTier()
    warm = KVWorker("warm", make_config(num_blocks=64))
    warm.attach_offload(tier)
    try:
        warm.generate(GenerateRequest(doc, 1))
        assert warm.drain_offload() and len(tier.blocks) == 18
    finally:
        warm.shutdown()
    worker = KVWorker("small", make_config(num_blocks=24))
    worker.attach_offload(tier, wait_s=60.0)
    try:
        first, second = GenerateRequest(long_decode, 200), GenerateRequest(doc, 4)
        streams = [worker.submit(first), worker.submit(second)]
        results = [stream.result(timeout=60) for stream in streams]
        assert [r.output_token_ids for r in results] == [reference(first), reference(second)]
        assert worker.drain_offload()
        worker.check_invariants()
    finally:
        worker.shutdown()


@pytest.mark.parametrize("fault", ["slow", "failing"])
def test_a_slow_or_failing_load_recomputes_and_frees_its_blocks(
    reference: Reference, fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = GatedTier()
    # The slow case waits worker.offload_wait_s (the config's, not an argument) before it gives up.
    worker = KVWorker("faulty", make_config(num_blocks=24, offload_wait_s=0.2 if fault == "slow" else 30.0))
    worker.attach_offload(tier)
    try:
        rng = random.Random(6)
        doc = evicted_doc(worker, rng)
        request = GenerateRequest([*doc, 9, 9], 3)
        if fault == "slow":
            tier.gate.clear()  # the load never answers in time: the request gives up and recomputes
        else:
            tier.fail_loads = True
        with caplog.at_level(logging.ERROR, logger="kvstore.workers.offload_jobs"):
            result = worker.generate(request)
            assert result.output_token_ids == reference(request)
            assert result.cached_tokens_by_medium["CPU"] == 0
            tier.gate.set()
            assert worker.drain_offload()
        if fault == "slow":
            assert metric(worker, "kvstore_worker_offload_gave_up_total") == 1.0
        else:
            assert "injected load fault" in caplog.text  # a fault, not an outage: logged with its traceback
        worker.check_invariants()  # the load's blocks were freed (the filled ones stay cached, valid)
        assert worker.load().num_free_blocks == 24
    finally:
        tier.gate.set()
        worker.shutdown()


def test_a_load_slower_than_the_default_wait_is_awaited_under_a_longer_offload_wait_s(reference: Reference) -> None:
    # worker.offload_wait_s = 30: a load that answers after 2.5 s (past the 2 s default) is still a CPU hit.
    tier = GatedTier()
    worker = KVWorker("patient", make_config(num_blocks=24, offload_wait_s=30.0))
    worker.attach_offload(tier)
    try:
        doc = evicted_doc(worker, random.Random(8))
        request = GenerateRequest([*doc, 9, 9], 3)
        tier.gate.clear()
        opener = threading.Timer(2.5, tier.gate.set)
        opener.start()
        result = worker.generate(request)
        assert result.output_token_ids == reference(request)
        assert result.cached_tokens_by_medium["CPU"] > 0
        assert metric(worker, "kvstore_worker_offload_gave_up_total") == 0.0
        worker.check_invariants()
    finally:
        tier.gate.set()
        worker.shutdown()


def test_blocks_are_held_until_their_store_is_done(reference: Reference) -> None:
    tier = GatedTier()
    worker = KVWorker("holding", make_config(num_blocks=24), offload=tier)
    try:
        rng = random.Random(7)
        tier.gate_stores = True
        tier.gate.clear()
        first = GenerateRequest(random_tokens(rng, 64), 2)
        assert worker.generate(first).output_token_ids == reference(first)
        assert tier.in_store.wait(10)
        held = [b for b in worker.block_pool.blocks if b.ref_cnt > 0 and b.block_hash is not None]
        assert held and worker.load().running == 0  # no request holds them: the store does
        rows = {b.block_id: worker.kv_pool.kv[b.block_id].clone() for b in held}
        for _ in range(4):  # every free block is reused meanwhile, but never a held one
            other = GenerateRequest(random_tokens(rng, 120), 2)
            assert worker.generate(other).output_token_ids == reference(other)
        for block_id, row in rows.items():
            assert torch.equal(worker.kv_pool.kv[block_id], row)
        tier.gate.set()
        assert worker.drain_offload()
        assert all(b.ref_cnt == 0 for b in worker.block_pool.blocks)
        by_hash = {b.external_hash: b.block_id for b in held}
        for block_hash, (_, _, kv) in tier.blocks.items():  # the tier got each held block's KV as it was
            if block_hash in by_hash:
                assert torch.equal(kv, rows[by_hash[block_hash]])
        assert set(by_hash) <= set(tier.blocks)
        worker.check_invariants()
    finally:
        tier.gate.set()
        worker.shutdown()


class LeaseFaultClient:
    """A real LocalTierClient whose commits answer LeaseError (a caller's mistake, as a buggy link would make)."""

    def __init__(self, inner: LocalTierClient) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def commit(self, lease_ids: Sequence[int]) -> int:
        self.inner.release(lease_ids)
        raise LeaseError(f"lease ids {list(lease_ids)} are not write grants")

    def commit_later(self, lease_ids: Sequence[int]) -> _Refused:
        self.inner.release(lease_ids)  # as the store answers a commit it refuses: the slots are freed
        return _Refused(LeaseError(f"lease ids {list(lease_ids)} are not write grants"))


class _Refused:
    """The answer of a call sent without waiting, already in: an error."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def done(self) -> bool:
        return True

    def result(self) -> object:
        raise self._error


def test_a_lease_error_is_a_fault_not_an_outage(
    tmp_path: Path, reference: Reference, caplog: pytest.LogCaptureFixture
) -> None:
    config = outage_config(tmp_path)
    identity = cache_identity(config)
    client = LocalTierClient(config.tiers, identity, arena_name=f"kvstore-test-{uuid.uuid4().hex[:12]}")
    offload = TierOffload(TierLink(LeaseFaultClient(client), identity))  # type: ignore[arg-type]
    worker = KVWorker("lease", config, offload=offload)
    try:
        rng = random.Random(8)
        with caplog.at_level(logging.ERROR, logger="kvstore.workers.offload_jobs"):
            for _ in range(3):
                request = GenerateRequest(random_tokens(rng, 9 * 16 + 3), 2)
                assert worker.generate(request).output_token_ids == reference(request)
            assert worker.drain_offload()
        assert "LeaseError" in caplog.text
        assert offload.connected and metric(worker, "kvstore_tier_unavailable_total") == 0.0
        assert metric(worker, "kvstore_tier_spill_failures_total") > 0
        worker.check_invariants()
    finally:
        worker.shutdown()
        offload.close()
        client.close()


def test_a_failing_model_step_with_stores_in_flight_recovers(
    reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = GatedTier()
    worker = KVWorker("recovering", make_config(num_blocks=24), offload=tier)
    try:
        rng = random.Random(9)
        tier.gate_stores = True
        tier.gate.clear()
        prompt = random_tokens(rng, 40)
        worker.generate(GenerateRequest(prompt, 2))
        assert tier.in_store.wait(10)  # the prompt's blocks are held by a store that is still copying
        real_execute = worker._runner.execute

        def fail_once(*args: object) -> object:
            monkeypatch.setattr(worker._runner, "execute", real_execute)
            threading.Timer(0.3, tier.gate.set).start()  # the copy ends while the worker recovers
            raise MemoryError("injected: out of device memory")

        monkeypatch.setattr(worker._runner, "execute", fail_once)
        with pytest.raises(RuntimeError, match=r"model step failed .*injected"):
            worker.generate(GenerateRequest(random_tokens(rng, 30), 2))
        assert worker.cached_hashes() == []  # recovery waited for the store's hold, then dropped the cache
        worker.check_invariants()
        again = GenerateRequest([*prompt, 1, 2], 3)
        assert worker.generate(again).output_token_ids == reference(again)
    finally:
        tier.gate.set()
        worker.shutdown()


@contextmanager
def ordered_tier(tmp_path: Path) -> Iterator[tuple[CacheIdentity, AnswersInFlight, TierOffload]]:
    """A TierOffload over an ordered ``AnswersInFlight`` client of a real in-process store (8 slots, a disk)."""
    config = outage_config(tmp_path)
    identity = cache_identity(config)
    client = LocalTierClient(config.tiers, identity, arena_name=f"kvstore-test-{uuid.uuid4().hex[:12]}")
    tier = AnswersInFlight(client, ordered=True, arrive_on_reserve=True)  # as the control socket delivers
    offload = TierOffload(TierLink(tier, identity))  # type: ignore[arg-type]  # a TierClient by its methods
    try:
        yield identity, tier, offload
    finally:
        offload.close()
        client.close()


def test_on_an_ordered_tier_jobs_do_not_wait_for_answers_and_a_late_error_counts_against_its_op(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ordered_tier(tmp_path) as (identity, tier, offload):
        metas, kv = _blocks(identity, 3)
        tier.refuse = LeaseError("injected: the commit's answer is a refusal")
        assert offload.store(metas[:1], kv, [0]) == 1  # its commit's answer has not come: not waited for
        assert offload.counters.spill_failures == 0
        tier.arrive()
        with caplog.at_level(logging.ERROR, logger="kvstore.workers.tier_offload"):
            assert offload.store(metas[1:2], kv, [1]) == 1  # reads the refusal first: the earlier store's
        assert offload.counters.spill_failures == 1 and "failed a commit" in caplog.text
        assert "LeaseError" in caplog.text
        target = torch.zeros_like(kv)
        assert offload.load(metas[1:2], target, [1]) == (Medium.CPU,)
        assert torch.equal(target[1], kv[1])
        assert tier.waited == 0 and offload.counters.promote_failures == 0
        # An answer that says the tier is gone takes it down at the next job, which is skipped.
        tier.arrive()
        tier.refuse = TierUnavailableError("injected: the tier went away")
        assert offload.store(metas[2:], kv, [2]) == 1
        tier.arrive()
        assert offload.lookup(metas) == 0
        assert not offload.connected and offload.counters.unavailable == 1
        assert offload.counters.spill_failures == 1  # an outage is not a failure


def test_on_an_ordered_tier_an_earlier_jobs_error_arriving_mid_job_does_not_fail_it(tmp_path: Path) -> None:
    with ordered_tier(tmp_path) as (identity, tier, offload):  # an 8-slot arena: ten blocks are a store of two chunks
        assert tier.inner.arena_info().num_slots == 8
        metas, kv = _blocks(identity, 11)
        tier.refuse = LeaseError("injected: refused")
        assert offload.store(metas[:1], kv, [0]) == 1
        # The refusal arrives during the next store's first reserve, before its second chunk.
        assert offload.store(metas[1:], kv, list(range(1, 11))) == 10
        assert tier.reserves == 3
        assert offload.counters.spill_failures == 1  # the first store's, counted when this one ended
        assert offload.counters.promote_failures == 0 and offload.connected
        tier.arrive()
        assert offload.lookup(metas[3:]) == 8
        assert offload.counters.spill_failures == 1


def test_an_error_kept_when_a_later_call_finds_the_tier_gone_is_still_counted(tmp_path: Path) -> None:
    with ordered_tier(tmp_path) as (identity, tier, offload):
        metas, kv = _blocks(identity, 11)
        tier.refuse = LeaseError("injected: refused")
        assert offload.store(metas[:1], kv, [0]) == 1
        tier.gone_at_reserve = 3  # the second chunk's reserve finds the tier gone, after the refusal arrived
        assert offload.store(metas[1:], kv, list(range(1, 11))) == 0
        assert not offload.connected and offload.counters.unavailable == 1
        assert offload.counters.spill_failures == 1  # the refusal the link kept, counted as the tier went down
        assert offload.counters.spill_skipped_blocks == 10


def _blocks(identity: CacheIdentity, count: int) -> tuple[list[BlockMeta], torch.Tensor]:
    size = identity.block_size
    tokens = list(range(count * size))
    hasher = BlockHasher(identity.hash_algo, identity.hash_seed, size)
    metas = BlockMeta.chain(hasher.hash_blocks(tokens), tokens, size)
    return metas, torch.randn((count, *identity.layout.block_shape)).to(identity.torch_dtype)


def test_a_drained_worker_on_an_ordered_tier_has_every_answer_in(tmp_path: Path, reference: Reference) -> None:
    """Stores end with their copies on an ordered tier, their commits' answers still on the way; when the
    offload thread runs dry it waits for them, so a drained worker's blocks are in the tier for every caller."""
    with ordered_tier(tmp_path) as (_, tier, offload):
        worker = KVWorker("ordered", outage_config(tmp_path), offload=offload)
        try:
            rng = random.Random(11)
            for _ in range(3):
                request = GenerateRequest(random_tokens(rng, 9 * 16 + 3), 2)
                assert worker.generate(request).output_token_ids == reference(request)
            assert worker.drain_offload()
            commits = [held for held in tier.sent if held.answer is not None]
            assert commits and all(held.arrived for held in tier.sent)
            assert tier.waited >= 1  # the last store's commit was waited for when the thread ran dry
            assert offload.counters.spill_failures == 0 and offload.connected
            worker.check_invariants()
        finally:
            worker.shutdown()
