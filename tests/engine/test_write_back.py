"""Write-back never loses a chunk silently.

With ``l3_write_policy`` ``back`` the disk hands each chunk it evicts to the S3 queue and then deletes
it. When that queue is full, or the S3 write fails, the chunk is in no tier any more: the engine
counts it as lost on write-back (apart from the recoverable write-through drops, whose chunk is still
on disk) and says so in a rate-limited warning.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cli.test_metrics import sample
from tests.conftest import FakeClock, S3Endpoint, payload_for
from tests.engine.conftest import EngineFactory, disk_tier, l1_tier, s3_tier
from tests.engine.test_engine import CHUNK_BYTES, FULL, prompt
from tiercache.config import L3WritePolicy
from tiercache.engine import TieredEngine
from tiercache.engine.counters import EngineCounters
from tiercache.engine.writes import WriteBackLosses
from tiercache.keys.object_key import ObjectKey
from tiercache.server.metrics import render
from tiercache.testing.faults import FaultInjectingTier, FaultPlan
from tiercache.testing.poll import wait_until
from tiercache.tier import Tier

WRITES_LOG = "tiercache.engine.writes"
REPORTED = re.compile(r"write-back lost (\d+) chunks?")


def store_one_at_a_time(engine: TieredEngine, keys: list[ObjectKey]) -> None:
    """Store each chunk and wait until it is on disk before the next, so that no write-through to
    the disk is dropped and every chunk missing later went missing on write-back."""

    def on_disk(n: int) -> Callable[[], bool]:
        return lambda: engine.counters.snapshot()["l2_writes"] == n

    for n, key in enumerate(keys, start=1):
        assert engine.put(key, payload_for(key, CHUNK_BYTES))
        wait_until(on_disk(n), what=f"chunk {n} on disk")


def in_no_tier(keys: list[ObjectKey], tiers: list[Tier]) -> list[ObjectKey]:
    return [k for k in keys if not any(t.contains(k) for t in tiers)]


def reported_losses(caplog: pytest.LogCaptureFixture) -> list[int]:
    """The chunk counts of the write-back loss warnings logged so far."""
    found = []
    for record in caplog.records:
        if record.name == WRITES_LOG and record.levelno == logging.WARNING:
            m = REPORTED.search(record.getMessage())
            if m:
                found.append(int(m.group(1)))
    return found


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds every S3 write while unset; opened at the end so that no writer stays stuck."""
    event = threading.Event()
    yield event
    event.set()


def test_a_chunk_evicted_from_disk_while_the_s3_queue_is_full_is_counted_and_warned_as_lost(
    tmp_path: Path,
    s3: S3Endpoint,
    make_engine: EngineFactory,
    gate: threading.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=WRITES_LOG)
    l1 = l1_tier(4 * CHUNK_BYTES)
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    stalled_s3 = FaultInjectingTier(s3_tier(s3), FaultPlan(write_gate=gate))
    engine = make_engine(
        l1, disk, stalled_s3, l3_write_policy=L3WritePolicy.BACK, write_queue_depth=2, write_workers=1
    )
    keys = [FULL.key(h) for h in prompt(24)]

    # 24 chunks through a disk that holds 8 while S3 takes nothing: its queue (2 deep) fills.
    store_one_at_a_time(engine, keys)
    gate.set()
    assert engine.flush(timeout=60)

    counted = engine.counters.snapshot()
    lost = in_no_tier(keys, [l1, disk, stalled_s3])
    assert lost, "the disk evicted more than the S3 queue could take: some chunk must be gone"
    assert counted["writeback_lost_queue_full"] == len(lost)
    assert counted["writeback_lost_write_failed"] == 0
    # Not a write-through drop (the chunk would still be on disk), nor a failed write.
    assert counted["l3_queue_drops"] == counted["l2_queue_drops"] == counted["write_failures"] == 0
    assert counted["stores_dropped"] == 0
    scraped = render(engine.stats())
    assert sample(scraped, "tiercache_engine_writeback_lost_total", reason="queue_full") == len(lost)

    engine.close()  # reports what the last rate-limited warning did not
    reported = reported_losses(caplog)
    assert reported[0] == 1, "the first loss is warned about at once"
    assert sum(reported) == len(lost)


