"""Real tiers for engine tests: an L1 arena, an LMDB directory, and a bucket on the moto endpoint."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import S3Endpoint
from tiercache.config import DiskConfig, EngineConfig, L1Config, S3Config
from tiercache.engine import TieredEngine
from tiercache.l1.tier import L1Tier
from tiercache.l2_disk import DiskTier
from tiercache.l3_s3 import S3Tier
from tiercache.tier import Tier

MiB = 1 << 20


def l1_tier(size: int = 8 * MiB) -> L1Tier:
    return L1Tier(L1Config(size_bytes=size, name=f"tc-test-{uuid.uuid4().hex[:12]}"))


def disk_tier(path: Path, budget: int = 16 * MiB, **kw: object) -> DiskTier:
    return DiskTier(DiskConfig(path=path, budget_bytes=budget), **kw)  # type: ignore[arg-type]


def s3_tier(endpoint: S3Endpoint, bucket: str = "tiercache-test", **kw: object) -> S3Tier:
    cfg = S3Config(
        bucket=bucket,
        endpoint_url=endpoint.url,
        region=endpoint.region,
        path_style=True,
        create_bucket=True,
        **kw,  # type: ignore[arg-type]
    )
    return S3Tier(cfg)


EngineFactory = Callable[..., TieredEngine]


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Build engines from tiers; every engine built is closed at the end of the test."""
    built: list[TieredEngine] = []

    def factory(l1: Tier, *lower: Tier, **cfg: object) -> TieredEngine:
        engine = TieredEngine(l1, lower, EngineConfig(**cfg))  # type: ignore[arg-type]
        built.append(engine)
        return engine

    yield factory
    for engine in built:
        engine.close()
