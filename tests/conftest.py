"""Shared fixtures: one local Ray cluster per test session (startup costs seconds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Tiny Hugging Face checkpoints (session fixtures) for any test that names one.
pytest_plugins = ("tests.checkpoints",)

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[object]:
    """A local Ray cluster shared by every test that needs one (4 logical CPUs on 2 cores)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=256 * 1024 * 1024,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
