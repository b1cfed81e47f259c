"""Specification: with several nodes writing one prefix, the capacity bound holds for the prefix as a
whole. Each tier lists the prefix again every ``relist_interval_s``, counts what other nodes wrote,
forgets what they deleted, and evicts the oldest objects overall (whoever wrote them); so the prefix
holds at most ``capacity_bytes`` plus what all nodes write in one interval. Without relisting, each
node bounds only what it knows, and N nodes hold about N x the capacity (the control below).

Two tiers on moto's S3 server over real HTTP; the bucket is read back with plain boto3."""

from __future__ import annotations

from typing import Any

from tests.conftest import FakeClock, S3Endpoint, make_key, payload_for
from tests.l3_s3.helpers import BUCKET, make_s3_tier, raw_client
from tiercache.testing.poll import wait_until

OBJECT = 64 * 1024
PER_NODE = 10


def prefix_objects(raw: Any) -> dict[str, int]:
    """Every chunk object under the tests' prefix, as S3 itself lists it: name → size."""
    out: dict[str, int] = {}
    for page in raw.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="tc/"):
        for obj in page.get("Contents", ()):
            if "/manifests/" not in obj["Key"]:
                out[obj["Key"]] = int(obj["Size"])
    return out


def write_as_two_nodes(s3: S3Endpoint, clock: FakeClock, relist_interval_s: float) -> tuple[Any, Any, int]:
    a = make_s3_tier(s3, clock, relist_interval_s=relist_interval_s)
    a.put(make_key(0), payload_for(make_key(0), OBJECT))
    framed = a.usage().bytes_used
    a.close()
    raw_client(s3).delete_object(Bucket=BUCKET, Key=a.object_name(make_key(0)))
    capacity = PER_NODE * framed  # room for one node's objects
    a = make_s3_tier(s3, clock, capacity_bytes=capacity, relist_interval_s=relist_interval_s)
    b = make_s3_tier(s3, clock, capacity_bytes=capacity, relist_interval_s=relist_interval_s)
    for i in range(PER_NODE):  # node A first, then node B: A's objects are the oldest
        a.put(make_key(i), payload_for(make_key(i), OBJECT))
    for i in range(PER_NODE, 2 * PER_NODE):
        b.put(make_key(i), payload_for(make_key(i), OBJECT))
    return a, b, capacity


def test_several_writers_keep_the_prefix_within_one_capacity(s3: S3Endpoint, clock: FakeClock) -> None:
    a, b, capacity = write_as_two_nodes(s3, clock, relist_interval_s=0.2)
    raw = raw_client(s3)
    try:
        held = wait_until(
            lambda: (objects := prefix_objects(raw)) and sum(objects.values()) <= capacity and objects,
            timeout=20,
            what="the prefix back within one capacity",
        )
        # The oldest went, whoever wrote them: what is left is node B's, the newest.
        assert set(held) == {b.object_name(make_key(i)) for i in range(PER_NODE, 2 * PER_NODE)}
        # Both nodes' indexes agree with the bucket once they relisted (A forgot what B evicted).
        wait_until(
            lambda: a.usage().bytes_used == b.usage().bytes_used == sum(held.values()),
            timeout=20,
            what="both indexes to match the bucket",
        )
        evicted = a.stats.snapshot()["evictions"].get("capacity", 0) + b.stats.snapshot()["evictions"].get(
            "capacity", 0
        )
        assert evicted >= PER_NODE  # counted where they were evicted
    finally:
        a.close()
        b.close()


def test_without_relisting_each_node_bounds_only_what_it_wrote(s3: S3Endpoint, clock: FakeClock) -> None:
    a, b, capacity = write_as_two_nodes(s3, clock, relist_interval_s=0)
    try:
        total = sum(prefix_objects(raw_client(s3)).values())
        assert total == 2 * capacity  # two nodes, twice the bound
        assert a.usage().bytes_used == b.usage().bytes_used == capacity
    finally:
        a.close()
        b.close()
