"""Prometheus metrics of a real engine, scraped over HTTP from the metrics server."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_key
from tiercache.config.server import ServerConfig
from tiercache.engine import TieredEngine
from tiercache.engine.counters import INTEGRITY_PATHS
from tiercache.server.build import build_engine
from tiercache.server.metrics import MetricsServer, render


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[TieredEngine]:
    config = ServerConfig.load(
        {"l1.size_gb": "0.01", "disk.path": str(tmp_path / "disk"), "disk.size_gb": "0.01"}, {}
    )
    engine = build_engine(config)
    yield engine
    engine.close()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in an exposition, parsed by prometheus_client's own parser."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def test_a_scrape_shows_per_tier_usage_and_counters(engine: TieredEngine) -> None:
    for i in range(3):
        assert engine.put(make_key(i), b"x" * 4096)
    engine.flush(10)
    assert engine.get(make_key(0)) is not None
    with MetricsServer(engine.stats) as metrics:
        assert metrics.url.startswith("http://127.0.0.1:")
        text = scrape(metrics.url)
    assert sample(text, "tiercache_tier_bytes", tier="l1") == 3 * 4096
    assert sample(text, "tiercache_tier_bytes", tier="disk") == 3 * 4096
    assert sample(text, "tiercache_tier_objects", tier="disk") == 3
    assert sample(text, "tiercache_tier_budget_bytes", tier="l1") == engine.l1.usage().bytes_budget
    assert sample(text, "tiercache_tier_puts_total", tier="l1") == 3
    hits = engine.stats()["tiers"]["l1"]["hits"]  # type: ignore[index]
    assert sample(text, "tiercache_tier_hits_total", tier="l1") == hits >= 1
    assert sample(text, "tiercache_tier_written_bytes_total", tier="disk") == 3 * 4096
    assert "# TYPE tiercache_tier_hits_total counter" in text
    assert sample(text, "tiercache_engine_stores_total") == 3
    assert sample(text, "tiercache_engine_queue_depth", queue="l2") == 0


def test_evictions_are_counted_by_tier_and_reason() -> None:
    stats = {"engine": {}, "tiers": {"l1": {"evictions": {"capacity": 4, "expired": 1}}}}
    text = render(stats)
    assert sample(text, "tiercache_tier_evictions_total", tier="l1", reason="capacity") == 4
    assert sample(text, "tiercache_tier_evictions_total", tier="l1", reason="expired") == 1


def test_the_metrics_server_binds_to_loopback_by_default_and_stops_cleanly(engine: TieredEngine) -> None:
    metrics = MetricsServer(engine.stats)
    metrics.start()
    port = metrics.port
    metrics.stop()
    metrics.stop()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_latency_histograms_are_exported_with_cumulative_buckets_in_seconds() -> None:
    from tiercache.tier.latency import LatencySet

    lookups = LatencySet(("hit", "miss"))
    for seconds in (5e-6, 3e-3, 20.0):  # under the first bound, mid-range, over the last bound
        lookups.observe("hit", seconds)
    transfers = LatencySet(("read", "write"))
    transfers.observe("write", 2e-4)
    text = render({"latency": {"lookup": lookups.snapshot(), "tiers": {"disk": transfers.snapshot()}}})

    hist = "tiercache_lookup_duration_seconds"
    assert "# TYPE tiercache_lookup_duration_seconds histogram" in text
    assert sample(text, f"{hist}_bucket", outcome="hit", le="1e-05") == 1
    assert sample(text, f"{hist}_bucket", outcome="hit", le="0.005") == 2
    assert sample(text, f"{hist}_bucket", outcome="hit", le="10.0") == 2
    assert sample(text, f"{hist}_bucket", outcome="hit", le="+Inf") == 3
    assert sample(text, f"{hist}_sum", outcome="hit") == pytest.approx(20.003005)
    assert sample(text, f"{hist}_count", outcome="miss") == 0  # exported before the first one
    transfer = "tiercache_tier_transfer_duration_seconds"
    assert sample(text, f"{transfer}_bucket", tier="disk", op="write", le="0.00025") == 1
    assert sample(text, f"{transfer}_bucket", tier="disk", op="write", le="0.0001") == 0
    assert sample(text, f"{transfer}_count", tier="disk", op="read") == 0


def test_chunks_lost_on_write_back_are_one_counter_by_reason_exported_from_zero(engine: TieredEngine) -> None:
    """Exported before the first loss, so that an alert on it can be written ahead of time."""
    with MetricsServer(engine.stats) as metrics:
        text = scrape(metrics.url)
    lost = "tiercache_engine_writeback_lost_total"
    assert "# TYPE tiercache_engine_writeback_lost_total counter" in text
    assert sample(text, lost, reason="queue_full") == sample(text, lost, reason="write_failed") == 0

    text = render({"engine": {"writeback_lost_queue_full": 7, "writeback_lost_write_failed": 2}})
    assert sample(text, lost, reason="queue_full") == 7
    assert sample(text, lost, reason="write_failed") == 2
    assert "writeback_lost_queue_full_total" not in text  # not also as a counter of its own


def test_integrity_failures_are_one_counter_by_path_exported_from_zero(engine: TieredEngine) -> None:
    """Copies out of L1 that failed their object's digest, by where they were caught."""
    with MetricsServer(engine.stats) as metrics:
        text = scrape(metrics.url)
    failed = "tiercache_engine_integrity_failures_total"
    assert "# TYPE tiercache_engine_integrity_failures_total counter" in text
    assert all(sample(text, failed, path=path) == 0 for path in INTEGRITY_PATHS)
    text = render({"engine": {"integrity_failures_l1_read": 3, "integrity_failures_write_through": 1}})
    assert sample(text, failed, path="l1_read") == 3
    assert sample(text, failed, path="write_through") == 1
    assert "integrity_failures_l1_read_total" not in text
