"""Behaviour of the LMDB disk tier beyond the shared contract.

Real LMDB files in a temp dir; corruption is done to the bytes of the real ``data.mdb``.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import stat
import threading
import time
from pathlib import Path

import lmdb
import pytest

from tests.conftest import FakeClock, make_key, payload_for
from tiercache.config import DiskConfig
from tiercache.errors import DiskTierError, TierFullError
from tiercache.keys import Fingerprint, ObjectKey
from tiercache.l2_disk import DiskTier
from tiercache.testing.poll import wait_until
from tiercache.tier.frames import HEADER_BYTES, FrameFlags, FrameHeader

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB


def open_tier(path: Path, clock: FakeClock, budget: int = 10 * CHUNK, **kw: object) -> DiskTier:
    kw.setdefault("sync_interval_s", 0.05)
    on_evict = kw.pop("on_evict", None)
    config = DiskConfig(path=path, budget_bytes=budget, **kw)
    return DiskTier(config, clock=clock, on_evict=on_evict)


def random_payload(seed: int, nbytes: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def half_compressible(seed: int) -> bytes:
    return random_payload(seed, CHUNK // 2) + bytes(CHUNK // 2)


def patch_file(path: Path, offset: int, new: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(new)


def find_once(path: Path, needle: bytes) -> int:
    blob = path.read_bytes()
    at = blob.find(needle)
    assert at >= 0, "the bytes are not in the file"
    assert blob.find(needle, at + 1) < 0, "the bytes are in the file twice"
    return at


def find_all(path: Path, needle: bytes) -> list[int]:
    """Every offset of ``needle``: LMDB's copy-on-write can leave older copies of a small record."""
    blob = path.read_bytes()
    found, at = [], blob.find(needle)
    while at >= 0:
        found.append(at)
        at = blob.find(needle, at + 1)
    assert found, "the bytes are not in the file"
    return found


def raw_env(path: Path) -> lmdb.Environment:
    """The same environment opened with plain lmdb, to forge records as a foreign writer could."""
    return lmdb.open(str(path), max_dbs=8, map_size=1 << 30)


