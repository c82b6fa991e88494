"""Placement options and endpoint reporting of the Ray actor wrapper (no cluster needed)."""

from __future__ import annotations

import pytest
from workers_testlib import make_config

from kvstore.workers.actor import routable_endpoint, worker_actor_options


@pytest.mark.parametrize(
    ("device", "cluster_gpus", "num_gpus"),
    [("auto", 0.0, 0), ("auto", 4.0, 1), ("auto", 0.5, 0), ("cpu", 8.0, 0), ("cuda", 0.0, 1)],
)
def test_a_gpu_is_requested_when_configured_or_available(device: str, cluster_gpus: float, num_gpus: int) -> None:
    options = worker_actor_options(make_config(device=device), cluster_gpus=cluster_gpus)
    assert options == {"num_cpus": 1.0, "num_gpus": num_gpus}


def test_wildcard_binds_are_reported_with_the_node_address() -> None:
    assert routable_endpoint("tcp://0.0.0.0:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert routable_endpoint("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert routable_endpoint("tcp://[::]:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert routable_endpoint("tcp://127.0.0.1:5557", "10.0.0.7") == "tcp://127.0.0.1:5557"
    assert routable_endpoint("ipc:///tmp/kv.sock", "10.0.0.7") == "ipc:///tmp/kv.sock"
