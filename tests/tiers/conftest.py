"""Fixtures of the tier tests (helpers live in tiers_helpers.py)."""

from __future__ import annotations

import pytest
from tiers_helpers import LOOPBACK

from kvstore.config import EventsConfig


@pytest.fixture
def events_config() -> EventsConfig:
    return EventsConfig(endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