# -- files and lifecycle -------------------------------------------------------------------------
def test_the_directory_and_files_are_owner_only(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "l2"
    with open_tier(path, clock) as tier:
        tier.put(make_key(1), b"x" * 100)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in ("data.mdb", "lock.mdb"):
        assert stat.S_IMODE((path / name).stat().st_mode) & 0o077 == 0


def test_a_named_background_thread_syncs_and_close_stops_it(tmp_path: Path, clock: FakeClock) -> None:
    tier = open_tier(tmp_path / "l2", clock)
    names = [t.name for t in threading.enumerate()]
    assert any(n.startswith("tiercache-disk-sync") for n in names)
    tier.put(make_key(1), b"x" * 100)
    wait_until(lambda: tier.syncs > 0, what="a background sync")
    tier.close()
    tier.close()  # idempotent
    assert not any(t.name.startswith("tiercache-disk-sync") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(DiskTierError, match="closed"):
        tier.get(make_key(1))


def _write_then_die(path: str, n: int) -> None:
    tier = DiskTier(DiskConfig(path=Path(path), budget_bytes=64 * MiB, sync_interval_s=0.05))
    for i in range(n):
        key = make_key(i)
        tier.put(key, payload_for(key, 10_000 + i))
    try:
        wait_until(lambda: tier.syncs > 0, what="a background sync")
    except TimeoutError:
        os._exit(3)
    os._exit(0)  # a crash: no close(), no flush()


def test_writes_survive_a_crash_after_the_background_sync(tmp_path: Path, clock: FakeClock) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_write_then_die, args=(str(tmp_path / "l2"), 20))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    with open_tier(tmp_path / "l2", clock, budget=64 * MiB) as tier:
        assert tier.usage().objects == 20
        for i in range(20):
            assert tier.get(make_key(i)) == payload_for(make_key(i), 10_000 + i)


# -- verification: corruption is a miss, a metric and a deletion -------------------------------
def test_a_flipped_payload_byte_in_data_mdb_is_a_counted_miss_and_is_deleted(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "l2"
    victim, other = make_key(1), make_key(2)
    payload = random_payload(1, 3 * 4096 + 100)
    with open_tier(path, clock) as tier:
        tier.put(victim, payload)
        tier.put(other, payload_for(other, 5000))
    at = find_once(path / "data.mdb", payload)
    patch_file(path / "data.mdb", at + 5000, bytes([payload[5000] ^ 0x01]))
    with open_tier(path, clock) as tier:
        assert tier.get(victim) is None
        snap = tier.stats.snapshot()
        assert snap["verify_failures"] == 1
        assert snap["evictions"] == {"corrupt": 1}
        assert not tier.contains(victim)
        assert tier.usage().objects == 1
        assert tier.usage().bytes_used == 5000
        assert tier.get(other) == payload_for(other, 5000)


def test_read_into_verifies_what_it_copied_and_reports_corruption_as_a_miss(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "l2"
    victim = make_key(1)
    payload = random_payload(7, 3 * 4096 + 100)
    with open_tier(path, clock) as tier:
        tier.put(victim, payload)
    at = find_once(path / "data.mdb", payload)
    patch_file(path / "data.mdb", at + 700, bytes([payload[700] ^ 0x80]))
    out = bytearray(len(payload))
    with open_tier(path, clock) as tier:
        assert tier.read_into(victim, lambda n: memoryview(out)[:n]) is None
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert not tier.contains(victim)


def test_read_into_decompresses_compressed_objects(tmp_path: Path, clock: FakeClock) -> None:
    key = make_key(1)
    payload = half_compressible(3)
    out = bytearray(len(payload))
    with open_tier(tmp_path / "l2", clock, compress=True) as tier:
        tier.put(key, payload)
        assert tier.usage().bytes_used < len(payload)  # really stored compressed
        assert tier.read_into(key, lambda n: memoryview(out)[:n]) is not None
    assert bytes(out) == payload


def test_a_torn_payload_in_data_mdb_is_a_miss(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "l2"
    key = make_key(1)
    payload = random_payload(2, 2 * 4096)
    with open_tier(path, clock) as tier:
        tier.put(key, payload)
    at = find_once(path / "data.mdb", payload)
    half = len(payload) // 2
    patch_file(path / "data.mdb", at + half, bytes(len(payload) - half))  # tail never written
    with open_tier(path, clock) as tier:
        assert tier.pin(key) is None
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert tier.usage().objects == 0


def test_a_corrupt_meta_header_in_data_mdb_is_a_miss(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "l2"
    key = make_key(1)
    payload = random_payload(3, 1000)
    with open_tier(path, clock) as tier:
        tier.put(key, payload)
    # The header starts: magic, version 1, flags 0, reserved 0, then the key.
    for at in find_all(path / "data.mdb", b"TCKV\x01\x00\x00\x00" + key.to_bytes()):
        patch_file(path / "data.mdb", at + 4 + 4 + 35 + 2, b"\xff")  # inside payload_len
    with open_tier(path, clock) as tier:
        assert tier.get(key) is None
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert not tier.contains(key)
        assert list(tier.iter_keys()) == []


def _copy_object_under_another_key(path: Path, src: ObjectKey, dst: ObjectKey) -> None:
    """Behind the tier's back: ``src``'s frame and index record, stored again under ``dst``."""
    env = raw_env(path)
    data, meta = env.open_db(b"data"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.put(dst.to_bytes(), txn.get(src.to_bytes(), db=data), db=data)
        txn.put(dst.to_bytes(), txn.get(src.to_bytes(), db=meta), db=meta)
    env.close()


def test_a_foreign_object_copied_under_another_key_is_a_miss(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "l2"
    a, b = make_key(1), make_key(2)
    with open_tier(path, clock) as tier:
        tier.put(a, payload_for(a, 4000))
    _copy_object_under_another_key(path, a, b)
    with open_tier(path, clock) as tier:
        assert tier.contains(b)  # contains does not verify...
        assert tier.get(b) is None  # ...but a read never serves another key's bytes
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert not tier.contains(b)
        assert tier.get(a) == payload_for(a, 4000)


@pytest.mark.parametrize("drop", [b"data", b"meta"])
def test_half_an_object_is_a_miss_and_is_cleaned_up(tmp_path: Path, clock: FakeClock, drop: bytes) -> None:
    path = tmp_path / "l2"
    key = make_key(1)
    with open_tier(path, clock) as tier:
        tier.put(key, b"x" * 3000)
    env = raw_env(path)
    with env.begin(write=True) as txn:
        txn.delete(key.to_bytes(), db=env.open_db(drop, txn=txn))
    env.close()
    with open_tier(path, clock) as tier:
        assert tier.get(key) is None
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert tier.usage().objects == 0
        assert list(tier.iter_keys()) == []


# -- LRU order, eviction and write-back --------------------------------------------------------
@pytest.mark.parametrize("touch_first", [False, True])
def test_lru_order_survives_a_restart(tmp_path: Path, clock: FakeClock, touch_first: bool) -> None:
    path = tmp_path / "l2"
    keys = [make_key(i) for i in range(10)]
    with open_tier(path, clock) as tier:  # budget 10 chunks: 9 fit under the high watermark
        for key in keys[:9]:
            tier.put(key, payload_for(key, CHUNK))
        if touch_first:
            assert tier.get(keys[0]) is not None
        assert tier.stats.snapshot()["evictions"] == {}
    with open_tier(path, clock) as tier:
        tier.put(keys[9], payload_for(keys[9], CHUNK))  # 10 > 9.5 chunks: evict down to 8.5
        present = set(tier.iter_keys())
    oldest_first = [k for k in keys[:9] if not (touch_first and k == keys[0])]
    assert present.isdisjoint(oldest_first[:2])
    assert set(oldest_first[2:]) <= present
    assert (keys[0] in present) is touch_first


@pytest.mark.parametrize("restart", [False, True])
def test_an_overwritten_object_becomes_the_youngest(tmp_path: Path, clock: FakeClock, restart: bool) -> None:
    path = tmp_path / "l2"
    keys = [make_key(i) for i in range(10)]
    tier = open_tier(path, clock)  # budget 10 chunks: 9 fit under the high watermark
    try:
        for key in keys[:9]:
            tier.put(key, payload_for(key, CHUNK))
        tier.put(keys[0], payload_for(keys[0], CHUNK))  # the same bytes again
        assert tier.usage().bytes_used == 9 * CHUNK
        if restart:
            tier.close()
            tier = open_tier(path, clock)
        tier.put(keys[9], payload_for(keys[9], CHUNK))  # 10 > 9.5 chunks: evict down to 8.5
        present = set(tier.iter_keys())
    finally:
        tier.close()
    assert keys[0] in present
    assert present.isdisjoint(keys[1:3])
    assert set(keys[3:]) <= present


def test_an_overwrite_with_other_bytes_serves_and_counts_only_the_new_version(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "l2"
    key = make_key(1)
    with open_tier(path, clock) as tier:
        tier.put(key, random_payload(1, 1000))
        tier.put(key, random_payload(2, 3000))
        assert tier.get(key) == random_payload(2, 3000)
        assert tier.usage().bytes_used == 3000
    with open_tier(path, clock) as tier:
        assert tier.usage().bytes_used == 3000
        assert tier.usage().objects == 1
        assert tier.get(key) == random_payload(2, 3000)


def test_read_into_never_copies_an_object_stored_under_another_key(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "l2"
    a, b = make_key(1), make_key(2)
    with open_tier(path, clock) as tier:
        tier.put(a, payload_for(a, 4000))
    _copy_object_under_another_key(path, a, b)
    asked: list[int] = []

    def alloc(n: int) -> memoryview:
        asked.append(n)
        return memoryview(bytearray(n))

    with open_tier(path, clock) as tier:
        assert tier.read_into(b, alloc) is None
        assert asked == []  # the header names another key: nothing was copied anywhere
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert not tier.contains(b)
        assert tier.read_into(a, alloc) is not None


def test_read_into_a_missing_key_is_a_counted_miss_that_allocates_nothing(
    tmp_path: Path, clock: FakeClock
) -> None:
    asked: list[int] = []

    def alloc(n: int) -> memoryview:
        asked.append(n)
        return memoryview(bytearray(n))

    with open_tier(tmp_path / "l2", clock) as tier:
        assert tier.read_into(make_key(1), alloc) is None
        assert asked == []
        assert tier.stats.snapshot()["misses"] == 1
        assert tier.stats.snapshot()["verify_failures"] == 0


def test_read_into_makes_the_object_the_youngest(tmp_path: Path, clock: FakeClock) -> None:
    keys = [make_key(i) for i in range(10)]
    out = bytearray(CHUNK)
    with open_tier(tmp_path / "l2", clock) as tier:
        for key in keys[:9]:
            tier.put(key, payload_for(key, CHUNK))
        assert tier.read_into(keys[0], lambda n: memoryview(out)[:n]) is not None
        tier.put(keys[9], payload_for(keys[9], CHUNK))  # evicts the two oldest
        present = set(tier.iter_keys())
    assert keys[0] in present
    assert present.isdisjoint(keys[1:3])


def test_on_evict_receives_the_verified_payload_of_each_evicted_object(
    tmp_path: Path, clock: FakeClock
) -> None:
    written_back: dict[ObjectKey, bytes] = {}

    def on_evict(key: ObjectKey, payload: memoryview) -> None:
        written_back[key] = bytes(payload)

    with open_tier(tmp_path / "l2", clock, on_evict=on_evict, compress=True) as tier:
        for i in range(30):  # each compresses to about half a chunk: 15 chunks into 10
            tier.put(make_key(i), half_compressible(i))
        evicted = tier.stats.snapshot()["evictions"]["capacity"]
        assert len(written_back) == evicted > 0
        for key, data in written_back.items():
            assert data == half_compressible(int.from_bytes(key.prefix_hash, "big"))
            assert not tier.contains(key)


def test_an_eviction_listener_set_later_is_called_too(tmp_path: Path, clock: FakeClock) -> None:
    seen: list[ObjectKey] = []
    with open_tier(tmp_path / "l2", clock) as tier:
        tier.set_eviction_listener(lambda key, payload: seen.append(key))
        for i in range(20):
            tier.put(make_key(i), payload_for(make_key(i), CHUNK))
        assert seen and seen[0] == make_key(0)
        assert len(seen) == tier.stats.snapshot()["evictions"]["capacity"]


def test_when_everything_is_pinned_a_put_is_refused_not_fatal(tmp_path: Path, clock: FakeClock) -> None:
    with open_tier(tmp_path / "l2", clock) as tier:
        handles = []
        for i in range(9):
            tier.put(make_key(i), payload_for(make_key(i), CHUNK))
            handles.append(tier.pin(make_key(i)))
        with pytest.raises(TierFullError):
            tier.put(make_key(99), payload_for(make_key(99), 2 * CHUNK))
        for handle in handles:
            tier.release(handle)
        tier.put(make_key(99), payload_for(make_key(99), 2 * CHUNK))
        assert tier.get(make_key(99)) == payload_for(make_key(99), 2 * CHUNK)


def test_sustained_churn_of_mixed_sizes_keeps_the_budget_and_bounds_the_file(
    tmp_path: Path, clock: FakeClock
) -> None:
    budget = 4 * MiB
    rng = random.Random(7)
    path = tmp_path / "l2"
    written = 0
    with open_tier(path, clock, budget=budget) as tier:
        i = 0
        while written < 10 * budget:
            key = make_key(i)
            size = rng.randrange(64 * KiB, MiB + 1)
            tier.put(key, payload_for(key, size))
            written += size
            assert tier.usage().bytes_used <= budget
            if i % 7 == 0:  # reads in between, as a serving cache sees them
                probe = make_key(rng.randrange(i + 1))
                got = tier.get(probe)
                assert got is None or got == payload_for(probe, len(got))
            i += 1
        for key in tier.iter_keys():
            got = tier.get(key)
            assert got is not None and got == payload_for(key, len(got))
        assert tier.stats.snapshot()["errors"] == 0
    assert (path / "data.mdb").stat().st_size <= 3 * budget


def test_map_full_from_a_stuck_reader_is_handled_and_the_tier_recovers(
    tmp_path: Path, clock: FakeClock
) -> None:
    # A lease that is never released pins its snapshot: LMDB cannot reuse any page freed after it,
    # so churn fills the whole map (1.3 x 8 MiB + 64 MiB) and MDB_MAP_FULL must be survived.
    budget = 8 * MiB
    with open_tier(tmp_path / "l2", clock, budget=budget, map_headroom=1.3) as tier:
        stuck = make_key(10_000)
        tier.put(stuck, b"s" * 100)
        handle = tier.pin(stuck)
        assert handle is not None
        refused = 0
        for i in range(200):  # 200 MiB of writes into a ~74 MiB map
            key = make_key(i)
            try:
                tier.put(key, payload_for(key, MiB))
            except TierFullError:
                refused += 1
            assert tier.usage().bytes_used <= budget
        assert refused > 0
        clock.advance(3600)  # the lease expires; its txn is aborted on the next operation
        tier.put(make_key(500), payload_for(make_key(500), MiB))
        assert tier.stats.snapshot()["expired_leases"] == 1
        for i in range(501, 530):
            tier.put(make_key(i), payload_for(make_key(i), MiB))
        assert tier.get(make_key(529)) == payload_for(make_key(529), MiB)


def test_an_expired_lease_is_counted_and_release_stays_harmless(tmp_path: Path, clock: FakeClock) -> None:
    with open_tier(tmp_path / "l2", clock, lease_ttl_s=5.0) as tier:
        tier.put(make_key(1), b"x" * 100)
        handle = tier.pin(make_key(1))
        assert handle is not None
        clock.advance(6)
        assert tier.contains(make_key(2)) is False
        tier.get(make_key(1))
        assert tier.stats.snapshot()["expired_leases"] == 1
        tier.release(handle)


# -- compression -------------------------------------------------------------------------------
def _stored_flags(path: Path, key: ObjectKey) -> FrameFlags:
    env = raw_env(path)
    with env.begin() as txn:
        meta = txn.get(key.to_bytes(), db=env.open_db(b"meta", txn=txn))
    env.close()
    return FrameHeader.decode(meta[:HEADER_BYTES], key).flags


def test_compressed_objects_round_trip_and_carry_the_zstd_flag(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "l2"
    squeezable, noise = make_key(1), make_key(2)
    with open_tier(path, clock, budget=4 * MiB, compress=True) as tier:
        tier.put(squeezable, b"kv" * 100_000)
        tier.put(noise, random_payload(4, 50_000))
        assert tier.usage().bytes_used < 200_000 + 50_000  # counts stored (compressed) bytes
    assert _stored_flags(path, squeezable) & FrameFlags.ZSTD
    assert not _stored_flags(path, noise) & FrameFlags.ZSTD  # not smaller: stored raw
    with open_tier(path, clock, budget=4 * MiB, compress=False) as tier:  # readable either way
        assert tier.get(squeezable) == b"kv" * 100_000
        assert tier.get(noise) == random_payload(4, 50_000)


# -- manifests ---------------------------------------------------------------------------------
def test_manifests_are_stored_listed_and_survive_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    fp1, fp2 = Fingerprint(b"1" * 16), Fingerprint(b"2" * 16)
    with open_tier(tmp_path / "l2", clock) as tier:
        tier.put_manifest(fp2, b'{"model_id":"b"}')
        tier.put_manifest(fp1, b'{"model_id":"a"}')
        assert tier.get_manifest(Fingerprint(b"3" * 16)) is None
    with open_tier(tmp_path / "l2", clock) as tier:
        assert tier.get_manifest(fp1) == b'{"model_id":"a"}'
        assert list(tier.iter_manifests()) == [
            (fp1, b'{"model_id":"a"}'),
            (fp2, b'{"model_id":"b"}'),
        ]
        assert tier.usage().objects == 0


def test_engine_state_is_kept_replaced_and_survives_a_restart_outside_the_budget(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_tier(tmp_path / "l2", clock, budget=1 * MiB) as tier:
        assert tier.get_state("tail-block-index") is None
        assert tier.put_state("tail-block-index", b"first")
        assert tier.put_state("tail-block-index", b"second" * 100_000)  # 600 kB: not in the budget
        tier.put(make_key(1), random_payload(1, 900_000))  # the budget is all the objects'
        assert tier.put_state("other", b"x")
    with open_tier(tmp_path / "l2", clock, budget=1 * MiB) as tier:
        assert tier.get_state("tail-block-index") == b"second" * 100_000
        assert tier.get_state("other") == b"x"
        assert (tier.usage().objects, list(tier.iter_keys())) == (1, [make_key(1)])


# -- concurrency and processes -----------------------------------------------------------------
def test_concurrent_readers_and_writers_only_ever_see_the_right_bytes(
    tmp_path: Path, clock: FakeClock
) -> None:
    failures: list[str] = []
    with open_tier(tmp_path / "l2", clock, budget=2 * MiB) as tier:

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(300):
                    key = make_key(rng.randrange(64))
                    if rng.random() < 0.4:
                        tier.put(key, payload_for(key, rng.randrange(1, 128 * KiB)))
                    else:
                        got = tier.get(key)
                        if got is not None and got != payload_for(key, len(got)):
                            failures.append(f"wrong bytes for {key}")
            except Exception as exc:
                failures.append(repr(exc))

        threads = [threading.Thread(target=work, args=(s,), name=f"t{s}") for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert tier.usage().bytes_used <= 2 * MiB


def _read_in_another_process(path: str, n: int, queue: multiprocessing.Queue) -> None:
    tier = DiskTier(DiskConfig(path=Path(path), budget_bytes=64 * MiB))
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        while len(seen) < n and time.monotonic() < deadline:
            for i in range(n):
                if i in seen:
                    continue
                got = tier.get(make_key(i))
                if got is not None:
                    if got != payload_for(make_key(i), 20_000 + i):
                        queue.put(f"wrong bytes for {i}")
                        return
                    seen.add(i)
        queue.put(len(seen))
    finally:
        tier.close()


def test_a_reader_in_another_process_sees_committed_objects_while_the_writer_writes(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "l2"
    n = 40
    with open_tier(path, clock, budget=64 * MiB) as tier:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_read_in_another_process, args=(str(path), n, queue))
        proc.start()
        for i in range(n):
            tier.put(make_key(i), payload_for(make_key(i), 20_000 + i))
        result = queue.get(timeout=90)
        proc.join(30)
    assert result == n


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reopens_the_environment_and_the_parent_keeps_its_pin(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_tier(tmp_path / "l2", clock) as tier:
        key = make_key(1)
        tier.put(key, payload_for(key, 20_000))
        handle = tier.pin(key)
        assert handle is not None
        pid = os.fork()
        if pid == 0:  # child: must not use (or abort) the parent's handles
            code = 1
            try:
                ok = tier.get(key) == payload_for(key, 20_000)
                tier.put(make_key(2), b"from the child")
                tier.close()
                code = 0 if ok else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bytes(handle.buffer) == payload_for(key, 20_000)
        tier.release(handle)
        assert tier.get(make_key(2)) == b"from the child"


def test_iter_keys_by_use_is_newest_first_and_survives_a_restart(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tiercache warm`` promotes in this order: what was used last comes first. Reads count once
    their touches are applied (at the latest one sync interval later; ``flush`` does it now). Small
    batches make the walk cross read-txn boundaries."""
    monkeypatch.setattr("tiercache.l2_disk.records.ITER_BATCH", 3)
    tier = open_tier(tmp_path, clock, budget=64 * CHUNK)
    for i in range(8):
        tier.put(make_key(i), payload_for(make_key(i), 100))
    assert list(tier.iter_keys_by_use()) == [make_key(i) for i in reversed(range(8))]
    assert tier.get(make_key(2)) is not None
    tier.put(make_key(5), payload_for(make_key(5), 200))  # an overwrite is a use too
    tier.flush()
    expected = [make_key(i) for i in (5, 2, 7, 6, 4, 3, 1, 0)]
    assert list(tier.iter_keys_by_use()) == expected
    tier.close()
    reopened = open_tier(tmp_path, clock, budget=64 * CHUNK)
    assert list(reopened.iter_keys_by_use()) == expected
    reopened.close()


def test_an_existing_directory_keeps_its_mode_and_the_files_are_owner_only(
    tmp_path: Path, clock: FakeClock
) -> None:
    """--disk-path on a directory shared with others (1777, like /tmp): opening the tier must not
    lock its other users out (it made it 0700); its own files are owner-only."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    tier = DiskTier(DiskConfig(path=shared, budget_bytes=1 << 20), clock=clock)
    try:
        assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
        assert stat.S_IMODE((shared / "data.mdb").stat().st_mode) == 0o600
    finally:
        tier.close()
    fresh = tmp_path / "fresh" / "disk"
    tier = DiskTier(DiskConfig(path=fresh, budget_bytes=1 << 20), clock=clock)
    tier.close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700  # made by the tier: owner-only
