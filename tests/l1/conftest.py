"""Fixtures for L1 tests: tiers on uniquely named arenas that are always closed and unlinked."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import FakeClock
from tiercache.config import L1Config
from tiercache.l1.arena import default_arena_name
from tiercache.l1.tier import L1Tier

KiB = 1024


@pytest.fixture
def make_l1(clock: FakeClock) -> Iterator[Callable[..., L1Tier]]:
    """Build an L1Tier on a fresh arena; ``make_l1(size_bytes=..., eviction_policy=...)``."""
    tiers: list[L1Tier] = []

    def build(**overrides: Any) -> L1Tier:
        settings: dict[str, Any] = {"size_bytes": 64 * KiB, "alignment": 4096}
        settings.update(overrides)
        settings.setdefault("name", default_arena_name())
        tier = L1Tier(L1Config(**settings), clock=clock)
        tiers.append(tier)
        return tier

    yield build
    for tier in tiers:
        tier.close()
