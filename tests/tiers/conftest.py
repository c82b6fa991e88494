"""Fixtures of the tier tests (helpers live in tiers_helpers.py)."""

from __future__ import annotations

import pytest
from tiers_helpers import LOOPBACK

from kvstore.config import EventsConfig
from kvstore.tiers import cpu_arena


@pytest.fixture
def events_config() -> EventsConfig:
    return EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)


@pytest.fixture(params=["native", "python"])
def arena_books(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the arena's books in C (CpuArena), then in Python (PyCpuArena): every store the test
    builds gets that arena from new_arena()."""
    if request.param == "python":
        monkeypatch.setattr(cpu_arena, "NATIVE", False)
    elif not cpu_arena.NATIVE:
        pytest.skip("the compiled SlotTable is not built")
    return request.param  # type: ignore[no-any-return]
