"""docs/grafana-dashboard.json parses, and every metric and label it queries is one tiercache exports.

The sample is what a server's ``/metrics`` serves (:meth:`Server.metrics_stats`: the engine's stats and
latency histograms) for a real engine (L1 + disk in a temp dir) that stored, evicted and read back
chunks, rendered by :func:`tiercache.metrics.render`, the same function a scrape runs; so renaming a
metric in :mod:`tiercache.metrics` without updating the dashboard fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_key
from tiercache.config import ServerOptions
from tiercache.config.server import ServerConfig
from tiercache.config.values import TIER_ORDER
from tiercache.engine import TieredEngine
from tiercache.server import Server
from tiercache.server.build import build_engine
from tiercache.server.metrics import render

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
KiB = 1 << 10

#: Labels Prometheus adds at scrape time (not in the exposition itself).
SCRAPE_LABELS = {"instance", "job"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exprs(dash: dict[str, Any]) -> Iterator[str]:
    for panel in dash["panels"]:
        for target in panel["targets"]:
            yield target["expr"]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            yield query["query"]


@pytest.fixture
def exported(tmp_path: Path) -> dict[str, set[str]]:
    """Sample name → label names, from a real engine's stats rendered as a scrape would."""
    config = ServerConfig.load(
        {"l1.size_gb": "0.001", "disk.path": str(tmp_path / "disk"), "disk.size_gb": "0.01"}, {}
    )
    engine: TieredEngine = build_engine(config)
    server = Server(engine, ServerOptions(listen=f"ipc://{tmp_path}/server.sock"))  # never started
    try:
        for i in range(8):  # 8 × 256 KiB into a 1 MiB L1: capacity evictions
            assert engine.put(make_key(i), bytes([i]) * 256 * KiB)
            engine.flush(10)
        engine.get(make_key(7))
        engine.get(make_key(100))  # a miss
        stats = server.metrics_stats()
    finally:
        server.stop()  # closes the engine
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(render(stats)):
        for s in family.samples:
            names.setdefault(s.name, set()).update(s.labels)
    assert any(n == "tiercache_tier_evictions_total" for n in names), "the sample must contain evictions"
    return names


def test_the_dashboard_is_valid_grafana_json() -> None:
    dash = dashboard()
    assert dash["title"] and dash["uid"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])


def test_every_metric_the_dashboard_queries_is_exported(exported: dict[str, set[str]]) -> None:
    referenced = {name for expr in exprs(dashboard()) for name in re.findall(r"\btiercache_\w+", expr)}
    assert referenced
    missing = sorted(referenced - set(exported))
    assert not missing, f"the dashboard queries metrics that tiercache does not export: {missing}"


def test_every_label_the_dashboard_uses_exists_on_its_metric(exported: dict[str, set[str]]) -> None:
    for expr in exprs(dashboard()):
        for name, selector in re.findall(r"\b(tiercache_\w+)\{([^}]*)\}", expr):
            for label, value in re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', selector):
                assert label in exported[name] | SCRAPE_LABELS, f"{name} has no label {label!r}"
                if label == "tier":
                    assert value in TIER_ORDER, f"{value!r} is not a tier name"
        for grouping in re.findall(r"\bby \(([^)]*)\)", expr):
            metrics = set(re.findall(r"\btiercache_\w+", expr))
            for label in (g.strip() for g in grouping.split(",")):
                assert any(label in exported[m] for m in metrics) or label in SCRAPE_LABELS, (
                    f"`by ({grouping})` in {expr!r}: no queried metric has label {label!r}"
                )


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    text = json.dumps(dashboard())
    for needed in (
        "tiercache_tier_bytes",
        "tiercache_tier_budget_bytes",
        "tiercache_tier_hits_total",
        "tiercache_tier_evictions_total",
        "tiercache_tier_verify_failures_total",
        "tiercache_engine_queue_depth",
        "tiercache_engine_l2_queue_drops_total",
        'tier=\\"s3\\"',
        "tiercache_lookup_duration_seconds_bucket",
        "tiercache_tier_transfer_duration_seconds_bucket",
    ):
        assert needed in text, needed
