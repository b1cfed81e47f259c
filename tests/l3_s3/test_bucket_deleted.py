"""Specification: the bucket deleted under a running tier (an operator's mistake, a lifecycle gone
wrong). Every read is a miss, never an error the caller sees and never wrong bytes; a write raises
:class:`~tiercache.errors.S3TierError` naming the bucket; the tier does not recreate it behind the
operator's back. Runs on moto and on Ceph RGW."""

from __future__ import annotations

import pytest

from tests.conftest import FakeClock, S3Endpoint, make_key, payload_for
from tests.l3_s3.helpers import BUCKET, make_s3_tier, raw_client
from tiercache.errors import S3TierError

CHUNK = 4096


def test_a_bucket_deleted_under_a_running_tier_is_misses_and_failed_writes(
    s3: S3Endpoint, clock: FakeClock
) -> None:
    keys = [make_key(i) for i in range(10)]
    with make_s3_tier(s3, clock, breaker_failures=100) as tier:
        for key in keys:
            tier.put(key, payload_for(key, CHUNK))
        raw = raw_client(s3)
        raw.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": tier.object_name(k)} for k in keys]})
        raw.delete_bucket(Bucket=BUCKET)

        assert [tier.get(key) for key in keys] == [None] * len(keys)
        with pytest.raises(S3TierError, match=BUCKET):
            tier.put(make_key(50), b"x" * 10)
        assert BUCKET not in {b["Name"] for b in raw.list_buckets().get("Buckets", ())}
