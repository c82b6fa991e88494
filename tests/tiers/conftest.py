"""Fixtures of the tier tests (helpers live in tiers_helpers.py)."""

from __future__ import annotations

import pytest
from tiers_helpers import LOOPBACK

from kvstore.config import EventsConfig
from kvstore.tiers.cpu_arena import CpuArena


@pytest.fixture
def events_config() -> EventsConfig:
    return EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)


@pytest.fixture(params=["native", "python"])
def arena_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the arena's compiled batch loops, then on its Python ones (every arena the test builds)."""
    if request.param == "python":
        monkeypatch.setattr(CpuArena, "_native", None)
    elif CpuArena._native is None:
        pytest.skip("the compiled batch loops are not built")
    return request.param  # type: ignore[no-any-return]
