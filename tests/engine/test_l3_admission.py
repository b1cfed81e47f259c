"""Specification: S3 admission (``l3_admission``) writes to S3 only what pays.

With ``read`` a chunk goes to S3 only once it has been read (prefetched, loaded) since it was
stored: with write-through at its first read, with write-back when the disk evicts it if it was
read. A chunk never read is refused and counted as such, by reason; a refused write-back eviction is
never counted as a loss. ``all`` (the default) writes every chunk, as before. Real tiers throughout:
an L1 arena, LMDB in a temporary directory, and a bucket on moto's server over HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cli.test_metrics import sample
from tests.conftest import S3Endpoint, payload_for
from tests.engine.conftest import EngineFactory, disk_tier, l1_tier, s3_tier
from tests.engine.test_engine import CHUNK_BYTES, FULL, prompt
from tiercache.config import L3Admission, L3WritePolicy
from tiercache.engine import TicketState, TieredEngine
from tiercache.keys.object_key import ObjectKey
from tiercache.l3_s3 import S3Tier
from tiercache.server.metrics import render
from tiercache.testing.faults import FaultInjectingTier, FaultPlan
from tiercache.testing.poll import wait_until
from tiercache.tier import Tier

READ = L3Admission.READ


def store_one_at_a_time(engine: TieredEngine, keys: list[ObjectKey]) -> None:
    """Store each chunk and wait until it is on disk before the next (no disk write is dropped)."""
    start = engine.counters.snapshot()["l2_writes"]

    def on_disk(n: int) -> Callable[[], bool]:
        return lambda: engine.counters.snapshot()["l2_writes"] == start + n

    for n, key in enumerate(keys, start=1):
        assert engine.put(key, payload_for(key, CHUNK_BYTES))
        wait_until(on_disk(n), what=f"chunk {n} on disk")


def in_s3(l3: S3Tier, keys: list[ObjectKey]) -> list[ObjectKey]:
    """The keys the bucket holds, listed from S3 itself (not the tier's existence cache)."""
    listed = set(l3.iter_keys())
    return [k for k in keys if k in listed]


def read_prefix(engine: TieredEngine, hashes: list[bytes], chunks: int) -> None:
    """What a connector's load does: a prefetch of the first ``chunks`` chunks, then release."""
    ticket = engine.prefetch(hashes, [FULL], chunks)
    assert engine.wait(ticket, timeout=30) is TicketState.READY
    engine.release_ticket(ticket)


def decided(engine: TieredEngine) -> dict[str, int]:
    c = engine.counters.snapshot()
    return {
        "admitted": c["l3_admitted"],
        "unread": c["l3_refused_unread"],
        "untracked": c["l3_refused_untracked"],
        "waiting": int(engine.stats()["engine"]["l3_admission_waiting"]),  # type: ignore[index]
    }


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds every write of the tier it gates while unset; opened at the end so no writer stays stuck."""
    event = threading.Event()
    yield event
    event.set()


# -- write-through ---------------------------------------------------------------------------------
def test_write_through_with_read_never_writes_a_chunk_never_read_and_refuses_it_once_forgotten(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l3 = s3_tier(s3)
    engine = make_engine(l1_tier(), disk_tier(tmp_path), l3, l3_admission=READ, l3_admission_window=4)
    keys = [FULL.key(h) for h in prompt(8)]

    store_one_at_a_time(engine, keys)
    assert engine.flush(timeout=60)

    assert in_s3(l3, keys) == []
    assert engine.counters.snapshot()["l3_writes"] == 0
    # The window remembers the 4 newest, still waiting for a first read; the 4 oldest were
    # forgotten unread: refused for good.
    assert decided(engine) == {"admitted": 0, "unread": 4, "untracked": 0, "waiting": 4}
    scraped = render(engine.stats())
    assert sample(scraped, "tiercache_engine_l3_refused_total", reason="unread") == 4
    assert sample(scraped, "tiercache_engine_l3_refused_total", reason="untracked") == 0
    assert sample(scraped, "tiercache_engine_l3_admitted_total") == 0
    assert sample(scraped, "tiercache_engine_l3_admission_waiting") == 4


def test_write_through_with_read_writes_a_chunk_to_s3_at_its_first_read_and_only_once(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l3 = s3_tier(s3)
    engine = make_engine(l1_tier(), disk_tier(tmp_path), l3, l3_admission=READ)
    hashes = prompt(4)
    keys = [FULL.key(h) for h in hashes]
    store_one_at_a_time(engine, keys)
    assert engine.flush(timeout=60)
    assert in_s3(l3, keys) == []  # stored, on disk, not read yet

    read_prefix(engine, hashes, 2)
    assert engine.flush(timeout=60)
    assert in_s3(l3, keys) == keys[:2]
    assert decided(engine) == {"admitted": 2, "unread": 0, "untracked": 0, "waiting": 2}

    read_prefix(engine, hashes, 2)  # read again: already admitted, no second PUT
    assert engine.get(keys[0]) == payload_for(keys[0], CHUNK_BYTES)
    assert engine.flush(timeout=60)
    assert engine.counters.snapshot()["l3_writes"] == 2
    assert l3.stats.snapshot()["puts"] == 2


def test_write_through_with_read_a_chunk_read_before_it_reached_the_disk_goes_to_s3_when_it_does(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory, gate: threading.Event
) -> None:
    l3 = s3_tier(s3)
    slow_disk = FaultInjectingTier(disk_tier(tmp_path), FaultPlan(write_gate=gate))
    engine = make_engine(l1_tier(), slow_disk, l3, l3_admission=READ, write_workers=1)
    [key] = [FULL.key(h) for h in prompt(1)]
    assert engine.put(key, payload_for(key, CHUNK_BYTES))

    assert engine.get(key) == payload_for(key, CHUNK_BYTES)  # from L1: its disk write is held
    assert engine.counters.snapshot()["l2_writes"] == 0
    gate.set()
    assert engine.flush(timeout=60)

    assert in_s3(l3, [key]) == [key]
    assert decided(engine) == {"admitted": 1, "unread": 0, "untracked": 0, "waiting": 0}


def test_write_through_with_all_writes_every_chunk_and_counts_each_admitted(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l3 = s3_tier(s3)
    engine = make_engine(l1_tier(), disk_tier(tmp_path), l3)  # l3_admission all: the default
    keys = [FULL.key(h) for h in prompt(4)]

    store_one_at_a_time(engine, keys)
    assert engine.flush(timeout=60)

    assert in_s3(l3, keys) == keys
    assert decided(engine) == {"admitted": 4, "unread": 0, "untracked": 0, "waiting": 0}
    assert engine.counters.snapshot()["l3_writes"] == 4


# -- write-back ------------------------------------------------------------------------------------
def in_no_tier(keys: list[ObjectKey], tiers: list[Tier]) -> list[ObjectKey]:
    return [k for k in keys if not any(t.contains(k) for t in tiers)]


def test_write_back_with_read_hands_the_disk_only_its_read_chunks_and_refusals_are_not_losses(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l1 = l1_tier(4 * CHUNK_BYTES)
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    l3 = s3_tier(s3)
    engine = make_engine(l1, disk, l3, l3_write_policy=L3WritePolicy.BACK, l3_admission=READ)
    hashes = prompt(24)
    keys = [FULL.key(h) for h in hashes]

    store_one_at_a_time(engine, keys[:4])
    read_prefix(engine, hashes, 4)  # chunks 0..3 are read once; none of the others ever is
    store_one_at_a_time(engine, keys[4:])  # a disk of 8 chunks evicts the oldest 16 or so
    assert engine.flush(timeout=60)

    counted = engine.counters.snapshot()
    evicted = disk.stats.snapshot()["evictions"]["capacity"]
    gone = in_no_tier(keys, [l1, disk, l3])
    assert in_s3(l3, keys) == keys[:4]
    assert counted["l3_admitted"] == 4 and counted["l3_writes"] == 4
    assert gone and counted["l3_refused_unread"] == len(gone) == evicted - 4
    assert counted["l3_refused_untracked"] == 0
    # Refused by the rule, so none of them is a write-back loss.
    assert counted["writeback_lost_queue_full"] == counted["writeback_lost_write_failed"] == 0
    assert counted["writeback_lost_shutdown"] == counted["write_failures"] == 0


def test_write_back_with_read_refuses_an_eviction_it_has_no_mark_of_as_untracked(
    tmp_path: Path, s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    l1 = l1_tier(4 * CHUNK_BYTES)
    disk = disk_tier(tmp_path, budget=8 * CHUNK_BYTES)
    l3 = s3_tier(s3)
    engine = make_engine(
        l1, disk, l3, l3_write_policy=L3WritePolicy.BACK, l3_admission=READ, l3_admission_window=2
    )
    hashes = prompt(24)
    keys = [FULL.key(h) for h in hashes]
    store_one_at_a_time(engine, keys[:4])
    read_prefix(engine, hashes, 4)  # read, but the 2-chunk window forgets them as 20 more arrive
    store_one_at_a_time(engine, keys[4:])
    assert engine.flush(timeout=60)

    counted = engine.counters.snapshot()
    evicted = disk.stats.snapshot()["evictions"]["capacity"]
    assert in_s3(l3, keys) == []
    assert counted["l3_refused_untracked"] == evicted == len(in_no_tier(keys, [l1, disk, l3]))
    assert counted["l3_admitted"] == counted["l3_refused_unread"] == 0
    assert decided(engine)["waiting"] == 2


def test_write_back_with_all_hands_every_eviction_to_s3_and_counts_it_admitted(
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
    evicted = disk.stats.snapshot()["evictions"]["capacity"]
    assert in_no_tier(keys, [l1, disk, l3]) == []
    assert counted["l3_admitted"] == counted["l3_writes"] == evicted
    assert counted["l3_refused_unread"] == counted["l3_refused_untracked"] == 0


# -- where it cannot apply -------------------------------------------------------------------------
def test_read_without_a_disk_in_front_of_s3_is_refused_at_start_up(
    s3: S3Endpoint, make_engine: EngineFactory
) -> None:
    with pytest.raises(ValueError, match="use tiers l1,disk,s3 or --l3-admission all"):
        make_engine(l1_tier(), s3_tier(s3), l3_admission=READ)
