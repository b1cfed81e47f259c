"""The S3 tier passes the tier conformance suite against moto's S3 server over real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FakeClock, S3Endpoint
from tests.l3_s3.helpers import make_s3_tier
from tests.tier_contract import TierContract
from tiercache.tier import Tier


class TestS3Contract(TierContract):
    persistent = True

    @pytest.fixture(autouse=True)
    def _endpoint(self, s3: S3Endpoint) -> None:
        # The suite's fixtures know nothing of S3; every test here gets a freshly emptied endpoint.
        self.endpoint = s3

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        return make_s3_tier(self.endpoint, clock, capacity_bytes=budget)
