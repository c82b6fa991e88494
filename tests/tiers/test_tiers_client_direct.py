"""LocalTierClient's direct calls: a store without a disk tier runs on the caller's thread, under a lock."""

from __future__ import annotations

import gc
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from kvstore.tiers.client import LocalTierClient
from kvstore.tiers.errors import LeaseError, TierUnavailableError
from kvstore.tiers.link import TierLink
from tests.tiers.tiers_helpers import IDENTITY, arena_name, linked_tier, make_blocks, promote_all, tier_config


def test_direct_calls_answer_at_once_and_keep_their_errors(tmp_path: Path) -> None:
    metas, _ = make_blocks(4)
    with linked_tier(tier_config(tmp_path, cpu_blocks=8)) as (client, link):
        grants = client.reserve(metas, link.slots.incarnation)
        pending = client.commit_later([g.lease_id for g in grants if g is not None])
        assert pending.done()  # no hop to the loop: committed when commit_later returns
        assert client.ordered
        assert pending.result() == 4
        assert client.lookup([m.block_hash for m in metas]).num_blocks == 4
        failed = client.release_later([grants[0].lease_id])  # already ended by the commit
        assert failed.done()
        with pytest.raises(LeaseError):
            failed.result()
        client.check_invariants()


def test_a_store_with_a_disk_tier_is_driven_from_its_loop(tmp_path: Path) -> None:
    metas, _ = make_blocks(2)
    with linked_tier(tier_config(tmp_path, cpu_blocks=8, disk_blocks=8)) as (client, link):
        assert not client._direct
        assert not client.ordered  # a call's disk I/O may interleave with the next call's
        grants = client.reserve(metas, link.slots.incarnation)
        assert client.commit_later([g.lease_id for g in grants if g is not None]).result() == 2


def test_direct_calls_after_close_find_the_store_closed(tmp_path: Path) -> None:
    client = LocalTierClient(tier_config(tmp_path, cpu_blocks=4), IDENTITY, arena_name=arena_name())
    client.close()
    assert not client.ordered
    with pytest.raises(TierUnavailableError):
        client.reserve(make_blocks(1)[0])
    with pytest.raises(TierUnavailableError):
        client.commit_later([1]).result()
    client.close()  # idempotent


def test_threads_share_one_client_without_breaking_the_arena(tmp_path: Path) -> None:
    """Four workers' links on one client, spilling and promoting at once: every byte comes back right."""
    threads, per_thread, rounds = 4, 6, 20
    errors: list[BaseException] = []
    with linked_tier(tier_config(tmp_path, cpu_blocks=threads * per_thread)) as (client, _):

        def work(index: int) -> None:
            link = TierLink(client, IDENTITY)
            try:
                metas, data = make_blocks(per_thread, first_token=index * 10_000, seed=index)
                for _ in range(rounds):
                    link.spill(metas, data, range(per_thread))
                    promoted, rows = promote_all(link, metas)
                    assert len(promoted.block_ids) == per_thread
                    assert torch.equal(rows.view(torch.uint8), data.view(torch.uint8))
            except BaseException as exc:
                errors.append(exc)
            finally:
                link.close()

        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert not errors, errors
        client.check_invariants()


@pytest.mark.parametrize("round_", range(3))
def test_calls_racing_close_end_cleanly(tmp_path: Path, round_: int) -> None:
    """Threads keep calling a loop-driven client (a disk tier) while it closes: each call answers or raises
    TierUnavailableError, and no call's coroutine is left scheduled but never run (before the fix, one
    sent as the loop stopped was reported at garbage collection as "coroutine ... was never awaited")."""
    client = LocalTierClient(
        tier_config(tmp_path / str(round_), cpu_blocks=8, disk_blocks=8), IDENTITY, arena_name=arena_name()
    )
    assert not client._direct
    hashes = [m.block_hash for m in make_blocks(2)[0]]
    outcomes: list[str] = []
    started = threading.Barrier(5)

    def caller(later: bool) -> None:
        started.wait()
        while True:
            try:
                if later:
                    pending = client.release_later([])
                    pending.result()
                else:
                    client.lookup(hashes)
            except TierUnavailableError:
                outcomes.append("closed")
                return
            except BaseException as exc:  # anything else is a failure of the close path
                outcomes.append(f"{type(exc).__name__}: {exc}")
                return

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=caller, args=(i % 2 == 1,)) for i in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        time.sleep(0.02 * (round_ + 1))
        client.close()
        for thread in threads:
            thread.join(timeout=10)
        gc.collect()  # a coroutine left behind is reported when the closed loop's queue lets it go
    assert outcomes == ["closed"] * 4
    assert not [w for w in caught if "never awaited" in str(w.message) or "destroyed" in str(w.message)]


def test_an_acquire_that_times_out_on_a_slow_disk_gives_its_leases_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller gives up on an acquire waiting for a disk read: the call is left to finish (a cancel racing
    its last step could drop grants) and every lease it granted -- the CPU hit's and the block read from
    disk -- is released when it does, so no slot stays pinned."""
    import msgspec

    import kvstore.tiers.disk as disk_module
    from kvstore.tiers.errors import TierTimeoutError

    config = msgspec.structs.replace(tier_config(tmp_path, cpu_blocks=4, disk_blocks=16), io_deadline_s=5.0)
    client = LocalTierClient(config, IDENTITY, arena_name=arena_name(), timeout_s=0.3)
    try:
        metas, _ = make_blocks(6)
        arena = client.arena_info().incarnation
        for meta in metas:  # the first two end up on disk only, the last four in CPU
            client.commit([grant.lease_id for grant in client.reserve([meta], arena) if grant is not None])
        real_read_run = disk_module.read_run
        reading = threading.Event()

        def slow_read(*args: object, **kwargs: object) -> object:
            reading.set()
            time.sleep(0.8)
            return real_read_run(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(disk_module, "read_run", slow_read)
        with pytest.raises(TierTimeoutError):
            client.acquire([metas[5], metas[0]], arena)  # a CPU hit, then a block on disk
        assert reading.is_set()
        deadline = time.monotonic() + 10
        while client.store.cpu.num_leased_slots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.store.cpu.num_leased_slots == 0
        client.check_invariants()
    finally:
        client.close()
