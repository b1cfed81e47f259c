"""Prometheus metrics for a running engine: a collector over ``engine.stats()`` and a small HTTP server.

Names follow Prometheus conventions (base units, ``_total`` for counters, one metric per quantity
with the tier as a label)::

    tiercache_tier_bytes{tier="l1"}                      bytes held now            (gauge)
    tiercache_tier_budget_bytes{tier="l1"}               byte budget               (gauge)
    tiercache_tier_objects{tier="l1"}                    objects held now          (gauge)
    tiercache_tier_hits_total{tier="disk"}               and misses, puts, errors, skipped,
                                                         verify_failures, expired_reservations,
                                                         expired_leases            (counters)
    tiercache_tier_written_bytes_total{tier="s3"}        and read_bytes            (counters)
    tiercache_tier_evictions_total{tier="l1",reason="capacity"}                    (counter)
    tiercache_engine_lookups_total                       one per engine counter    (counters)
    tiercache_engine_queue_depth{queue="l2"}             write-through backlog     (gauge)
    tiercache_engine_writeback_lost_total{reason="queue_full"}
                                                         chunks the disk evicted that never
                                                         reached S3 (write-back), so in no tier;
                                                         reason queue_full/write_failed/shutdown
                                                         (counter)
    tiercache_engine_integrity_failures_total{path="l1_read"}
                                                         copies out of L1 that did not match their
                                                         object's digest, by where caught (counter)
    tiercache_tier_quarantine_bytes{tier="l1"}           slots kept out of use after their writer
                                                         went silent (gauge); quarantined_total and
                                                         quarantine_{writer_done,timed_out,overflow}_total
                                                         count them (counters)
    tiercache_engine_l3_admitted_total                   chunks the L3 admission rule handed to S3
                                                         (counter)
    tiercache_engine_l3_refused_total{reason="unread"}   chunks it kept from S3, by reason
                                                         unread/untracked          (counter)
    tiercache_engine_l3_admission_waiting                stored chunks waiting for a first read
                                                         (--l3-admission read)     (gauge)
    tiercache_lookup_duration_seconds{outcome="hit"}     lookup arrival to reply sent, by
                                                         outcome hit/miss/error    (histogram)
    tiercache_tier_transfer_duration_seconds{tier="disk",op="read"}
                                                         seconds per chunk object read/written
                                                         (histogram)
    tiercache_tenant_bytes{tenant="…",tier="l1"}         and tenant_objects, tenant_quota_bytes
                                                         (gauges), tenant_evictions_total,
                                                         tenant_puts_total (counters)
    tiercache_tenant_lookups_total{tenant="…"}           lookups by the tenant         (counter)
    tiercache_tenant_lookup_chunks_total{tenant="…",outcome="hit"}
                                                         chunks asked about, found (hit) or not
                                                         (miss)                        (counter)

Tenants are labelled by id (``tiercache tenant-id``), never by salt; the server names at most
``--metrics-tenants`` of them and sums the rest under ``tenant="other"``
(:func:`tiercache.server.tenants.top`).

Histograms come from a ``"latency"`` section of the stats (:meth:`Server.metrics_stats
<tiercache.server.app.Server.metrics_stats>`): plain bucket counts recorded by
:mod:`tiercache.tier.latency`, so the engine, tiers and server never import prometheus_client.

The collector reads ``stats()`` at scrape time, so nothing is kept in between and a scrape costs one
snapshot of the counters. The HTTP server binds to 127.0.0.1 unless told otherwise: metrics are not
secret, but nothing is exposed beyond the host by default.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from tiercache.server.tenants import missed_chunks

StatsSource = Callable[[], Mapping[str, Any]]

# prometheus_client leaves this helper unannotated: a float bound → its Go-style text ("+Inf", "1e+07").
_go_float = cast("Callable[[float], str]", floatToGoString)

# Engine counters ``writeback_lost_<reason>``: one family with the reason as a label.
_WRITEBACK_LOST = "writeback_lost_"
# Engine counters ``integrity_failures_<path>``: one family with the path as a label.
_INTEGRITY = "integrity_failures_"
# Engine counters ``l3_refused_<reason>`` (S3 admission): one family with the reason as a label.
_L3_REFUSED = "l3_refused_"
_L3_REFUSAL_REASONS = ("unread", "untracked")  # exported from zero, so alerts can be written first

# Tier counters whose name is not already a Prometheus name (bytes go last: ``*_bytes_total``).
_TIER_RENAMES = {"bytes_written": "written_bytes", "bytes_read": "read_bytes"}
# Tier usage fields exported as gauges, with their help.
_TIER_GAUGES = {
    "bytes_used": ("tier_bytes", "Payload bytes held by the tier now."),
    "bytes_budget": ("tier_budget_bytes", "Byte budget of the tier."),
    "objects": ("tier_objects", "Objects held by the tier now."),
    "quarantine_bytes": (
        "tier_quarantine_bytes",
        "Bytes of L1 slots kept out of use after their reservation ended without its writer's word.",
    ),
}


def _add_histogram(family: HistogramMetricFamily, labels: list[str], snap: Mapping[str, Any]) -> None:
    """Add one :class:`~tiercache.tier.latency.HistogramSnapshot` (per-bucket counts) as cumulative buckets."""
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip(snap["bounds"], snap["counts"], strict=False):
        running += n
        buckets.append((_go_float(bound), running))
    buckets.append(("+Inf", snap["count"]))
    family.add_metric(labels, buckets, snap["sum"])


def _latency(latency: Mapping[str, Any]) -> Iterator[Metric]:
    lookups = HistogramMetricFamily(
        "tiercache_lookup_duration_seconds",
        "Seconds from a lookup's arrival at the server to its reply being sent, by outcome.",
        labels=["outcome"],
    )
    for outcome, snap in sorted(latency.get("lookup", {}).items()):
        _add_histogram(lookups, [outcome], snap)
    yield lookups
    transfers = HistogramMetricFamily(
        "tiercache_tier_transfer_duration_seconds",
        "Seconds per chunk object read (pin, or read into L1) or written (commit, put), by tier.",
        labels=["tier", "op"],
    )
    for tier, ops in latency.get("tiers", {}).items():
        for op, snap in sorted(ops.items()):
            _add_histogram(transfers, [tier, op], snap)
    yield transfers


def _tenants(tenants: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    gauges: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "bytes": GaugeMetricFamily(
            "tiercache_tenant_bytes", "Payload bytes a tenant holds in a tier.", labels=["tenant", "tier"]
        ),
        "objects": GaugeMetricFamily(
            "tiercache_tenant_objects", "Objects a tenant holds in a tier.", labels=["tenant", "tier"]
        ),
        "quota_bytes": GaugeMetricFamily(
            "tiercache_tenant_quota_bytes",
            "Bytes a tenant may hold in a tier before its own objects are evicted first.",
            labels=["tenant", "tier"],
        ),
    }
    counters: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "evictions": CounterMetricFamily(
            "tiercache_tenant_evictions",
            "Objects of a tenant evicted from a tier for room.",
            labels=["tenant", "tier"],
        ),
        "puts": CounterMetricFamily(
            "tiercache_tenant_puts",
            "Objects of a tenant committed to a tier (stores and promotions).",
            labels=["tenant", "tier"],
        ),
    }
    lookups = CounterMetricFamily(
        "tiercache_tenant_lookups", "Lookups asked for a tenant.", labels=["tenant"]
    )
    chunks = CounterMetricFamily(
        "tiercache_tenant_lookup_chunks",
        "Chunks a tenant's lookups asked about, by outcome: found (hit) or not (miss).",
        labels=["tenant", "outcome"],
    )
    for tenant, record in sorted(tenants.items()):
        for tier, held in sorted(record.get("tiers", {}).items()):
            for field, family in (*gauges.items(), *counters.items()):
                if field in held and not (field == "quota_bytes" and tenant == "other"):
                    family.add_metric([tenant, tier], held[field])
        lookups.add_metric([tenant], record.get("lookups", 0))
        chunks.add_metric([tenant, "hit"], int(record.get("hit_chunks", 0)))
        chunks.add_metric([tenant, "miss"], missed_chunks(record))
    yield from gauges.values()
    yield from counters.values()
    yield lookups
    yield chunks


# Engine fields exported as gauges of their own (every other unlabelled field is a counter), with their help.
_ENGINE_GAUGES = {
    "tail_index_blocks": (
        "Block hashes the block index remembers (tails: which stored object holds each "
        "block; bounded by --tail-index-blocks)."
    ),
    "l3_admission_waiting": (
        "Stored chunks the L3 admission rule still waits to decide (their first read, or "
        "their eviction from disk under write-back)."
    ),
}


def _engine_families() -> tuple[
    GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily, CounterMetricFamily
]:
    """The engine's labelled families, empty: queue depth, write-back losses, S3 refusals, integrity failures."""
    depth = GaugeMetricFamily(
        "tiercache_engine_queue_depth", "Writes waiting in a write-through queue.", labels=["queue"]
    )
    lost = CounterMetricFamily(
        "tiercache_engine_writeback_lost",
        "Chunks the disk evicted for write-back that never reached S3 (so in no tier), by reason: "
        "the S3 queue was full, the S3 write failed, or the engine closed first.",
        labels=["reason"],
    )
    refused = CounterMetricFamily(
        "tiercache_engine_l3_refused",
        "Chunks the L3 admission rule (--l3-admission read) kept from S3, by reason: never read "
        "since stored (unread), or no mark of it (untracked: stored before start-up, or forgotten "
        "past --l3-admission-window).",
        labels=["reason"],
    )
    integrity = CounterMetricFamily(
        "tiercache_engine_integrity_failures",
        "Copies out of the shared L1 arena that did not match the digest their object's writer "
        "committed (another process wrote into the slot: late, outside its own slots, or torn), by "
        "where they were caught: a client's load (l1_read), the server's get (server_read), a "
        "promotion's copy (promotion), the copy to the first lower tier (write_through). Each was a "
        "miss, never served.",
        labels=["path"],
    )
    return depth, lost, refused, integrity


