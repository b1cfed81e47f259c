"""The disk tier passes the tier conformance suite, restart tests included."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FakeClock
from tests.tier_contract import TierContract
from tiercache.config import DiskConfig
from tiercache.l2_disk import DiskTier


class TestDiskTierContract(TierContract):
    persistent = True

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> DiskTier:
        return DiskTier(
            DiskConfig(path=tmp_path / "l2", budget_bytes=budget, sync_interval_s=0.05),
            clock=clock,
        )
