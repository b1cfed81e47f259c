"""L1 passes the conformance suite of the engine's first tier, with each eviction policy."""

from __future__ import annotations

from pathlib import Path

from tiercache.config import EvictionPolicyName, L1Config
from tiercache.l1.arena import default_arena_name
from tiercache.l1.tier import L1Tier
from tiercache.testing.fixtures import FakeClock
from tiercache.testing.tier_suite import FrontTierSuite


def make_l1(clock: FakeClock, budget: int, policy: EvictionPolicyName = EvictionPolicyName.LRU) -> L1Tier:
    return L1Tier(L1Config(size_bytes=budget, name=default_arena_name(), eviction_policy=policy), clock=clock)


class TestL1Contract(FrontTierSuite):
    policy = EvictionPolicyName.LRU

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> L1Tier:
        return make_l1(clock, budget, self.policy)


class TestL1ContractWithS3FIFO(TestL1Contract):
    policy = EvictionPolicyName.S3FIFO
