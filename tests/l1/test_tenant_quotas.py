"""Tenant quotas in L1: a tenant over its share evicts its own objects first, a tenant within its
share is never evicted for one over it, and usage is counted per tenant either way."""

from __future__ import annotations

import pytest

from tests.conftest import make_key, payload_for
from tiercache.config import EvictionPolicyName
from tiercache.errors import TierFullError
from tiercache.keys.tenant import tenant_id, tenant_label

KiB = 1024
UNIT = 4 * KiB  # one aligned slot per object
ALICE = tenant_id("alice")
FLOOD = tenant_id("flood")


def store(tier, tenant: bytes, keys: range) -> None:
    for i in keys:
        key = make_key(i)
        handle = tier.reserve(key, UNIT, tenant=tenant)
        handle.buffer[:] = payload_for(key, UNIT)
        tier.commit(handle)


def held(tier, keys: range) -> int:
    return sum(tier.contains(make_key(i)) for i in keys)


@pytest.mark.parametrize("policy", list(EvictionPolicyName))
def test_a_flood_over_its_share_recycles_its_own_bytes_and_leaves_the_others_alone(make_l1, policy) -> None:
    tier = make_l1(size_bytes=16 * UNIT, tenant_share=0.5, eviction_policy=policy)
    store(tier, ALICE, range(0, 6))  # within her 8-object share
    store(tier, FLOOD, range(100, 260))  # 20x its share
    assert held(tier, range(0, 6)) == 6  # Alice's working set is untouched
    assert held(tier, range(100, 260)) == 10  # the flood got the rest of the arena, and no more
    usage = tier.tenants()
    assert usage[tenant_label(ALICE)] == {
        "bytes": 6 * UNIT,
        "objects": 6,
        "quota_bytes": 8 * UNIT,
        "evictions": 0,
        "puts": 6,
    }
    assert usage[tenant_label(FLOOD)]["evictions"] == 150
    assert usage[tenant_label(FLOOD)]["objects"] == 10


def test_a_tenant_within_its_share_takes_room_back_from_the_one_furthest_over(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT, tenant_share=0.5)
    store(tier, FLOOD, range(100, 116))  # the arena was free: a soft quota lets it fill it
    assert held(tier, range(100, 116)) == 16
    store(tier, ALICE, range(0, 8))  # each of hers takes the flood's oldest
    assert held(tier, range(0, 8)) == 8
    assert held(tier, range(100, 108)) == 0 and held(tier, range(108, 116)) == 8


def test_an_over_quota_tenant_whose_own_objects_are_pinned_is_refused_rather_than_evict_others(
    make_l1,
) -> None:
    tier = make_l1(size_bytes=8 * UNIT, tenant_share=0.5)
    store(tier, ALICE, range(0, 4))
    store(tier, FLOOD, range(100, 104))
    pins = [tier.pin(make_key(i)) for i in range(100, 104)]
    with pytest.raises(TierFullError, match=r"full for tenant \w+: .* quota"):
        tier.reserve(make_key(200), UNIT, tenant=FLOOD)
    assert held(tier, range(0, 4)) == 4
    for handle in pins:
        tier.release(handle)
    tier.reserve(make_key(200), UNIT, tenant=FLOOD)  # now its own oldest may go
    assert held(tier, range(100, 104)) == 3


def test_overrides_give_one_tenant_a_larger_share(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT, tenant_share=0.25, tenant_quotas=f"{tenant_label(ALICE)}=0.75")
    store(tier, ALICE, range(0, 12))  # its 12-object share
    store(tier, FLOOD, range(100, 200))
    assert held(tier, range(0, 12)) == 12
    assert tier.tenants()[tenant_label(ALICE)]["quota_bytes"] == 12 * UNIT


def test_without_quotas_one_global_order_decides_and_usage_is_still_counted(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT)
    assert not tier.tenant_quotas
    store(tier, ALICE, range(0, 6))
    store(tier, FLOOD, range(100, 120))
    assert held(tier, range(0, 6)) == 0  # plain LRU: the flood pushed Alice out
    usage = tier.tenants()
    assert usage[tenant_label(ALICE)]["evictions"] == 6
    assert usage[tenant_label(FLOOD)]["objects"] == 16
    assert usage[tenant_label(FLOOD)]["quota_bytes"] == 16 * UNIT


def test_a_store_of_many_that_evicts_for_the_whole_batch_keeps_every_tenants_books(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT)
    store(tier, ALICE, range(0, 6))
    store(tier, FLOOD, range(100, 110))  # the arena is full
    handles = tier.reserve_many(
        [(make_key(i), UNIT) for i in range(200, 210)], tenants=[FLOOD] * 10
    )  # room for all ten made first: Alice's six (the oldest), then four of the flood's
    for handle in handles:
        handle.buffer[:] = payload_for(handle.key, UNIT)
    tier.commit_many(handles)
    usage = tier.tenants()
    assert usage[tenant_label(ALICE)] | {"quota_bytes": 0} == {
        "bytes": 0,
        "objects": 0,
        "quota_bytes": 0,
        "evictions": 6,
        "puts": 6,
    }
    assert (usage[tenant_label(FLOOD)]["objects"], usage[tenant_label(FLOOD)]["evictions"]) == (16, 4)
    assert usage[tenant_label(FLOOD)]["bytes"] == 16 * UNIT == tier.usage().bytes_used
    assert held(tier, range(100, 110)) == 6 and held(tier, range(200, 210)) == 10
    assert tier.stats.evictions == {"capacity": 10}


def test_overwrites_deletes_and_pinned_old_versions_keep_the_books_right(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT, tenant_share=0.5)
    store(tier, ALICE, range(0, 2))
    old = tier.pin(make_key(0))
    store(tier, ALICE, range(0, 1))  # a new version; the old one stays allocated while pinned
    assert tier.tenants()[tenant_label(ALICE)] | {"puts": 0} == {
        "bytes": 3 * UNIT,
        "objects": 2,
        "quota_bytes": 8 * UNIT,
        "evictions": 0,
        "puts": 0,
    }
    tier.release(old)
    tier.delete(make_key(1))
    assert tier.tenants()[tenant_label(ALICE)]["bytes"] == UNIT
    assert tier.tenants()[tenant_label(ALICE)]["objects"] == 1
    assert tier.usage().bytes_used == UNIT


def test_stores_that_name_no_tenant_belong_to_the_default_tenant(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT)
    tier.put(make_key(1), payload_for(make_key(1), UNIT))
    assert tier.tenants() == {
        "default": {"bytes": UNIT, "objects": 1, "quota_bytes": 16 * UNIT, "evictions": 0, "puts": 1}
    }
