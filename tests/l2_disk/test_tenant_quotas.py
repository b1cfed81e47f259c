"""Tenant quotas on the disk tier: the same rules as L1's, with each object's tenant and each
tenant's totals persisted in the LMDB environment (so they hold across restarts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FakeClock, make_key, payload_for
from tiercache.config import DiskConfig
from tiercache.errors import TierFullError
from tiercache.keys.tenant import tenant_id, tenant_label
from tiercache.l2_disk import DiskTier
from tiercache.l2_disk.records import DISK_FORMAT_VERSION, INFO_FORMAT, b64, u64

KiB = 1 << 10
CHUNK = 16 * KiB
BUDGET = 20 * CHUNK  # evicts above 19 chunks, down to 17
ALICE = tenant_id("alice")
FLOOD = tenant_id("flood")


def open_tier(path: Path, clock: FakeClock, **kw: object) -> DiskTier:
    kw.setdefault("sync_interval_s", 0.05)
    return DiskTier(DiskConfig(path=path, budget_bytes=BUDGET, **kw), clock=clock)


def put(tier: DiskTier, tenant: bytes, keys: range) -> None:
    for i in keys:
        tier.put(make_key(i), payload_for(make_key(i), CHUNK), tenant=tenant)


def held(tier: DiskTier, keys: range) -> int:
    return sum(tier.contains(make_key(i)) for i in keys)


def test_a_flood_over_its_share_evicts_its_own_objects_and_never_the_others(
    tmp_path: Path, clock: FakeClock
) -> None:
    tier = open_tier(tmp_path / "l2", clock, tenant_share=0.5)
    put(tier, ALICE, range(0, 6))
    put(tier, FLOOD, range(100, 200))  # ten times its 10-chunk share
    assert held(tier, range(0, 6)) == 6
    usage = tier.tenants()
    assert usage[tenant_label(ALICE)] == {
        "bytes": 6 * CHUNK,
        "objects": 6,
        "quota_bytes": BUDGET // 2,
        "evictions": 0,
        "puts": 6,
    }
    flood = usage[tenant_label(FLOOD)]
    assert flood["objects"] == held(tier, range(100, 200)) and flood["bytes"] == flood["objects"] * CHUNK
    assert flood["evictions"] == 100 - flood["objects"]
    assert tier.usage().bytes_used == (6 + flood["objects"]) * CHUNK
    tier.close()


def test_a_tenant_within_its_share_takes_room_from_the_one_over_it(tmp_path: Path, clock: FakeClock) -> None:
    tier = open_tier(tmp_path / "l2", clock, tenant_share=0.5)
    put(tier, FLOOD, range(100, 119))  # alone, it may fill the disk (quotas are soft)
    put(tier, ALICE, range(0, 9))
    assert held(tier, range(0, 9)) == 9
    assert held(tier, range(100, 103)) == 0  # the flood's oldest went first
    assert tier.tenants()[tenant_label(ALICE)]["evictions"] == 0
    tier.close()


def test_an_over_quota_tenant_that_cannot_evict_its_own_is_refused_not_given_the_others_room(
    tmp_path: Path, clock: FakeClock
) -> None:
    tier = open_tier(tmp_path / "l2", clock, tenant_share=0.5)
    put(tier, ALICE, range(0, 9))
    put(tier, FLOOD, range(100, 110))  # 19 chunks: at the high watermark
    pins = [tier.pin(make_key(i)) for i in range(100, 110)]
    put(tier, FLOOD, range(110, 111))  # its own are pinned, Alice is within her share: no eviction
    pins.append(tier.pin(make_key(110)))
    assert tier.usage().bytes_used == BUDGET
    with pytest.raises(TierFullError, match=r"tenant \w+ .* over its quota"):
        put(tier, FLOOD, range(111, 112))
    assert held(tier, range(0, 9)) == 9
    for handle in pins:
        assert handle is not None
        tier.release(handle)
    tier.close()


def test_tenants_and_their_totals_survive_a_restart_and_follow_overwrites_and_deletes(
    tmp_path: Path, clock: FakeClock
) -> None:
    tier = open_tier(tmp_path / "l2", clock)
    put(tier, ALICE, range(0, 3))
    put(tier, FLOOD, range(10, 12))
    put(tier, FLOOD, range(0, 1))  # key 0 now belongs to the flood
    tier.delete(make_key(11))
    tier.close()

    tier = open_tier(tmp_path / "l2", clock, tenant_share=0.5)
    usage = tier.tenants()
    assert (usage[tenant_label(ALICE)]["objects"], usage[tenant_label(ALICE)]["bytes"]) == (2, 2 * CHUNK)
    assert (usage[tenant_label(FLOOD)]["objects"], usage[tenant_label(FLOOD)]["bytes"]) == (2, 2 * CHUNK)
    tier.put(make_key(50), payload_for(make_key(50), CHUNK))  # no tenant: the default tenant
    assert tier.tenants()["default"]["objects"] == 1
    tier.close()


def test_a_layout_2_environment_opens_with_every_object_the_default_tenants(
    tmp_path: Path, clock: FakeClock
) -> None:
    tier = open_tier(tmp_path / "l2", clock)
    tier.put(make_key(1), payload_for(make_key(1), CHUNK))
    with tier._env.begin(write=True, db=tier._meta_db) as txn:  # what a layout-2 build left
        txn.put(INFO_FORMAT, b64(2))
    tier.close()

    tier = open_tier(tmp_path / "l2", clock, tenant_share=0.5)
    assert tier.get(make_key(1)) == payload_for(make_key(1), CHUNK)
    assert tier.tenants() == {
        "default": {"bytes": CHUNK, "objects": 1, "quota_bytes": BUDGET // 2, "evictions": 0, "puts": 0}
    }
    with tier._env.begin(db=tier._meta_db) as txn:
        assert u64(txn.get(INFO_FORMAT)) == DISK_FORMAT_VERSION == 3
    tier.close()