def test_write_back_chunks_still_queued_when_the_engine_closes_are_counted_as_lost_at_shutdown(
    tmp_path: Path,
    s3: S3Endpoint,
    make_engine: EngineFactory,
    gate: threading.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=WRITES_LOG)
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    stalled_s3 = FaultInjectingTier(s3_tier(s3), FaultPlan(write_gate=gate))
    engine = make_engine(
        l1_tier(4 * CHUNK_BYTES),
        disk,
        stalled_s3,
        l3_write_policy=L3WritePolicy.BACK,
        write_queue_depth=2,
        write_workers=1,
    )
    store_one_at_a_time(engine, [FULL.key(h) for h in prompt(24)])
    assert engine.counters.snapshot()["writeback_lost_queue_full"] > 0  # so the S3 queue is full

    engine.close(timeout=0)  # S3 still takes nothing: its writer holds one chunk, two wait behind it

    assert engine.counters.snapshot()["writeback_lost_shutdown"] == 2
    last = [r.getMessage() for r in caplog.records if r.name == WRITES_LOG][-1]
    assert "at shutdown 2" in last


def test_a_chunk_evicted_from_disk_whose_s3_write_fails_is_counted_as_lost(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l1 = l1_tier(4 * CHUNK_BYTES)
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    broken_s3 = FaultInjectingTier(s3_tier(s3), FaultPlan(fail_writes=True))
    engine = make_engine(l1, disk, broken_s3, l3_write_policy=L3WritePolicy.BACK)
    keys = [FULL.key(h) for h in prompt(24)]

    store_one_at_a_time(engine, keys)
    assert engine.flush(timeout=60)

    counted = engine.counters.snapshot()
    lost = in_no_tier(keys, [l1, disk, broken_s3])
    assert lost
    assert counted["writeback_lost_write_failed"] == counted["write_failures"] == len(lost)
    assert counted["writeback_lost_queue_full"] == 0


def test_write_back_that_keeps_up_loses_nothing(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l1 = l1_tier(4 * CHUNK_BYTES)
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    l3 = s3_tier(s3)
    engine = make_engine(l1, disk, l3, l3_write_policy=L3WritePolicy.BACK)
    keys = [FULL.key(h) for h in prompt(24)]

    store_one_at_a_time(engine, keys)
    assert engine.flush(timeout=60)

    counted = engine.counters.snapshot()
    assert in_no_tier(keys, [l1, disk, l3]) == []
    assert counted["writeback_lost_queue_full"] == counted["writeback_lost_write_failed"] == 0


# -- the warning's rate limit ----------------------------------------------------------------------
def test_losses_are_warned_at_most_once_per_interval_with_the_count_since_the_last_warning(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=WRITES_LOG)
    counters = EngineCounters()
    losses = WriteBackLosses(counters, interval_s=30.0, clock=clock)

    losses.lost("queue_full")
    assert reported_losses(caplog) == [1]
    for _ in range(3):
        clock.advance(1.0)
        losses.lost("queue_full")
    assert reported_losses(caplog) == [1], "within the interval: counted, not warned"
    clock.advance(30.0)
    losses.lost("write_failed")
    assert reported_losses(caplog) == [1, 4]
    assert "queue full 3, S3 write failed 1," in caplog.records[-1].getMessage()

    losses.close()
    assert reported_losses(caplog) == [1, 4], "nothing left unreported"
    losses.lost("queue_full")
    losses.close()
    assert reported_losses(caplog) == [1, 4, 1], "close reports the rest"
    assert counters.snapshot()["writeback_lost_queue_full"] == 5
    assert counters.snapshot()["writeback_lost_write_failed"] == 1
