"""The disk tier passes the tier conformance suite: restarts, eviction hand-over and damage included."""

from __future__ import annotations

from pathlib import Path

from tiercache.config import DiskConfig
from tiercache.keys.object_key import ObjectKey
from tiercache.l2_disk import DiskTier
from tiercache.testing.fixtures import FakeClock
from tiercache.testing.tier_suite import PersistentTierSuite
from tiercache.tier.contract import Tier


def make_disk(tmp_path: Path, clock: FakeClock, budget: int) -> DiskTier:
    return DiskTier(DiskConfig(path=tmp_path / "l2", budget_bytes=budget, sync_interval_s=0.05), clock=clock)


def damage_disk(tier: DiskTier, key: ObjectKey) -> None:
    """Flip one byte of the stored payload in place, in its own LMDB write (below every check)."""
    kb = key.to_bytes()
    env, data_db = tier._env, tier._dbs["data"]  # the tier's own handle: LMDB allows one per process
    with env.begin(write=True, db=data_db) as txn:
        stored = bytearray(txn.get(kb))
        stored[len(stored) // 2] ^= 0xFF
        txn.put(kb, bytes(stored))


class TestDiskTierContract(PersistentTierSuite):
    hands_over_evictions = True

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return make_disk(tmp_path, clock, budget)

    def damage(self, tier: Tier, key: ObjectKey) -> None:
        assert isinstance(tier, DiskTier)
        damage_disk(tier, key)
