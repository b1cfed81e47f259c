"""Scenario: S3 stopped, slow (brown-out) and answering 503 SlowDown / 500 mid-run, at the server level.

A real server process (tiers l1, disk, s3) talks to moto through two proxies the test controls: a TCP
proxy that can be stopped (endpoint down) and an HTTP proxy that can delay or answer 503/500. For each
fault the test keeps storing and loading through a client, then heals S3 and measures recovery.

Invariants: every load of a chunk held by L1/L2 is a hit with the right bytes during the fault; no
client call times out (the server never stalls on S3); S3-only chunks are misses during the fault and
hits again after it; S3 errors, skips and failed write-throughs are counted; service recovers by itself.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.conftest import S3Endpoint
from tests.l3_s3.helpers import StoppableProxy
from tests.reliability.common import FaultyS3Proxy, figures, payload
from tests.server.conftest import StartServer, manifest
from tiercache.client.client import Client
from tiercache.config import S3Config
from tiercache.keys import ObjectKey, chunk_hashes
from tiercache.keys.fingerprint import Fingerprint
from tiercache.l3_s3 import S3Tier
from tiercache.testing.poll import wait_until
from tiercache.wire.protocol import GroupRef, TicketStateName

KiB = 1 << 10
MiB = 1 << 20
CHUNK_BYTES = 16 * KiB
CHUNKS = 4
BUCKET = "tiercache-reliability"


def hashes_of(seed: int) -> list[bytes]:
    return chunk_hashes([(seed * 7919 + i) % 32000 for i in range(CHUNKS * 256)], 256)


def keys_of(group: GroupRef, seed: int) -> list[ObjectKey]:
    return [ObjectKey(Fingerprint(group.fingerprint), group.object_group, h) for h in hashes_of(seed)]


class Driver:
    """Stores and loads prompts through one client, checking every byte and timing every call."""

    def __init__(self, client: Client, group: GroupRef) -> None:
        self.client, self.group = client, group
        self.ops = self.wrong = 0
        self.max_call_s = 0.0

    def _timed(self, fn, *args, **kw):  # type: ignore[no-untyped-def]
        start = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            self.ops += 1
            self.max_call_s = max(self.max_call_s, time.monotonic() - start)

    def store(self, seed: int) -> None:
        keys = keys_of(self.group, seed)
        self._timed(self.client.store_chunks, keys, [payload(k, CHUNK_BYTES) for k in keys])

    def load(self, seed: int) -> int:
        """Look up and read a prompt; returns the chunks restored (each checked)."""
        found = self._timed(self.client.lookup, hashes_of(seed), [self.group])
        if found.pending:
            found = self._timed(self.client.wait_ticket, found.ticket)
        if found.state is not TicketStateName.READY:
            if found.state is TicketStateName.PENDING:
                self.client.release_ticket(found.ticket)
            return 0
        data = self.client.read_ticket(found)
        self.wrong += sum(1 for k, v in data.items() if v != payload(k, CHUNK_BYTES))
        return found.ready_chunks


def test_s3_outage_brownout_and_5xx_keep_serving_and_recover(
    start_server: StartServer, s3: S3Endpoint, tmp_path: Path
) -> None:
    fp = manifest().fingerprint()
    cold_group = GroupRef(fp.raw, 0)
    phases = [
        ("s3 stopped", "down"),
        ("s3 slow 3 s", "slow"),
        ("503 SlowDown", "slowdown"),
        ("500 errors", "error"),
    ]
    # Prompts that exist only on S3 (another node wrote them): one to miss during each fault and
    # be read after it.
    writer = S3Tier(
        S3Config(bucket=BUCKET, endpoint_url=s3.url, region="us-east-1", path_style=True, create_bucket=True)
    )
    for p in range(len(phases)):
        for key in keys_of(cold_group, 1000 + p):
            writer.put(key, payload(key, CHUNK_BYTES))
    writer.close()

    http_proxy = FaultyS3Proxy(s3.url)
    tcp_proxy = StoppableProxy(*http_proxy.url.removeprefix("http://").split(":"))  # type: ignore[arg-type]
    tcp_proxy._target = ("127.0.0.1", int(http_proxy.url.rsplit(":", 1)[1]))
    cooldown = 1.0
    server = start_server(
        l1_bytes=2 * MiB,
        disk_path=str(tmp_path / "disk"),
        s3_url=tcp_proxy.url,
        s3_bucket=BUCKET,
        s3_options=dict(
            connect_timeout_s=0.5,
            read_timeout_s=1.0,
            max_attempts=1,
            breaker_failures=3,
            breaker_cooldown_s=cooldown,
            missing_ttl_s=0.2,
        ),
    )
    rows = []
    try:
        with server.client(timeout=10.0) as client:
            [group] = client.register([(0, manifest())])
            assert group.fingerprint == cold_group.fingerprint
            d = Driver(client, group)
            seed = 0
            for _ in range(4):  # healthy warm-up
                d.store(seed)
                seed += 1
            wait_until(
                lambda: client.stats()["engine"]["l3_writes"] >= 4 * CHUNKS,
                timeout=30,
                what="warm-up write-through to S3",
            )

            for p, (label, mode) in enumerate(phases):
                before = client.stats()
                faults_before = http_proxy.faults
                if mode == "down":
                    tcp_proxy.stop()
                else:
                    http_proxy.delay_s = 3.0
                    http_proxy.mode = mode
                d.max_call_s = 0.0
                ops_before = d.ops
                warm_hits = cold_hits = 0
                for _ in range(6):
                    d.store(seed)
                    seed += 1
                    warm_hits += d.load(seed - 1)  # just written (L1)
                    warm_hits += d.load(seed // 2)  # older: L1 or promoted from disk
                    cold_hits += d.load(1000 + p)  # only on S3: must miss (never a wrong read)
                during_max = d.max_call_s
                during = client.stats()

                # Heal, and measure until both directions work again: S3-only chunks are hits, and
                # a new store is written through to S3.
                if mode == "down":
                    tcp_proxy.start()
                http_proxy.mode = "ok"
                healed = time.monotonic()
                d.store(seed)
                seed += 1
                writes_at_heal = client.stats()["engine"]["l3_writes"]
                while not (
                    d.load(1000 + p) == CHUNKS and client.stats()["engine"]["l3_writes"] > writes_at_heal
                ):
                    assert time.monotonic() - healed < 30, f"no recovery 30 s after {label}"
                    d.store(seed)  # keep writing: the first writes may still meet an open breaker
                    seed += 1
                    time.sleep(0.1)
                recovery_s = time.monotonic() - healed
                after = client.stats()
                s3b, s3a = before["tiers"]["s3"], after["tiers"]["s3"]
                row = dict(
                    ops=d.ops - ops_before,
                    http_faults=http_proxy.faults - faults_before if mode != "down" else "refused",
                    s3_errors=s3a["errors"] - s3b["errors"],
                    s3_skipped=s3a.get("skipped", 0) - s3b.get("skipped", 0),
                    write_failures=after["engine"]["write_failures"] - before["engine"]["write_failures"],
                    warm_chunks_hit=warm_hits,
                    cold_chunks_hit=cold_hits,
                    wrong_reads=d.wrong,
                    max_call_s=during_max,
                    recovery_s=recovery_s,
                )
                figures(f"s3-outage[{label}]", **row)
                rows.append(row)
                assert d.wrong == 0
                assert warm_hits == 6 * 2 * CHUNKS  # L1/L2 kept serving every chunk they hold
                assert cold_hits == 0
                # The fault was seen and counted while it lasted (an operator watching the metrics
                # during the outage sees it), not only once S3 answered again.
                assert during["tiers"]["s3"]["errors"] > s3b["errors"], label
                assert row["s3_errors"] > 0

            # No write-through is lost silently: every chunk that reached the disk either reached S3
            # or is counted as a failed (or skipped) write or a queue drop.
            def accounted() -> bool:
                e = client.stats()["engine"]
                return e["l3_writes"] + e["write_failures"] + e["l3_queue_drops"] == e["l2_writes"]

            wait_until(accounted, timeout=30, what="every write-through accounted for")
            e = client.stats()["engine"]
            figures(
                "s3-outage[total]",
                l2_writes=e["l2_writes"],
                l3_writes=e["l3_writes"],
                write_failures=e["write_failures"],
                l3_queue_drops=e["l3_queue_drops"],
            )
            assert e["write_failures"] > 0
    finally:
        tcp_proxy.stop()
        http_proxy.close()


def test_writes_skipped_by_an_open_breaker_are_counted_without_a_warning_each(caplog) -> None:  # type: ignore[no-untyped-def]
    """During an outage every write-through meets the open breaker; one warning per chunk would flood
    the log at the write rate. Skips are counted (``write_failures``) and logged at debug only."""
    import logging
    import random

    from tests.conftest import make_key
    from tiercache.config import L1Config
    from tiercache.engine import TieredEngine
    from tiercache.errors import CircuitOpenError
    from tiercache.l1.tier import L1Tier
    from tiercache.tier.wrappers import WrapperTier

    class OpenBreaker(WrapperTier):
        def put(self, key, data, **how):  # type: ignore[no-untyped-def]
            raise CircuitOpenError("S3 failed 3 times in a row; PUT skipped")

    inner = L1Tier(L1Config(size_bytes=4 * MiB, name=f"tc-rel-s3-{random.getrandbits(40):x}"))
    engine = TieredEngine(
        L1Tier(L1Config(size_bytes=4 * MiB, name=f"tc-rel-{random.getrandbits(40):x}")), [OpenBreaker(inner)]
    )
    with caplog.at_level(logging.DEBUG, logger="tiercache.engine"), engine:
        for i in range(50):
            assert engine.put(make_key(i), b"x" * 1024)
        assert engine.flush(10)
        assert engine.counters.snapshot()["write_failures"] == 50
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 50


def test_an_s3_answering_after_40_s_does_not_hold_lookups_of_chunks_on_disk(
    start_server: StartServer, s3: S3Endpoint, tmp_path: Path
) -> None:
    # Every S3 setting at its default. Four clients keep asking for new prompts (each lookup asks
    # S3 for what L1 and disk lack, as nearly every new prompt does); S3 answers each request after
    # 40 s. A fifth client's lookups of prompts wholly on disk must each be answered within the
    # connector's lookup timeout (2 s): S3's questions run on workers of their own, a lookup waits
    # for them at most --remote-lookup-budget-s, and HEADs that time out open the breaker.
    connector_timeout_s = 2.0
    proxy = FaultyS3Proxy(s3.url)
    server = start_server(
        l1_bytes=1 * MiB,
        disk_path=str(tmp_path / "disk"),
        s3_url=proxy.url,
        s3_bucket=BUCKET,
    )
    stop = threading.Event()
    try:
        with server.client(timeout=10.0) as client:
            [group] = client.register([(0, manifest())])
            # 3 MiB of prompts through a 1 MiB L1: the first 16 stored are on disk only.
            stored = list(range(48))
            on_disk = stored[:16]
            for seed in stored:
                keys = keys_of(group, seed)
                client.store_chunks(keys, [payload(k, CHUNK_BYTES) for k in keys])
            wait_until(
                lambda: client.stats()["engine"]["l2_writes"] >= len(stored) * CHUNKS,
                timeout=30,
                what="every prompt written through to disk",
            )
            wait_until(
                lambda: client.stats()["engine"]["l3_writes"] >= len(stored) * CHUNKS,
                timeout=30,
                what="every prompt written through to S3 (no write left to hang)",
            )
            proxy.mode, proxy.delay_s = "slow", 40.0

            def new_prompts(worker: int) -> None:
                with server.client(timeout=10.0) as other:
                    seed = 100_000 * (worker + 1)
                    while not stop.is_set():
                        other.lookup(hashes_of(seed), [group], prefetch=False)
                        seed += 1

            askers = [threading.Thread(target=new_prompts, args=(w,), daemon=True) for w in range(4)]
            for t in askers:
                t.start()
            wait_until(lambda: proxy.faults >= 1, timeout=10, what="a lookup asking the slow S3")
            took: list[float] = []
            disk_hits = 0
            with server.client(timeout=connector_timeout_s) as measured:
                for i in range(60):
                    seed = on_disk[i % len(on_disk)]
                    start = time.monotonic()
                    found = measured.lookup(hashes_of(seed), [group], prefetch=False)
                    took.append(time.monotonic() - start)
                    assert found.chunks == CHUNKS
                    disk_hits += found.per_tier.get("disk", 0) == CHUNKS
            stop.set()
            for t in askers:
                t.join(timeout=10)
            engine = client.stats()["engine"]
            took.sort()
            figures(
                "s3-answering-after-40s",
                disk_lookups=len(took),
                of_them_from_disk=disk_hits,
                p50_ms=1e3 * took[len(took) // 2],
                p99_ms=1e3 * took[int(0.99 * (len(took) - 1))],
                max_ms=1e3 * took[-1],
                remote_lookups_late=engine["remote_lookups_late"],
                remote_lookups_busy=engine["remote_lookups_busy"],
                s3_requests_held=proxy.faults,
            )
            assert disk_hits == len(took)  # the lookups measured are the disk's, not L1's
            assert took[-1] < connector_timeout_s
            assert engine["remote_lookups_late"] > 0  # the budget was what answered them
    finally:
        stop.set()
        proxy.close()
