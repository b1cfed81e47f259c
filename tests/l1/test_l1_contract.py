"""L1 passes the conformance suite every tier passes, with each eviction policy."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import FakeClock
from tests.tier_contract import TierContract
from tiercache.config import EvictionPolicyName, L1Config
from tiercache.l1 import L1Tier, default_arena_name
from tiercache.tier import Tier


class TestL1Contract(TierContract):
    policy = EvictionPolicyName.LRU

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        config = L1Config(size_bytes=budget, name=default_arena_name(), eviction_policy=self.policy)
        return L1Tier(config, clock=clock)


class TestL1ContractWithS3FIFO(TestL1Contract):
    policy = EvictionPolicyName.S3FIFO
