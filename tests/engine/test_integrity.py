"""Specification: what the engine copies out of L1 (shared memory others may write) is checked
against the digest its writer committed: a lower tier never keeps bytes another process wrote
into the slot, and a scribbled object is dropped, counted by where it was caught."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.conftest import S3Endpoint, payload_for
from tests.engine.conftest import EngineFactory, disk_tier, l1_tier, s3_tier
from tests.engine.test_engine import CHUNK_BYTES, FULL, prompt
from tiercache.engine import TieredEngine
from tiercache.keys.digest import digest
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.tier import L1Tier
from tiercache.testing.faults import FaultInjectingTier, FaultPlan


def commit(engine: TieredEngine, key: ObjectKey) -> bytes:
    """Store ``key`` as a client does: reserve, fill, commit with the digest of what it wrote."""
    data = payload_for(key, CHUNK_BYTES)
    handle = engine.reserve(key, CHUNK_BYTES)
    assert handle is not None
    handle.buffer[:] = data
    engine.commit(handle, digest(data))
    return data


def scribble(l1: L1Tier, key: ObjectKey) -> None:
    """Another process writes into the committed object's slot (late, or outside its own)."""
    handle = l1.pin(key, count=False)
    assert handle is not None
    l1.arena.view(l1.slot_of(handle).offset + 7, 4)[:] = b"late"
    l1.release(handle)


def gated_disk(tmp_path: Path) -> tuple[FaultInjectingTier, threading.Event]:
    gate = threading.Event()
    return FaultInjectingTier(disk_tier(tmp_path / "disk"), FaultPlan(write_gate=gate)), gate


def test_the_write_through_never_persists_bytes_scribbled_into_the_l1_slot(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    l1 = l1_tier()
    disk, gate = gated_disk(tmp_path)
    engine = make_engine(l1, disk)
    [h] = prompt(1)
    key = FULL.key(h)
    commit(engine, key)
    scribble(l1, key)  # before the (held) write-through copies it
    gate.set()
    assert engine.flush(10)
    assert not disk.contains(key)
    assert not l1.contains(key)  # the corrupt object is dropped too
    counters = engine.counters.snapshot()
    assert counters["integrity_failures_write_through"] == 1
    assert counters["l2_writes"] == 0


def test_an_intact_write_through_keeps_the_writers_digest_as_the_frame_checksum(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    l1 = l1_tier()
    disk = disk_tier(tmp_path / "disk")
    engine = make_engine(l1, disk)
    [h] = prompt(1)
    key = FULL.key(h)
    data = commit(engine, key)
    assert engine.flush(10)
    pinned = disk.pin(key)
    assert pinned is not None and pinned.digest == digest(data) and bytes(pinned.buffer) == data
    disk.release(pinned)


def test_the_write_through_to_s3_never_uploads_scribbled_bytes(
    make_engine: EngineFactory, s3: S3Endpoint
) -> None:
    """Tiers l1,s3: the upload's body is built from a private copy checked against the digest."""
    l1 = l1_tier()
    gate = threading.Event()
    bucket = FaultInjectingTier(s3_tier(s3, bucket="tiercache-integrity"), FaultPlan(write_gate=gate))
    engine = make_engine(l1, bucket)
    [h] = prompt(1)
    key = FULL.key(h)
    commit(engine, key)
    scribble(l1, key)
    gate.set()
    assert engine.flush(30)
    assert bucket.pin(key) is None
    assert engine.counters.snapshot()["integrity_failures_write_through"] == 1


def test_the_servers_own_read_of_a_scribbled_object_is_a_miss_in_l1_and_a_hit_below(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    l1 = l1_tier()
    disk = disk_tier(tmp_path / "disk")
    engine = make_engine(l1, disk)
    [h] = prompt(1)
    key = FULL.key(h)
    data = commit(engine, key)
    assert engine.flush(10)
    scribble(l1, key)
    assert engine.get(key) == data  # L1's copy failed its digest: dropped, promoted from disk
    assert engine.counters.snapshot()["integrity_failures_server_read"] == 1
    assert engine.get(key) == data  # the promoted copy is intact
    assert engine.counters.snapshot()["integrity_failures_server_read"] == 1


def test_a_promotion_commits_the_lower_tiers_digest_for_its_readers(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    l1 = l1_tier()
    disk = disk_tier(tmp_path / "disk")
    engine = make_engine(l1, disk)
    [h] = prompt(1)
    key = FULL.key(h)
    data = payload_for(key, CHUNK_BYTES)
    disk.put(key, data)
    assert engine.get(key) == data  # promoted into L1
    pinned = l1.pin(key, count=False)
    assert pinned is not None and pinned.digest == digest(data)
    l1.release(pinned)
