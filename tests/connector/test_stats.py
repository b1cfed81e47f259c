"""``TierCacheConnectorStats`` and ``TierCachePromMetrics`` on their own (needs vLLM, no engine).

``test_load_failure.py`` shows the same stats flowing through a real engine into vLLM's log line and
Prometheus metrics.
"""

from __future__ import annotations

import pickle
import threading
from functools import partial
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tiercache.connector.stats import (
    COUNTER_METRICS,
    StatsRecorder,
    TierCacheConnectorStats,
    TierCachePromMetrics,
    build_stats,
)


def interval(**values: float) -> TierCacheConnectorStats:
    s = TierCacheConnectorStats()
    for key, value in values.items():
        s.add(key, value)
    return s


def test_a_new_interval_is_empty_and_any_count_makes_it_non_empty() -> None:
    assert TierCacheConnectorStats().is_empty()
    assert not interval(lookups=1).is_empty()
    s = TierCacheConnectorStats()
    s.add_tiers({"disk": 2})
    assert not s.is_empty()


def test_aggregate_adds_counts_sums_series_and_tiers() -> None:
    a = interval(lookups=2, hit_tokens=128, load_seconds=0.5, load_durations=0.5)
    a.add_tiers({"l1": 1})
    b = interval(lookups=1, hit_tokens=64, load_seconds=0.25, load_durations=0.25, load_failures=1)
    b.add_tiers({"l1": 2, "s3": 1})
    out = a.aggregate(b)
    assert out is a  # in place, as vLLM's loggers expect
    assert (a.data["lookups"], a.data["hit_tokens"], a.data["load_failures"]) == (3, 192, 1)
    assert a.data["load_seconds"] == 0.75 and a.data["load_durations"] == [0.5, 0.25]
    assert a.data["hit_objects_by_tier"] == {"l1": 3, "s3": 1}


def test_reduce_gives_hit_rate_tier_shares_and_throughput() -> None:
    s = interval(
        lookups=4,
        lookups_deferred=1,
        query_tokens=1024,
        hit_tokens=768,
        loaded_chunks=12,
        loaded_bytes=2e9,
        load_seconds=1.0,
        load_failures=1,
        stored_chunks=4,
        stored_bytes=1e9,
        store_seconds=0.5,
        store_skipped=2,
        server_unavailable=1,
    )
    s.add_tiers({"l1": 3, "disk": 1})
    r = s.reduce()
    assert r["Lookups"] == 4 and r["Hit rate (%)"] == 75.0 and r["Hit tokens"] == 768
    assert r["Lookups deferred"] == 1
    assert r["Hits from l1 (%)"] == 75.0 and r["Hits from disk (%)"] == 25.0
    assert r["Load GB/s"] == 2.0 and r["Store GB/s"] == 2.0
    assert (r["Load failures"], r["Skipped stores"], r["Server unavailable"]) == (1, 2, 1)


def test_reduce_of_an_interval_without_lookups_or_transfers_divides_by_nothing() -> None:
    r = interval(server_unavailable=1).reduce()
    assert r["Hit rate (%)"] == 0.0 and r["Load GB/s"] == 0.0 and r["Store GB/s"] == 0.0


def test_the_payload_survives_pickle_and_msgpack_and_rebuilds_equal() -> None:
    s = interval(lookups=1, hit_chunks=2, load_seconds=0.1, store_durations=0.2)
    s.add_tiers({"disk": 2})
    for wire in (
        pickle.loads(pickle.dumps(s)).to_dict(),
        msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict())),
    ):
        assert build_stats(wire).data == s.data


def test_build_copies_so_one_logger_aggregating_does_not_change_anothers_payload() -> None:
    payload = interval(lookups=1, load_durations=0.1).to_dict()
    built = build_stats(payload)
    built.aggregate(interval(lookups=5, load_durations=0.2))
    assert payload["lookups"] == 1 and payload["load_durations"] == [0.1]


def test_build_fills_in_keys_missing_from_an_older_payload() -> None:
    assert build_stats({"lookups": 3}).reduce()["Lookups"] == 3
    assert build_stats(None).is_empty()


def test_recorder_hands_out_each_interval_once() -> None:
    rec = StatsRecorder()
    assert rec.take() is None
    threads = [
        threading.Thread(target=lambda: [rec.add("stored_chunks") for _ in range(1000)]) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = rec.take()
    assert first is not None and first.data["stored_chunks"] == 4000
    assert rec.take() is None


def test_prom_metrics_register_conventional_names_per_engine_and_record() -> None:
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = TierCachePromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    s = interval(lookups=2, hit_tokens=128, loaded_bytes=4096, load_durations=0.01, store_durations=0.02)
    s.add("lookups_deferred")
    s.add("lookup_durations", 0.3)
    s.add_tiers({"l1": 1, "s3": 1})
    prom.observe(s.to_dict(), engine_idx=1)
    prom.observe(interval(lookups=1).to_dict(), engine_idx=1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "1", **labels})

    assert value("vllm:tiercache_lookups_total") == 3
    assert value("vllm:tiercache_hit_tokens_total") == 128
    assert value("vllm:tiercache_loaded_bytes_total") == 4096
    assert (
        value("vllm:tiercache_load_seconds_count") == 1 and value("vllm:tiercache_store_seconds_count") == 1
    )
    assert value("vllm:tiercache_hit_objects_total", tier="s3") == 1
    assert value("vllm:tiercache_lookups_deferred_total") == 1
    assert value("vllm:tiercache_lookup_seconds_count") == 1
    assert value("vllm:tiercache_lookup_seconds_bucket", le="0.25") == 0  # 0.3 s: a promotion's wait
    assert value("vllm:tiercache_lookup_seconds_bucket", le="0.5") == 1
    assert registry.get_sample_value("vllm:tiercache_lookups_total", {"model_name": "m", "engine": "0"}) == 0
    assert all(name.startswith("vllm:tiercache_") for name, _ in COUNTER_METRICS.values())
