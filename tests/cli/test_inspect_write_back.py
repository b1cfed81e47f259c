"""Specification: `tiercache inspect summary` names the chunks a write-back server lost.

A server process with write-back to an S3 tier (moto over HTTP) whose writes all fail, and a disk
that holds 8 of the 24 chunks stored: every chunk the disk evicts is lost, and the summary, its JSON
and the stats reply behind the metrics all say how many.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_metrics import sample
from tests.conftest import S3Endpoint
from tests.server.conftest import manifest
from tests.server.serverproc import ServerProcess, ServerSpec
from tests.server.test_data_path import store_prompt
from tiercache.cli.app import main
from tiercache.config import L3WritePolicy
from tiercache.keys import chunk_hashes
from tiercache.server.metrics import render
from tiercache.testing.poll import wait_until

KiB = 1 << 10
CHUNK_BYTES = 64 * KiB
CHUNKS = 24


def settled(stats: dict[str, Any]) -> bool:
    """Every chunk reached the disk, and every chunk the disk evicted was decided (all lost)."""
    e, disk = stats["engine"], stats["tiers"]["disk"]
    evicted = disk["evictions"].get("capacity", 0)
    lost = e["writeback_lost_queue_full"] + e["writeback_lost_write_failed"] + e["writeback_lost_shutdown"]
    return bool(e["l2_writes"] == CHUNKS and evicted > 0 and lost == evicted)


@pytest.fixture
def lossy(tmp_path: Path, s3: S3Endpoint) -> Iterator[tuple[ServerProcess, dict[str, Any]]]:
    """A write-back server that lost chunks, and its stats once they are all decided."""
    proc = ServerProcess(
        ServerSpec(
            listen=f"ipc://{tmp_path}/server.sock",
            disk_path=str(tmp_path / "disk"),
            disk_budget=8 * CHUNK_BYTES,
            s3_url=s3.url,
            options={"chunk_size": 256},
            engine_options={"l3_write_policy": L3WritePolicy.BACK},
            faults={"s3": {"fail_writes": True}},
        )
    )
    try:
        proc.wait_ready()
        with proc.client() as client:
            [group] = client.register([(0, manifest())])
            for h in chunk_hashes(list(range(CHUNKS * 256)), 256):
                store_prompt(client, group, [h], nbytes=CHUNK_BYTES)

            def decided() -> dict[str, Any] | None:
                stats = client.stats()
                return stats if settled(stats) else None

            stats = wait_until(decided, what="every eviction decided")
        yield proc, stats
    finally:
        proc.stop()


def test_the_summary_names_chunks_lost_on_write_back_and_why(
    lossy: tuple[ServerProcess, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    proc, stats = lossy
    lost = stats["engine"]["writeback_lost_write_failed"]
    assert lost > 0 and stats["engine"]["writeback_lost_queue_full"] == 0

    assert main(["inspect", "summary", "--server", proc.endpoint]) == 0
    out = capsys.readouterr().out
    assert f"lost on write-back: {lost} chunks in no tier (S3 queue full 0, S3 write failed {lost})" in out

    assert main(["inspect", "summary", "--server", proc.endpoint, "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engine"]
    assert engine["writeback_lost_write_failed"] == lost

    text = render(stats)  # what a scrape of this server's metrics shows
    assert sample(text, "tiercache_engine_writeback_lost_total", reason="write_failed") == lost
