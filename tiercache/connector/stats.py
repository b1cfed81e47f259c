"""The connector's statistics in vLLM's metrics: the periodic log line and Prometheus.

vLLM collects a :class:`KVConnectorStats` from every worker after each step
(``get_kv_connector_stats``), aggregates the scheduler's own on top (``SchedulerHalf`` records the
lookups), ships the plain ``data`` dict to its stat loggers and rebuilds the object there with
``TierCacheConnector.build_kv_connector_stats``. The logging logger aggregates the interval and
prints :meth:`TierCacheConnectorStats.reduce` as ``KV Transfer metrics: ...``; the Prometheus logger
hands each step's dict to :class:`TierCachePromMetrics`.

Every value in ``data`` is a count or a sum over the interval (plus three short lists of per-event
durations for the histograms), so aggregation is addition and the dict pickles and msgpacks as is.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# Plain counters (ints) and sums (floats), added on aggregation.
COUNTERS: tuple[str, ...] = (
    "lookups",  # lookups answered (one per request, again after a preemption)
    "lookups_deferred",  # of those, lookups whose request vLLM held back a step or more first
    "query_tokens",  # prompt tokens in the full chunks those lookups asked about
    "hit_tokens",  # tokens the cache could supply (the restorable, pinned prefix)
    "hit_chunks",
    "loaded_chunks",
    "loaded_bytes",
    "load_failures",  # chunks that could not be loaded (their blocks are recomputed)
    "lost_leases",  # of those, chunks copied under a lease that expired first (bytes not trusted)
    "corrupt_copies",  # objects whose copy out of the arena did not match their digest (not used)
    "stored_chunks",
    "stored_bytes",
    "store_skipped",  # chunks not stored: server down, full or busy, or a failed copy
    "server_unavailable",  # times a half found the server unreachable and went down
)
SUMS: tuple[str, ...] = ("load_seconds", "store_seconds")
# Per-event durations (one per step with loads, one per store batch), for the histograms
# (and one per lookup: from its send until the scheduler could answer vLLM about the request)
SERIES: tuple[str, ...] = ("load_durations", "store_durations", "lookup_durations")
# Objects of each hit, by the highest tier that held them when looked up ("l1", "disk", "s3"): the
# server's per-tier count for the restorable prefix it found (a hit cut short later, e.g. by a slow
# promotion, still counts that prefix's objects).
BY_TIER = "hit_objects_by_tier"

GB = 1e9


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in COUNTERS}
    data.update({k: 0.0 for k in SUMS})
    data.update({k: [] for k in SERIES})
    data[BY_TIER] = {}
    return data


@dataclass
class TierCacheConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM is untyped: its base is Any
    """tiercache's counters for one interval (see the module docstring for the flow)."""

    def __post_init__(self) -> None:
        # vLLM rebuilds stats from a possibly partial dict (or none): fill in every key.
        filled = _empty()
        for key, value in (self.data or {}).items():
            filled[key] = value
        self.data: dict[str, Any] = filled

    def reset(self) -> None:
        self.data = _empty()

    def add(self, key: str, amount: float = 1) -> None:
        """Add ``amount`` to a counter or sum, or append it to a duration series."""
        if key in SERIES:
            self.data[key].append(float(amount))
        else:
            self.data[key] += amount

    def add_tiers(self, per_tier: dict[str, int]) -> None:
        by_tier = self.data[BY_TIER]
        for tier, n in per_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + int(n)

    def is_empty(self) -> bool:
        d = self.data
        return (
            not any(d[k] for k in COUNTERS) and not any(d[k] for k in SUMS) and not any(d[BY_TIER].values())
        )

    def aggregate(self, other: KVConnectorStats) -> TierCacheConnectorStats:
        """Add ``other``'s interval into this one (in place, as vLLM's loggers expect)."""
        od = other.data
        for key in COUNTERS + SUMS:
            self.data[key] += od.get(key, 0)
        for key in SERIES:
            self.data[key].extend(od.get(key, ()))
        self.add_tiers(od.get(BY_TIER, {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval as one readable summary: hit rate, per-tier share, throughput, failures."""
        d = self.data
        out: dict[str, int | float] = {
            "Lookups": d["lookups"],
            "Hit rate (%)": round(100.0 * d["hit_tokens"] / d["query_tokens"], 1)
            if d["query_tokens"]
            else 0.0,
            "Hit tokens": d["hit_tokens"],
            "Lookups deferred": d["lookups_deferred"],
        }
        total_objects = sum(d[BY_TIER].values())
        for tier in sorted(d[BY_TIER]):
            out[f"Hits from {tier} (%)"] = round(100.0 * d[BY_TIER][tier] / total_objects, 1)
        out["Loaded chunks"] = d["loaded_chunks"]
        out["Load GB/s"] = round(d["loaded_bytes"] / GB / d["load_seconds"], 3) if d["load_seconds"] else 0.0
        out["Load failures"] = d["load_failures"]
        out["Lost leases"] = d["lost_leases"]
        out["Corrupt copies"] = d["corrupt_copies"]
        out["Stored chunks"] = d["stored_chunks"]
        out["Store GB/s"] = (
            round(d["stored_bytes"] / GB / d["store_seconds"], 3) if d["store_seconds"] else 0.0
        )
        out["Skipped stores"] = d["store_skipped"]
        out["Server unavailable"] = d["server_unavailable"]
        return out

    def clone_and_reset(self) -> TierCacheConnectorStats | None:
        """This interval's stats (``None`` if nothing happened), leaving this object empty."""
        if self.is_empty():
            return None
        old = TierCacheConnectorStats(data=self.data)
        self.reset()
        return old


class StatsRecorder:
    """Thread-safe recording into a :class:`TierCacheConnectorStats` (the worker's store thread
    records while the model-runner thread takes the interval)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TierCacheConnectorStats()

    def add(self, key: str, amount: float = 1) -> None:
        with self._lock:
            self._stats.add(key, amount)

    def add_tiers(self, per_tier: dict[str, int]) -> None:
        with self._lock:
            self._stats.add_tiers(per_tier)

    def take(self) -> TierCacheConnectorStats | None:
        """The stats since the last call, or ``None`` when there are none."""
        with self._lock:
            return self._stats.clone_and_reset()


def build_stats(data: dict[str, Any] | None) -> TierCacheConnectorStats:
    # A deep copy: vLLM gives the same dict to every stat logger, and the logging logger's
    # in-place aggregation must not change what the Prometheus logger records.
    return TierCacheConnectorStats(data=copy.deepcopy(data) if data else {})


# Prometheus: counters are exported with a ``_total`` suffix by prometheus_client.
COUNTER_METRICS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:tiercache_lookups", "tiercache lookups answered"),
    "lookups_deferred": (
        "vllm:tiercache_lookups_deferred",
        "tiercache lookups whose request vLLM held back a step or more before the answer (a promotion, "
        "a late reply)",
    ),
    "query_tokens": ("vllm:tiercache_query_tokens", "Prompt tokens (in full chunks) looked up in tiercache"),
    "hit_tokens": ("vllm:tiercache_hit_tokens", "Prompt tokens tiercache could supply"),
    "hit_chunks": ("vllm:tiercache_hit_chunks", "Chunks tiercache could supply"),
    "loaded_chunks": ("vllm:tiercache_loaded_chunks", "Chunks loaded from tiercache into the KV cache"),
    "loaded_bytes": ("vllm:tiercache_loaded_bytes", "Bytes loaded from tiercache into the KV cache"),
    "load_failures": ("vllm:tiercache_load_failures", "Chunks that failed to load (recomputed by vLLM)"),
    "lost_leases": (
        "vllm:tiercache_lost_leases",
        "Chunks whose lease expired before their copy was done (reported failed, recomputed by vLLM)",
    ),
    "corrupt_copies": (
        "vllm:tiercache_corrupt_copies",
        "Objects copied out of the L1 arena that did not match their digest (another process wrote into "
        "their slots); their chunks failed to load and were recomputed",
    ),
    "stored_chunks": ("vllm:tiercache_stored_chunks", "Chunks stored into tiercache"),
    "stored_bytes": ("vllm:tiercache_stored_bytes", "Bytes stored into tiercache"),
    "store_skipped": ("vllm:tiercache_store_skipped", "Chunks not stored (server down, full or busy)"),
    "server_unavailable": (
        "vllm:tiercache_server_unavailable",
        "Times the tiercache server became unreachable",
    ),
}
HIST_METRICS: dict[str, tuple[str, str]] = {
    "load_durations": ("vllm:tiercache_load_seconds", "Time per step spent loading chunks from tiercache"),
    "store_durations": ("vllm:tiercache_store_seconds", "Time per batch spent storing chunks into tiercache"),
    "lookup_durations": (
        "vllm:tiercache_lookup_seconds",
        "Time from a request's tiercache lookup until the scheduler could answer vLLM about it",
    ),
}
TIER_METRIC = ("vllm:tiercache_hit_objects", "Objects of tiercache hits, by the tier that held them")
DURATION_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class TierCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vLLM is untyped: its base is Any
    """Registers the ``vllm:tiercache_*`` counters and histograms, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in COUNTER_METRICS.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = self._per_engine(metric)
        self._histograms: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in HIST_METRICS.items():
            metric = self._histogram_cls(
                name=name, documentation=doc, buckets=DURATION_BUCKETS, labelnames=labelnames
            )
            self._histograms[key] = self._per_engine(metric)
        # The tiers are the server's ("l1", "disk", "s3"): children are made as tiers show up.
        self._by_tier = self._counter_cls(
            name=TIER_METRIC[0], documentation=TIER_METRIC[1], labelnames=[*labelnames, "tier"]
        )

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, children in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                children[engine_idx].inc(value)
        for key, children in self._histograms.items():
            for seconds in transfer_stats_data.get(key, ()):
                children[engine_idx].observe(seconds)
        labels = self.per_engine_labelvalues[engine_idx]
        for tier, n in transfer_stats_data.get(BY_TIER, {}).items():
            if n:
                self._by_tier.labels(*labels, tier).inc(n)
