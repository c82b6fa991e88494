"""TierActor on a local Ray cluster: placement and name, the lease protocol through Ray, the arena from outside."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tiers_helpers import IDENTITY, LOOPBACK, all_events, hashes, make_blocks, promote_all, spill_all, tier_config

from kvstore.config import EventsConfig
from kvstore.events import BlockStored, Medium
from kvstore.tiers.actor import TIER_NAMESPACE, get_or_create_tier_actor, tier_actor_name
from kvstore.tiers.client import RayTierClient
from kvstore.tiers.errors import InvalidBlockError
from kvstore.tiers.link import TierLink

pytestmark = pytest.mark.ray


def test_tier_actor_on_the_local_node(ray_session: Any, tmp_path: Path) -> None:
    ray = ray_session
    node_id = ray.get_runtime_context().get_node_id()
    config = tier_config(tmp_path, cpu_blocks=4, disk_blocks=32)
    events = EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
    handle = get_or_create_tier_actor(config, IDENTITY, events=events, node_id=node_id)
    try:
        again = get_or_create_tier_actor(config, IDENTITY, events=events)  # same node, same name: same actor
        assert again._actor_id == handle._actor_id
        named = ray.get_actor(tier_actor_name(node_id), namespace=TIER_NAMESPACE)
        assert named._actor_id == handle._actor_id

        # A worker's path: this process maps the actor's arena by name and copies itself; no KV crosses Ray.
        info = ray.get(handle.arena_info.remote(), timeout=30)
        assert os.path.exists(os.path.join(info.shm_dir, info.name)) and info.tag == IDENTITY.digest()
        client = RayTierClient(handle)
        link = TierLink(client, IDENTITY, close_client=True)
        assert client.channel is not None  # the hot calls go over the control socket
        assert client.ordered  # which runs them in the order sent: no call waits for an earlier answer
        metas, data = make_blocks(6)
        assert spill_all(link, metas, data) == 6
        assert ray.get(handle.lookup.remote(hashes(metas)), timeout=30) == (6, ("STORAGE",) * 2 + ("CPU",) * 4)
        promoted_all, got = promote_all(link, metas)
        assert len(promoted_all.block_ids) == 6 and torch.equal(got, data)
        more, more_data = make_blocks(3, first_token=1000, seed=2)
        assert link.spill(more, more_data, [0, 1, 2]) == 3
        pool = torch.zeros_like(more_data)
        promoted = link.promote(more, pool, lambda n: [2, 1, 0][:n])
        assert promoted.block_ids == (2, 1, 0) and torch.equal(pool[[2, 1, 0]], more_data)
        link.close()
        assert client.channel is None  # closed with the link

        # Reserves and acquires travel packed: a damaged buffer is the caller's error, named, and changes nothing.
        for method in (handle.reserve_packed, handle.acquire_packed):
            with pytest.raises(ray.exceptions.RayTaskError) as caught:
                ray.get(method.remote(b"\xc1 not msgpack", None), timeout=30)
            assert isinstance(caught.value.cause, InvalidBlockError) and "malformed" in str(caught.value.cause)

        stats = ray.get(handle.stats.remote(), timeout=30)
        assert stats.offload_bytes["spill"] == 9 * IDENTITY.block_bytes and stats.blocks["CPU"] == 4
        ray.get(handle.check_invariants.remote(), timeout=30)
        text = ray.get(handle.metrics_text.remote(), timeout=30).decode()
        assert f'kvstore_tier_usage_bytes{{medium="CPU",node="{node_id}"}}' in text  # its node's, as merged

        endpoints = ray.get(handle.event_endpoints.remote(), timeout=30)
        assert ray.get(handle.flush_events.remote(), timeout=30)
        media = {e.medium for e in all_events(endpoints.replay_endpoint) if isinstance(e, BlockStored)}
        assert media == {"CPU", "STORAGE"}

        ray.get(handle.shutdown.remote(), timeout=30)
        assert not os.path.exists(os.path.join(info.shm_dir, info.name))  # the arena is unlinked
    finally:
        ray.kill(handle, no_restart=True)


def test_with_the_control_socket_off_every_call_goes_through_ray(ray_session: Any, tmp_path: Path) -> None:
    ray = ray_session
    config = tier_config(tmp_path, cpu_blocks=4, control_socket=False)
    handle = get_or_create_tier_actor(config, IDENTITY, namespace="kvstore-test-ray-calls")  # an actor of its own
    try:
        client = RayTierClient(handle)
        assert client.channel is None
        assert not client.ordered  # Ray may run an async actor's calls out of order: the link waits for answers
        link = TierLink(client, IDENTITY, close_client=True)
        metas, data = make_blocks(3)
        assert link.spill(metas, data, [0, 1, 2]) == 3
        promoted, got = promote_all(link, metas)
        assert len(promoted.block_ids) == 3 and torch.equal(got, data)
        link.close()
        ray.get(handle.shutdown.remote(), timeout=30)
    finally:
        ray.kill(handle, no_restart=True)


def wait_until_dead(handle: Any, timeout_s: float = 30.0) -> None:
    """Until a call to ``handle`` fails as a dead actor's does. ``ray.kill`` returns before the actor is gone: a
    call sent right after it can still be answered (seen in a clean CI run), so one call proves nothing."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.check_invariants.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    pytest.fail(f"the actor still answered {timeout_s:.0f} s after ray.kill")


