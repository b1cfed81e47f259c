"""Scenario: disk full / LMDB budget under sustained writes, injected "disk full", a flaky disk.

Invariants: with 16× the disk budget written, eviction keeps the budget and no write fails; while the
disk reports full (injected), write-throughs fail and are counted, nothing crashes and L1 keeps serving;
when it clears, writes land again. Through a real server with a flaky disk (30 % of disk calls fail,
injected with the test-only ``ServerSpec.faults`` hook), every read is still right.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_key
from tests.reliability.common import figures, payload
from tests.server.conftest import StartServer, manifest
from tiercache.config import DiskConfig, L1Config
from tiercache.engine import TieredEngine
from tiercache.errors import TierError
from tiercache.keys import ObjectKey
from tiercache.l1.tier import L1Tier
from tiercache.l2_disk import DiskTier
from tiercache.testing.faults import FaultInjectingTier, FaultPlan

KiB = 1 << 10
MiB = 1 << 20
CHUNK_BYTES = 16 * KiB


def test_sustained_writes_through_a_small_disk_budget_and_injected_disk_full(tmp_path: Path) -> None:
    budget = 2 * MiB
    plan = FaultPlan()
    disk = FaultInjectingTier(
        DiskTier(DiskConfig(path=tmp_path / "l2", budget_bytes=budget, sync_interval_s=0.2)), plan
    )
    l1 = L1Tier(L1Config(size_bytes=8 * MiB, name=f"tc-rel-full-{random.getrandbits(40):x}"))
    written: list[ObjectKey] = []

    def write(n: int) -> None:
        for _ in range(n):
            key = make_key(len(written), fp=b"D" * 16)
            assert engine.put(key, payload(key, CHUNK_BYTES))  # L1 never refuses: owed chunks drain
            written.append(key)
            if len(written) % 64 == 0:
                assert engine.flush(30)

    with TieredEngine(l1, [disk]) as engine:
        write(2048)  # 32 MiB through a 2 MiB disk budget
        assert engine.flush(30)
        phase1 = engine.stats()
        peak_used = disk.usage().bytes_used

        plan.full = True  # the disk says "full" to every write
        write(256)
        assert engine.flush(30)
        phase2 = engine.stats()
        recent_ok = sum(engine.get(k) == payload(k, CHUNK_BYTES) for k in written[-64:])  # L1 serves

        plan.full = False
        write(256)
        assert engine.flush(30)
        phase3 = engine.stats()
        wrong = 0
        for k in written:
            got = engine.get(k)
            wrong += got is not None and got != payload(k, CHUNK_BYTES)
        map_bytes = (tmp_path / "l2" / "data.mdb").stat().st_size

    d1, d3 = phase1["tiers"]["disk"], phase3["tiers"]["disk"]
    e1, e2, e3 = phase1["engine"], phase2["engine"], phase3["engine"]
    figures(
        "disk-full",
        written_mib=len(written) * CHUNK_BYTES / MiB,
        disk_budget_mib=budget / MiB,
        disk_used_mib=peak_used / MiB,
        capacity_evictions=d1["evictions"].get("capacity", 0),
        write_failures_normal=e1["write_failures"],
        injected_full=plan.injected,
        write_failures_while_full=e2["write_failures"] - e1["write_failures"],
        recent_l1_hits_while_full=recent_ok,
        l2_writes_after_clear=e3["l2_writes"] - e2["l2_writes"],
        wrong_reads=wrong,
        data_mdb_mib=map_bytes / MiB,
    )
    assert e1["write_failures"] == 0 and e1["l2_writes"] == 2048
    assert peak_used <= budget
    assert d1["evictions"].get("capacity", 0) > 0
    assert e2["write_failures"] - e1["write_failures"] == plan.injected == 256
    assert recent_ok == 64
    assert e3["l2_writes"] - e2["l2_writes"] == 256 and e3["write_failures"] == e2["write_failures"]
    assert wrong == 0
    assert d3["bytes_used"] <= budget


def test_a_real_server_with_a_flaky_disk_serves_only_right_bytes(
    start_server: StartServer, tmp_path: Path
) -> None:
    server = start_server(
        l1_bytes=2 * MiB,  # small: most reads must come back from the flaky disk
        disk_path=str(tmp_path / "disk"),
        faults={"disk": {"error_rate": 0.3, "seed": 7}},
    )
    with server.client() as client:
        [_group] = client.register([(0, manifest())])
        fp = manifest().fingerprint()
        keys = [ObjectKey(fp, 0, i.to_bytes(16, "big")) for i in range(400)]
        for i in range(0, len(keys), 8):
            batch = keys[i : i + 8]
            assert client.store_chunks(batch, [payload(k, CHUNK_BYTES) for k in batch]) == len(batch)
        hits = misses = wrong = 0
        for k in keys:
            got = client.get(k)
            if got is None:
                misses += 1
            elif got == payload(k, CHUNK_BYTES):
                hits += 1
            else:
                wrong += 1
        stats = client.stats()
    figures(
        "flaky-disk-server",
        chunks=len(keys),
        hits=hits,
        misses=misses,
        wrong_reads=wrong,
        write_failures=stats["engine"]["write_failures"],
        disk_errors=stats["tiers"]["disk"]["errors"],
    )
    assert wrong == 0
    assert stats["engine"]["write_failures"] > 0  # the injected faults were real and counted
    assert hits > 0


@pytest.fixture
def small_file_system(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs of its own (root only: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / "fs"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_budget_larger_than_the_file_system_shrinks_to_fit_and_writes_go_on(
    small_file_system: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A 1 GiB budget on a 24 MiB file system: every write failed once the file system was full,
    # with a warning each, and the tier never evicted to recover (issue 30, point 10).
    caplog.set_level(logging.WARNING, logger="tiercache.l2_disk")  # the tier's modules log under it
    disk = DiskTier(DiskConfig(path=small_file_system / "l2", budget_bytes=1 << 30, sync_interval_s=0.2))
    try:
        assert disk.usage().bytes_budget < 24 * MiB  # fitted to the file system at start
        assert any("more than the file system" in r.getMessage() for r in caplog.records)
        # Then the file system fills up under the tier (another program's file).
        room = disk.usage().bytes_budget
        (small_file_system / "other").write_bytes(b"\0" * (24 * MiB - room // 2))
        caplog.clear()
        keys = [make_key(i, fp=b"F" * 16) for i in range(1200)]  # 18 MiB of 16 KiB objects
        failed = 0
        for key in keys:
            try:
                disk.put(key, payload(key, CHUNK_BYTES))
            except TierError:
                failed += 1
        shrinks = [r for r in caplog.records if "almost full" in r.getMessage()]
        budget = disk.usage().bytes_budget
        right = sum(
            1
            for k in keys[-64:]
            if (h := disk.pin(k)) is not None and bytes(h.buffer) == payload(k, CHUNK_BYTES)
        )
        figures(
            "disk-budget-over-the-file-system",
            writes=len(keys),
            failed=failed,
            budget_shrinks=len(shrinks),
            budget_mib=budget / MiB,
            last_64_read_right=right,
        )
        assert failed <= 1  # at most the write that met the full file system, then it fits
        assert 1 <= len(shrinks) <= 3  # a warning when the budget shrinks, not one per write
        assert right == 64  # it kept writing, evicting what was oldest
    finally:
        disk.close()
