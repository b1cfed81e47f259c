"""Wrapper tiers keep the whole contract of the tier they wrap: they pass its conformance suite, and
they forward every method, so nothing the inner tier does better or in addition gets lost."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tests.conftest import S3Endpoint
from tests.l1.test_l1_contract import make_l1
from tests.l2_disk.test_disk_contract import damage_disk, make_disk
from tests.l3_s3.helpers import make_s3_tier
from tests.l3_s3.test_s3_contract import damage_s3
from tiercache.keys.object_key import ObjectKey
from tiercache.l2_disk import DiskTier
from tiercache.l3_s3 import S3Tier
from tiercache.testing.faults import FaultInjectingTier, FaultPlan
from tiercache.testing.fixtures import FakeClock
from tiercache.testing.tier_suite import FrontTierSuite, PersistentTierSuite
from tiercache.tier.contract import FrontTier, Tier
from tiercache.tier.wrappers import WrapperTier


def test_a_wrapper_forwards_every_method_of_the_contract() -> None:
    """Defaults included: a default the wrapper inherited would run against the wrapper, not the
    inner tier (that is how write-back through a wrapped disk tier once silently never wrote)."""
    contract = {
        name
        for cls in (Tier, FrontTier)
        for name, member in vars(cls).items()
        if callable(member) and not name.startswith("_")
    }
    missing = sorted(name for name in contract if name not in vars(WrapperTier))
    assert missing == []


def test_an_owed_write_into_a_wrapped_tier_that_cannot_owe_is_refused(
    tmp_path: Path, clock: FakeClock
) -> None:
    wrapped = WrapperTier(make_disk(tmp_path, clock, 1 << 20))
    try:
        with pytest.raises(TypeError, match="not a front tier"):
            wrapped.put(ObjectKey.parse("46" * 16 + "/g0/" + "00" * 16), b"x", owed=True)
    finally:
        wrapped.close()


class TestWrappedL1(FrontTierSuite):
    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return WrapperTier(make_l1(clock, budget))


class TestFaultInjectingL1WithoutFaults(FrontTierSuite):
    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return FaultInjectingTier(make_l1(clock, budget), FaultPlan())


class TestWrappedDisk(PersistentTierSuite):
    hands_over_evictions = True

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return WrapperTier(make_disk(tmp_path, clock, budget))

    def damage(self, tier: Tier, key: ObjectKey) -> None:
        assert isinstance(tier, WrapperTier) and isinstance(tier.inner, DiskTier)
        damage_disk(tier.inner, key)


class TestFaultInjectingDiskWithoutFaults(TestWrappedDisk):
    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return FaultInjectingTier(make_disk(tmp_path, clock, budget), FaultPlan())


class TestFaultInjectingS3WithoutFaults(PersistentTierSuite):
    @pytest.fixture(autouse=True)
    def _endpoint(self, s3: S3Endpoint) -> None:
        self.endpoint = s3

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return FaultInjectingTier(make_s3_tier(self.endpoint, clock, capacity_bytes=budget), FaultPlan())

    def damage(self, tier: Tier, key: ObjectKey) -> None:
        assert isinstance(tier, WrapperTier) and isinstance(tier.inner, S3Tier)
        damage_s3(tier.inner, key)


def test_wrappers_of_every_kind_are_checked() -> None:
    """Each wrapper class of the package runs a suite above (a new wrapper needs its own class here)."""
    import tiercache.testing.faults as faults
    import tiercache.tier.wrappers as wrappers

    kinds = {
        cls
        for module in (wrappers, faults)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, WrapperTier) and cls.__module__ == module.__name__
    }
    assert kinds == {WrapperTier, FaultInjectingTier}
