"""Per-tenant lookup counters, and the per-tenant view of the ``stats`` reply and ``/metrics``.

The tiers account what each tenant holds (:meth:`Tier.tenants <tiercache.tier.Tier.tenants>`); the
server adds what each asked for and found: lookups, chunks asked about, chunks found. Tenants are
named by their id's label (:func:`~tiercache.keys.tenant.tenant_label`), never by a salt.

Bounded: at most :data:`MAX_TENANTS` tenants get counters of their own; lookups of tenants beyond
that are counted under :data:`OTHER`. Metrics export the :func:`top` tenants by bytes held and sum
the rest into :data:`OTHER`, so a fleet with thousands of tenants keeps a bounded label set.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from tiercache.keys.tenant import tenant_label

#: Tenants with lookup counters of their own.
MAX_TENANTS = 4096
#: The label of every tenant not shown by name (beyond the bound, or beyond a metrics top-N).
OTHER = "other"
#: The lookup counters kept per tenant.
LOOKUP_FIELDS = ("lookups", "lookup_chunks", "hit_chunks")


class TenantLookups:
    """Lookups per tenant. Thread-safe (the request loop records, the metrics thread reads)."""

    def __init__(self, limit: int = MAX_TENANTS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}

    def record(self, tenant: bytes, chunks: int, hit_chunks: int) -> None:
        """One lookup of ``tenant`` that asked about ``chunks`` chunks and found ``hit_chunks``."""
        label = tenant_label(tenant)
        with self._lock:
            counts = self._counts.get(label)
            if counts is None:
                if len(self._counts) >= self._limit:
                    label = OTHER
                counts = self._counts.setdefault(label, [0, 0, 0])
            counts[0] += 1
            counts[1] += chunks
            counts[2] += hit_chunks

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {label: dict(zip(LOOKUP_FIELDS, c, strict=True)) for label, c in self._counts.items()}


def merge(held: Mapping[str, Any], lookups: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, Any]]:
    """One record per tenant: ``{"tiers": {tier: {...}}, "lookups": n, "lookup_chunks": n,
    "hit_chunks": n}`` from the engine's ``stats()["tenants"]`` and :meth:`TenantLookups.snapshot`."""
    out: dict[str, dict[str, Any]] = {}
    for label in {*held, *lookups}:
        record: dict[str, Any] = {"tiers": dict(held.get(label, {}).get("tiers", {}))}
        counts = lookups.get(label, {})
        for name in LOOKUP_FIELDS:
            record[name] = counts.get(name, 0)
        out[label] = record
    return out


def with_tenants(
    stats: Mapping[str, Any], lookups: TenantLookups, n: int, named: set[str] | None = None
) -> dict[str, Any]:
    """``stats`` (an engine's ``stats()``) whose ``tenants`` hold the lookup counters too, bounded
    to ``n`` named tenants and :data:`OTHER` (see :func:`top`; ``named`` makes it sticky)."""
    tenants = merge(stats.get("tenants", {}), lookups.snapshot())
    return {**stats, "tenants": top(tenants, n, named)}


def missed_chunks(record: Mapping[str, Any]) -> int:
    """Chunks a tenant's lookups asked about and did not find."""
    return max(0, int(record.get("lookup_chunks", 0)) - int(record.get("hit_chunks", 0)))


def held_bytes(record: Mapping[str, Any]) -> int:
    """Bytes a tenant record holds over all tiers."""
    return sum(int(t.get("bytes", 0)) for t in record.get("tiers", {}).values())


def top(
    tenants: Mapping[str, Mapping[str, Any]], n: int, named: set[str] | None = None
) -> dict[str, dict[str, Any]]:
    """At most ``n`` tenants by name, and every other one summed into :data:`OTHER`: a bounded
    label set for metrics.

    ``named`` (updated in place) makes the choice sticky: tenants named before stay named while
    they exist, and free places go to those holding the most bytes (then the most lookups). A
    tenant moving in or out of :data:`OTHER` makes that series' counters jump, so names change only
    when a place frees up.
    """
    named = set() if named is None else named
    named &= {label for label in tenants if label != OTHER}
    ranked = sorted(
        tenants.items(), key=lambda kv: (held_bytes(kv[1]), kv[1].get("lookups", 0), kv[0]), reverse=True
    )
    for label, _ in ranked:
        if len(named) >= n:
            break
        if label != OTHER:
            named.add(label)
    shown = {label: dict(tenants[label]) for label in named}
    rest = [record for label, record in ranked if label not in shown]
    if rest:
        summed: dict[str, Any] = {"tiers": {}}
        for name in LOOKUP_FIELDS:
            summed[name] = sum(int(r.get(name, 0)) for r in rest)
        for record in rest:
            for tier, values in record.get("tiers", {}).items():
                into = summed["tiers"].setdefault(tier, {})
                for field, value in values.items():
                    into[field] = into.get(field, 0) + int(value)
        shown[OTHER] = summed
    return shown


__all__ = [
    "LOOKUP_FIELDS",
    "MAX_TENANTS",
    "OTHER",
    "TenantLookups",
    "held_bytes",
    "merge",
    "missed_chunks",
    "top",
    "with_tenants",
]
