"""The S3 tier passes the tier conformance suite against moto's S3 server over real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import S3Endpoint
from tests.l3_s3.helpers import make_s3_tier
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3 import S3Tier
from tiercache.testing.fixtures import FakeClock
from tiercache.testing.tier_suite import PersistentTierSuite
from tiercache.tier.contract import Tier


def damage_s3(tier: S3Tier, key: ObjectKey) -> None:
    """Overwrite the stored object with another object's bytes, through S3 itself."""
    client = tier.raw_client()
    try:
        body = client.get_object(Bucket=tier.config.bucket, Key=tier.object_name(key))["Body"].read()
        client.put_object(
            Bucket=tier.config.bucket, Key=tier.object_name(key), Body=body[:-1] + bytes([body[-1] ^ 0xFF])
        )
    finally:
        client.close()


class TestS3Contract(PersistentTierSuite):
    @pytest.fixture(autouse=True)
    def _endpoint(self, s3: S3Endpoint) -> None:
        # The suite's fixtures know nothing of S3; every test here gets a freshly emptied endpoint.
        self.endpoint = s3

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return make_s3_tier(self.endpoint, clock, capacity_bytes=budget)

    def damage(self, tier: Tier, key: ObjectKey) -> None:
        assert isinstance(tier, S3Tier)
        damage_s3(tier, key)
