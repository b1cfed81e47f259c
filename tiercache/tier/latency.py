"""Latency histograms without dependencies: tiers, the engine and the server record, metrics export.

A :class:`LatencyHistogram` counts observations in fixed buckets (:data:`BUCKETS_S`, 10 µs … 10 s) and
hands out plain-data :meth:`~LatencyHistogram.snapshot`\\ s, the way :class:`~tiercache.tier.Counters`
does for counters. :mod:`tiercache.server.metrics` turns those snapshots into Prometheus histograms at scrape
time, so nothing that records a latency imports ``prometheus_client`` (dependencies point one way:
tiers → this module ← metrics).

Cost on the hot path: the caller's ``time.perf_counter()`` pair, one ``bisect`` over 19 bounds and one
uncontended lock round trip (about 0.3 µs in all).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import TypedDict

#: Upper bounds (seconds, inclusive like Prometheus' ``le``) from an L1 commit (µs) to an S3 get (s).
BUCKETS_S: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class HistogramSnapshot(TypedDict):
    """A histogram as plain data: ``counts[i]`` observations fell in ``(bounds[i-1], bounds[i]]``;
    the last count is above every bound (``+Inf``). Not cumulative."""

    bounds: list[float]
    counts: list[int]
    sum: float
    count: int


class LatencyHistogram:
    """Thread-safe counts of durations (seconds) in :data:`BUCKETS_S`."""

    __slots__ = ("_counts", "_lock", "_sum")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(BUCKETS_S) + 1)  # guarded by _lock; last: above every bound
        self._sum = 0.0

    def observe(self, seconds: float, count: int = 1) -> None:
        """Count ``count`` durations of ``seconds`` each (one batched call's share per item)."""
        i = bisect_left(BUCKETS_S, seconds)  # outside the lock: the bounds never change
        with self._lock:
            self._counts[i] += count
            self._sum += seconds * count

    def snapshot(self) -> HistogramSnapshot:
        """A consistent copy (msgpack/JSON friendly)."""
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        return {"bounds": list(BUCKETS_S), "counts": counts, "sum": total, "count": sum(counts)}


class LatencySet:
    """Histograms by name, all created up front (so every label set is exported, zero or not)."""

    __slots__ = ("_by_name",)

    def __init__(self, names: tuple[str, ...]) -> None:
        self._by_name = {name: LatencyHistogram() for name in names}

    def observe(self, name: str, seconds: float, count: int = 1) -> None:
        """Count ``count`` durations of ``seconds`` under ``name`` (one of the names given at
        construction)."""
        self._by_name[name].observe(seconds, count)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        """Every histogram's snapshot by name."""
        return {name: h.snapshot() for name, h in self._by_name.items()}
