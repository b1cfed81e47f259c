"""Specification, on a real object store only: a running tiercache server (L1, disk, S3 on Ceph's RADOS
Gateway) whose radosgw process stops and comes back (not a proxy: the gateway goes away with its
sockets and returns with the cluster's data).

While it is down the server keeps serving what L1 and the disk hold, every byte right, and keeps
storing into them; the S3 writes it cannot make are counted, not fatal. Once the gateway is back the
breaker lets writes through again, and a fresh node on the same bucket reads back every chunk
written to S3 before the outage: nothing committed was lost.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tests.conftest import S3Endpoint
from tests.reliability.test_s3_outage import CHUNKS, Driver, MiB
from tests.server.conftest import StartServer, manifest
from tests.server.serverproc import ServerProcess
from tiercache.testing.poll import wait_until

BUCKET = "tiercache-rgw-outage"
BEFORE, DURING = range(0, 4), range(4, 8)  # the seeds of the prompts stored before and during the outage


def test_a_server_whose_radosgw_stops_and_returns_keeps_serving_and_loses_nothing_committed(
    start_server: StartServer, rgw_server: S3Endpoint, tmp_path: Path
) -> None:
    rgw_server.reset()
    cluster = rgw_server.cluster
    assert cluster is not None

    def start_node(disk: str) -> ServerProcess:
        """A node with its own L1 and disk directory ``disk`` on the one bucket, short S3 timeouts."""
        return start_server(
            l1_bytes=8 * MiB,
            disk_path=str(tmp_path / disk),
            s3_url=rgw_server.url,
            s3_bucket=BUCKET,
            s3_options=dict(
                connect_timeout_s=0.5,
                read_timeout_s=1.0,
                max_attempts=1,
                breaker_failures=3,
                breaker_cooldown_s=1.0,
                missing_ttl_s=0.2,
            ),
        )

    node = start_node("disk")
    with node.client(timeout=10.0) as client:
        [group] = client.register([(0, manifest())])
        d = Driver(client, group)
        for seed in BEFORE:
            d.store(seed)
        wait_until(
            lambda: client.stats()["engine"]["l3_writes"] >= len(BEFORE) * CHUNKS,
            timeout=30,
            what="the first prompts written through to RGW",
        )

        cluster.stop_gateway()
        try:
            failures_before = client.stats()["engine"]["write_failures"]
            for seed in DURING:
                d.store(seed)
            # Served from L1 and the disk meanwhile, every byte checked by the driver.
            assert [d.load(seed) for seed in (*BEFORE, *DURING)] == [CHUNKS] * (len(BEFORE) + len(DURING))
            client.ping()
            wait_until(
                lambda: client.stats()["engine"]["write_failures"] > failures_before,
                timeout=30,
                what="the S3 writes refused by the stopped gateway to be counted",
            )
        finally:
            cluster.start_gateway()

        # After the breaker's cool-down a write is let through and closes it again.
        written = client.stats()["engine"]["l3_writes"]
        seeds = itertools.count(1000)  # a new prompt each try: one already stored is not written again

        def stored_after_the_outage() -> bool:
            d.store(next(seeds))
            return bool(client.stats()["engine"]["l3_writes"] > written)

        wait_until(stored_after_the_outage, timeout=60, interval=1.0, what="S3 writes to resume")
        assert d.wrong == 0
        stats = client.stats()
    print(
        f"\n[rgw outage] write failures {stats['engine']['write_failures']}, l3 writes "
        f"{stats['engine']['l3_writes']}, server errors {stats['server']['errors']}"
    )

    # A fresh node on the same bucket (empty L1, empty disk) finds every chunk written before the outage.
    fresh = start_node("fresh-disk")
    with fresh.client(timeout=10.0) as client:
        [group] = client.register([(0, manifest())])
        d = Driver(client, group)
        assert [d.load(seed) for seed in BEFORE] == [CHUNKS] * len(BEFORE)
        assert d.wrong == 0
        assert client.stats()["tiers"]["s3"]["hits"] >= len(BEFORE) * CHUNKS
