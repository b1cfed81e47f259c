"""Every S3 tier test runs on both endpoints of the parametrised fixture: moto and Ceph's RGW."""

from __future__ import annotations

import pytest

from tests.conftest import S3Endpoint


@pytest.fixture
def s3(s3_any: S3Endpoint) -> S3Endpoint:
    return s3_any