def test_a_killed_tiers_socket_file_is_removed_by_the_next_tier_of_its_arena(ray_session: Any, tmp_path: Path) -> None:
    """A tier actor killed without shutting down leaves its control socket file; the next tier of that arena
    name (a restart, or the next deployment on the node) removes it, and its own goes at shutdown."""
    ray = ray_session
    config = tier_config(tmp_path, cpu_blocks=4)
    first = get_or_create_tier_actor(config, IDENTITY, namespace="kvstore-test-killed")
    second = None
    try:
        client = RayTierClient(first)
        assert client.channel is not None
        path = Path(client.channel.endpoint.removeprefix("ipc://"))
        assert path.exists()
        client.close()
        ray.kill(first, no_restart=True)
        wait_until_dead(first)
        assert path.exists()  # nobody could remove it
        second = get_or_create_tier_actor(config, IDENTITY, namespace="kvstore-test-next")
        assert ray.get(second.check_invariants.remote(), timeout=30) is None  # constructed
        assert not path.exists()
        ray.get(second.control_endpoint.remote(), timeout=30)
        ray.get(second.shutdown.remote(), timeout=30)
        assert not list(path.parent.glob(path.name.split(".")[0] + ".*.ctl"))
    finally:
        for handle in (first, second):
            if handle is not None:
                ray.kill(handle, no_restart=True)


def test_a_ray_call_that_times_out_has_its_late_grants_released(ray_session: Any) -> None:
    """Through Ray (no control socket), a reserve the client stopped waiting for still grants its leases:
    when its answer comes, the client releases them on the actor."""
    ray = ray_session
    from kvstore.tiers.blocks import SlotGrant, encode_grants
    from kvstore.tiers.errors import TierTimeoutError

    @ray.remote(num_cpus=0)
    class SlowTier:
        """Answers reserve late with two grants, and records what is released."""

        def __init__(self) -> None:
            self.released: list[list[int]] = []

        def control_endpoint(self) -> None:
            return None

        def reserve_packed(self, packed: bytes, arena: int | None) -> bytes:
            time.sleep(1.0)
            grant = SlotGrant(lease_id=7, slot=0, block_hash=1, medium=Medium.CPU)
            return encode_grants([grant, None, grant._replace(lease_id=8, slot=1, block_hash=2)])

        def release(self, lease_ids: list[int]) -> None:
            self.released.append(list(lease_ids))

        def seen(self) -> list[list[int]]:
            return self.released

    actor = SlowTier.remote()  # type: ignore[attr-defined]
    assert ray.get(actor.seen.remote(), timeout=60) == []  # started: only the reserve may be slow
    client = RayTierClient(actor, timeout_s=0.3)
    assert client.channel is None  # no control socket: the call goes through Ray
    metas, _ = make_blocks(3)
    with pytest.raises(TierTimeoutError):
        client.reserve(metas)
    deadline = time.monotonic() + 30
    while not ray.get(actor.seen.remote(), timeout=30) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(actor.seen.remote(), timeout=30) == [[7, 8]]
    ray.kill(actor)
