"""Specification, on a real object store only: radosgw itself stopped and started again under a running
tier (not a proxy: the gateway process goes away and comes back with the cluster's data). Reads miss
while it is down, never wrong bytes; the breaker lets a trial through after the cool-down, and what
was stored before the outage is read back equal."""

from __future__ import annotations

from tests.conftest import FakeClock, S3Endpoint, make_key, payload_for
from tests.l3_s3.helpers import make_s3_tier
from tiercache.l3_s3 import BreakerState

CHUNK = 4096


def test_radosgw_stopped_and_restarted_mid_run_loses_nothing_stored(
    rgw_server: S3Endpoint, clock: FakeClock
) -> None:
    rgw_server.reset()
    cluster = rgw_server.cluster
    assert cluster is not None
    keys = [make_key(i) for i in range(20)]
    with make_s3_tier(rgw_server, clock, breaker_failures=3, breaker_cooldown_s=30) as tier:
        for key in keys:
            tier.put(key, payload_for(key, CHUNK))
        cluster.stop_gateway()
        try:
            assert [tier.get(key) for key in keys[:5]] == [None] * 5
            assert tier.breaker_state is BreakerState.OPEN
            assert tier.stats.snapshot()["errors"] == 3
        finally:
            cluster.start_gateway()
        clock.advance(30)
        assert [tier.get(key) for key in keys] == [payload_for(key, CHUNK) for key in keys]
        assert tier.breaker_state is BreakerState.CLOSED
        tier.put(make_key(99), b"after")
        assert tier.get(make_key(99)) == b"after"