def _engine(engine: Mapping[str, Any]) -> Iterator[Metric]:
    """The engine's counters: each unlabelled field as it comes (in name order), then the labelled families."""
    depth, lost, refused, integrity = _engine_families()
    refusals = {reason: 0 for reason in _L3_REFUSAL_REASONS}
    for name, value in sorted(engine.items()):
        if name.endswith("_queue_depth"):
            depth.add_metric([name.removesuffix("_queue_depth")], value)
        elif name.startswith(_WRITEBACK_LOST):
            lost.add_metric([name.removeprefix(_WRITEBACK_LOST)], value)
        elif name.startswith(_INTEGRITY):
            integrity.add_metric([name.removeprefix(_INTEGRITY)], value)
        elif name.startswith(_L3_REFUSED):
            refusals[name.removeprefix(_L3_REFUSED)] = value
        elif name in _ENGINE_GAUGES:
            yield GaugeMetricFamily(f"tiercache_engine_{name}", _ENGINE_GAUGES[name], value=value)
        else:
            yield CounterMetricFamily(f"tiercache_engine_{name}", f"Engine counter {name}.", value=value)
    for reason, value in refusals.items():
        refused.add_metric([reason], value)
    yield depth
    yield lost
    yield refused
    yield integrity


def _tiers(tiers: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """Per tier: usage as gauges, evictions by reason, and every other number as a counter."""
    gauges = {
        field: GaugeMetricFamily(f"tiercache_{name}", help_text, labels=["tier"])
        for field, (name, help_text) in _TIER_GAUGES.items()
    }
    counters: dict[str, CounterMetricFamily] = {}
    evictions = CounterMetricFamily(
        "tiercache_tier_evictions", "Objects evicted, by reason.", labels=["tier", "reason"]
    )
    for tier, values in tiers.items():
        for field, value in values.items():
            if field in gauges:
                gauges[field].add_metric([tier], value)
            elif field == "evictions":
                for reason, n in sorted(value.items()):
                    evictions.add_metric([tier, reason], n)
            elif isinstance(value, int | float):
                name = _TIER_RENAMES.get(field, field)
                family = counters.get(name)
                if family is None:
                    family = counters[name] = CounterMetricFamily(
                        f"tiercache_tier_{name}", f"Tier counter {field}.", labels=["tier"]
                    )
                family.add_metric([tier], value)
    yield from gauges.values()
    yield from counters.values()
    yield evictions


class EngineCollector(Collector):
    """Turns ``stats()`` (the shape of :meth:`TieredEngine.stats`) into Prometheus metrics.

    Unknown counters are exported too (as ``tiercache_engine_<name>_total`` or
    ``tiercache_tier_<name>_total``), so a counter added to the engine or a tier shows up without a
    change here. Called on the metrics server's thread at each scrape.
    """

    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        """One snapshot of ``stats()`` as metric families: engine, tiers, tenants, then latency."""
        stats = self._stats()
        yield from _engine(stats.get("engine", {}))
        yield from _tiers(stats.get("tiers", {}))
        yield from _tenants(stats.get("tenants", {}))
        latency = stats.get("latency")
        if latency is not None:
            yield from _latency(latency)


def render(stats: Mapping[str, Any]) -> str:
    """The Prometheus text exposition of one ``stats()`` snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(lambda: stats))
    return generate_latest(registry).decode()


class MetricsServer:
    """Serves ``/metrics`` for ``stats`` over HTTP on a daemon thread.

    ``port=0`` picks a free port; :attr:`port` tells which after :meth:`start`. Each server has its
    own registry, so several engines in one process (tests) never share metrics.
    """

    def __init__(self, stats: StatsSource, host: str = "127.0.0.1", port: int = 0) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(EngineCollector(stats))
        self._host = host
        self._port = port
        self._httpd: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind and serve; raises :class:`OSError` if the port is taken."""
        self._httpd, self._thread = start_http_server(self._port, self._host, self._registry)
        self._thread.name = "tiercache-metrics"

    @property
    def port(self) -> int:
        """The bound port (only after :meth:`start`)."""
        if self._httpd is None:
            raise RuntimeError("MetricsServer.port is known only after start()")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
