"""Eviction policies: LRU order, and S3-FIFO keeping reused keys through a scan of one-off keys."""

from __future__ import annotations

import pytest

from tiercache.config import EvictionPolicyName
from tiercache.errors import ConfigError
from tiercache.l1.policy import LRUPolicy, S3FIFOPolicy, make_policy


def always(_: object) -> bool:
    return True


def test_policies_are_chosen_by_config_name() -> None:
    assert isinstance(make_policy(EvictionPolicyName.LRU), LRUPolicy)
    assert isinstance(make_policy("s3fifo"), S3FIFOPolicy)
    with pytest.raises(ConfigError, match="choose one of: lru, s3fifo"):
        make_policy("random")


def test_lru_evicts_the_least_recently_used_key() -> None:
    lru: LRUPolicy[str] = LRUPolicy()
    for k in "abc":
        lru.on_insert(k)
    lru.on_access("a")
    assert lru.evict_one(always) == "b"
    assert lru.evict_one(always) == "c"
    assert lru.evict_one(always) == "a"
    assert lru.evict_one(always) is None


@pytest.mark.parametrize("untracked", [(), ("x",)], ids=["all-tracked", "one-untracked"])
def test_lru_reads_of_many_keys_make_them_most_recent_in_order(untracked: tuple[str, ...]) -> None:
    """A ticket's release reads its keys at once; a key not tracked (gone meanwhile) is skipped
    and the others still move, in the order read."""
    lru: LRUPolicy[str] = LRUPolicy()
    for k in "abcde":
        lru.on_insert(k)
    lru.on_access_many(["b", *untracked, "a", "d"])
    assert [lru.evict_one(always) for _ in range(6)] == ["c", "e", "b", "a", "d", None]


@pytest.mark.parametrize("policy_cls", [LRUPolicy, S3FIFOPolicy], ids=["lru", "s3fifo"])
def test_keys_that_may_not_go_are_skipped_and_kept(policy_cls: type) -> None:
    policy = policy_cls()
    for k in "abc":
        policy.on_insert(k)
    assert policy.evict_one(lambda k: k == "c") == "c"
    assert "a" in policy and "b" in policy
    assert policy.evict_one(lambda k: False) is None
    assert len(policy) == 2


@pytest.mark.parametrize("policy_cls", [LRUPolicy, S3FIFOPolicy], ids=["lru", "s3fifo"])
def test_removed_keys_are_never_chosen(policy_cls: type) -> None:
    policy = policy_cls()
    for k in "abc":
        policy.on_insert(k)
    policy.on_remove("a")
    chosen = {policy.evict_one(always), policy.evict_one(always)}
    assert chosen == {"b", "c"}
    assert policy.evict_one(always) is None


def test_s3fifo_keeps_a_reused_key_while_a_scan_of_new_keys_passes_through() -> None:
    s3: S3FIFOPolicy[str] = S3FIFOPolicy()
    capacity = 10
    s3.on_insert("hot")
    s3.on_access("hot")
    for i in range(capacity - 1):
        s3.on_insert(f"warm{i}")
    for i in range(1000):  # one-pass scan: each key inserted once, never read
        s3.evict_one(always)
        s3.on_insert(f"scan{i}")
    assert "hot" in s3


def test_s3fifo_readmits_a_recently_evicted_key_straight_to_the_main_queue() -> None:
    s3: S3FIFOPolicy[str] = S3FIFOPolicy()
    for k in "abcd":
        s3.on_insert(k)
    assert s3.evict_one(always) == "a"  # unused on probation: evicted, remembered as a ghost
    s3.on_insert("a")  # comes back: proven reuse
    for k in "efgh":
        s3.evict_one(always)
        s3.on_insert(k)
    assert "a" in s3
