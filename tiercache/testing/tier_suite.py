"""The conformance suite of the tier contract (:mod:`tiercache.tier.contract`): every tier passes it.

A tier's test module subclasses :class:`TierSuite` and implements :meth:`TierSuite.make_tier`; pytest
then runs every test below against it. A tier says what it offers beyond the minimum with class
attributes, and a test of a capability the tier does not claim checks the documented default instead
(refusing, or a no-op), so nothing is skipped:

* ``hands_over_evictions`` — :meth:`~tiercache.tier.Tier.set_eviction_listener` is honoured (L2).

:class:`PersistentTierSuite` adds the duties of a tier that keeps objects at rest (L2, L3): a restart
keeps them and their manifests, and bytes damaged at rest (:meth:`PersistentTierSuite.damage`, written
by the fixture) are a counted miss, never a hit. :class:`FrontTierSuite` adds the
:class:`~tiercache.tier.FrontTier` duties (owed objects). A wrapper
around a tier (:class:`~tiercache.tier.wrappers.WrapperTier` and its subclasses) passes the suite of
the tier it wraps: subclass that suite and wrap in :meth:`make_tier`.

Needs pytest; time is a :class:`~tiercache.testing.fixtures.FakeClock` the tests advance, so every
expiry is tested without sleeping.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tiercache.errors import ReservationError, TierError, TierFullError
from tiercache.keys.digest import digest
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.testing.fixtures import FakeClock, make_key, payload_for
from tiercache.tier.contract import FrontTier, Tier
from tiercache.tier.stats import EvictionReason

#: Size of the objects the eviction tests store, and the budget every tier gets (16 of them).
CHUNK = 64 * 1024
BUDGET = 16 * CHUNK
#: Longer than any reservation or lease TTL a tier is configured with in a test.
AGES = 3600.0


class TierSuite:
    """The contract every tier keeps. See the module docstring for how to use it."""

    persistent: bool = False
    hands_over_evictions: bool = False

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        """A new tier of ``budget`` bytes on storage under ``tmp_path``, timed by ``clock``. Called
        again with the same arguments, a persistent tier opens the same storage."""
        raise NotImplementedError

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def tier(self, tmp_path: Path, clock: FakeClock) -> Iterator[Tier]:
        t = self.make_tier(tmp_path, clock, BUDGET)
        yield t
        t.close()

    def fill(self, tier: Tier, keys: range, size: int = CHUNK) -> None:
        for i in keys:
            key = make_key(i)
            tier.put(key, payload_for(key, size))

    @staticmethod
    def peek(tier: Tier, key: ObjectKey) -> bytes | None:
        """The stored bytes of ``key`` read without counting a use (which a frequency-aware
        policy would remember), or ``None``."""
        handle = tier.pin(key, count=False)
        if handle is None:
            return None
        try:
            return bytes(handle.buffer)
        finally:
            tier.release(handle)

    # -- basic read/write -------------------------------------------------------------------
    def test_put_then_get_returns_exactly_the_stored_bytes(self, tier: Tier) -> None:
        for i, size in enumerate([1, 100, 4096, CHUNK, CHUNK + 7]):
            key = make_key(i)
            tier.put(key, payload_for(key, size))
        for i, size in enumerate([1, 100, 4096, CHUNK, CHUNK + 7]):
            key = make_key(i)
            assert tier.get(key) == payload_for(key, size)

    def test_a_missing_key_is_a_counted_miss(self, tier: Tier) -> None:
        assert tier.get(make_key(99)) is None
        assert tier.pin(make_key(99)) is None
        assert not tier.contains(make_key(99))
        assert tier.stats.snapshot()["misses"] >= 2

    def test_hits_are_counted(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, payload_for(key, 100))
        tier.get(key)
        assert tier.stats.snapshot()["hits"] >= 1

    def test_an_uncounted_pin_is_neither_a_hit_nor_a_miss(self, tier: Tier) -> None:
        """The engine's own reads (the source of a write to a lower tier) serve no reader."""
        key = make_key(1)
        tier.put(key, payload_for(key, 100))
        before = tier.stats.snapshot()
        handle = tier.pin(key, count=False)
        assert handle is not None and bytes(handle.buffer) == payload_for(key, 100)
        tier.release(handle)
        assert tier.pin(make_key(99), count=False) is None
        after = tier.stats.snapshot()
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
        assert tier.pin(make_key(99)) is None  # a counted one still counts
        assert tier.stats.snapshot()["misses"] == before["misses"] + 1

    def test_overwrite_replaces_the_object(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, b"a" * 500)
        tier.put(key, b"b" * 700)
        assert tier.get(key) == b"b" * 700
        assert tier.usage().objects == 1

    def test_delete_removes_and_reports_presence(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, b"x" * 10)
        assert tier.delete(key) is True
        assert tier.get(key) is None
        assert not tier.contains(key)
        assert tier.delete(key) is False

    def test_iter_keys_lists_committed_objects_only(self, tier: Tier) -> None:
        for i in range(3):
            tier.put(make_key(i), b"v" * 10)
        pending = tier.reserve(make_key(7), 10)
        assert set(tier.iter_keys()) == {make_key(i) for i in range(3)}
        tier.abort(pending)

    def test_iter_keys_by_use_lists_each_committed_object_once(self, tier: Tier) -> None:
        for i in range(5):
            tier.put(make_key(i), b"v" * 10)
        tier.put(make_key(2), b"w" * 10)  # an overwrite is one object, listed once
        tier.get(make_key(1))
        keys = list(tier.iter_keys_by_use())
        assert sorted(keys, key=lambda k: k.to_bytes()) == [make_key(i) for i in range(5)]

    def test_usage_counts_payload_bytes_and_objects(self, tier: Tier) -> None:
        tier.put(make_key(1), b"x" * 1000)
        tier.put(make_key(2), b"x" * 3000)
        usage = tier.usage()
        assert usage.objects == 2
        assert usage.bytes_used >= 4000
        assert usage.bytes_budget == BUDGET

    def test_read_into_copies_the_payload_into_the_callers_buffer(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, payload_for(key, 3000))
        out = bytearray(5000)
        sizes: list[int] = []

        def alloc(n: int) -> memoryview:
            sizes.append(n)
            return memoryview(out)[:n]

        assert tier.read_into(key, alloc) == digest(payload_for(key, 3000))  # the payload's digest
        assert sizes == [3000]
        assert bytes(out[:3000]) == payload_for(key, 3000)
        assert tier.read_into(make_key(2), alloc) is None
        assert sizes == [3000]  # a miss never asks for a buffer

    def test_contains_many_answers_for_each_key(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(5)]
        for key in keys[1:4:2]:
            tier.put(key, b"c" * 32)
        assert tier.contains_many(keys) == [False, True, False, True, False]
        assert tier.contains_many([]) == []

    def test_lookup_prefix_counts_leading_present_keys(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(6)]
        for key in keys[:4]:
            tier.put(key, b"p" * 64)
        assert tier.lookup_prefix(keys) == 4
        assert tier.lookup_prefix(keys[:2]) == 2
        assert tier.lookup_prefix([]) == 0
        assert tier.lookup_prefix(keys[4:]) == 0

    # -- two-phase writes ---------------------------------------------------------------------
    def test_a_reservation_is_invisible_until_commit(self, tier: Tier) -> None:
        key = make_key(1)
        handle = tier.reserve(key, 100)
        handle.buffer[:] = payload_for(key, 100)
        assert not tier.contains(key)
        assert tier.get(key) is None
        tier.commit(handle)
        assert tier.get(key) == payload_for(key, 100)

    def test_abort_leaves_nothing_behind(self, tier: Tier) -> None:
        key = make_key(1)
        before = tier.usage().bytes_used
        handle = tier.reserve(key, 1000)
        tier.abort(handle)
        assert tier.get(key) is None
        assert tier.usage().bytes_used == before
        tier.abort(handle)  # aborting twice is harmless

    def test_abort_of_an_overwrite_keeps_the_old_object(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, b"old" * 10)
        handle = tier.reserve(key, 10)
        tier.abort(handle)
        assert tier.get(key) == b"old" * 10

    def test_commit_twice_is_an_error(self, tier: Tier) -> None:
        handle = tier.reserve(make_key(1), 10)
        handle.buffer[:] = b"0123456789"
        tier.commit(handle)
        with pytest.raises(ReservationError):
            tier.commit(handle)

    def test_an_expired_reservation_cannot_commit_and_stays_invisible(
        self, tier: Tier, clock: FakeClock
    ) -> None:
        key = make_key(1)
        handle = tier.reserve(key, 10)
        handle.buffer[:] = b"0123456789"
        clock.advance(AGES)
        with pytest.raises(ReservationError):
            tier.commit(handle)
        assert tier.get(key) is None

    def test_an_abandoned_reservation_expires_counted_and_frees_its_bytes(
        self, tier: Tier, clock: FakeClock
    ) -> None:
        """A client that reserved and died must not hold the tier's room forever. (A tier whose
        writers may still write late, L1, keeps the room out of use a while longer: its quarantine
        ends within another AGES.)"""
        before = tier.usage().bytes_used
        tier.reserve(make_key(1), 4096)
        clock.advance(AGES)
        tier.get(make_key(2))  # any call may sweep; a read does on every tier
        assert tier.stats.snapshot()["expired_reservations"] == 1
        clock.advance(AGES)
        tier.get(make_key(2))
        assert tier.usage().bytes_used == before
        assert not tier.contains(make_key(1))

    def test_an_object_larger_than_the_budget_is_refused(self, tier: Tier) -> None:
        with pytest.raises(TierFullError):
            tier.reserve(make_key(1), BUDGET + 1)

    # -- reads and eviction -------------------------------------------------------------------
    def test_pinned_buffer_holds_the_payload_until_release(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, payload_for(key, 5000))
        handle = tier.pin(key)
        assert handle is not None
        assert bytes(handle.buffer) == payload_for(key, 5000)
        tier.release(handle)
        tier.release(handle)  # releasing twice is harmless

    def test_the_budget_is_kept_by_evicting(self, tier: Tier) -> None:
        self.fill(tier, range(3 * BUDGET // CHUNK))
        assert tier.usage().bytes_used <= BUDGET
        assert tier.stats.snapshot()["evictions"].get(EvictionReason.CAPACITY.value, 0) > 0
        # Whatever survived is intact.
        for key in tier.iter_keys():
            assert tier.get(key) == payload_for(key, CHUNK)

    def test_a_pinned_object_is_never_evicted(self, tier: Tier) -> None:
        first = make_key(0)
        tier.put(first, payload_for(first, CHUNK))
        handle = tier.pin(first)
        assert handle is not None
        self.fill(tier, range(1, 3 * BUDGET // CHUNK))
        assert tier.contains(first)
        assert bytes(handle.buffer) == payload_for(first, CHUNK)
        tier.release(handle)

    def test_an_expired_lease_is_counted_and_no_longer_protects_its_object(
        self, tier: Tier, clock: FakeClock
    ) -> None:
        """A client that pinned and died must not keep the object (and its room) forever. The pin is
        uncounted, so the tier's own use order, not a read, decides what is evicted next."""
        first = make_key(0)
        tier.put(first, payload_for(first, CHUNK))
        handle = tier.pin(first, count=False)
        assert handle is not None
        clock.advance(AGES)
        self.fill(tier, range(1, 3 * BUDGET // CHUNK))
        assert tier.stats.snapshot()["expired_leases"] == 1
        assert not tier.contains(first)
        tier.release(handle)  # releasing an expired lease is harmless

    def test_every_removal_is_told_to_the_stats_listener(self, tier: Tier) -> None:
        """``stats.listener`` hears of each key that leaves, and why (the server's explain uses it)."""
        heard: list[tuple[ObjectKey, EvictionReason]] = []
        tier.stats.listener = lambda keys, reason: heard.extend((key, reason) for key in keys)
        tier.put(make_key(0), b"x" * 100)
        tier.delete(make_key(0))
        assert heard == [(make_key(0), EvictionReason.DELETED)]
        self.fill(tier, range(1, 3 * BUDGET // CHUNK))
        evicted = [key for key, reason in heard if reason is EvictionReason.CAPACITY]
        assert evicted and all(not tier.contains(key) for key in evicted)
        assert len(evicted) == tier.stats.snapshot()["evictions"][EvictionReason.CAPACITY.value]

    def test_capacity_evictions_are_handed_to_the_eviction_listener_or_refused(self, tier: Tier) -> None:
        """Write-back needs each evicted object's verified bytes; a tier that cannot hand them
        over refuses the listener, so write-back fails at start-up instead of silently never writing."""
        handed: list[tuple[ObjectKey, bytes]] = []

        def listener(key: ObjectKey, payload: memoryview) -> None:
            handed.append((key, bytes(payload)))

        if not self.hands_over_evictions:
            with pytest.raises(TierError):
                tier.set_eviction_listener(listener)
            return
        tier.set_eviction_listener(listener)
        self.fill(tier, range(3 * BUDGET // CHUNK))
        assert handed
        assert len(handed) == tier.stats.snapshot()["evictions"][EvictionReason.CAPACITY.value]
        for key, payload in handed:
            assert payload == payload_for(key, CHUNK)
            assert not tier.contains(key)
        tier.set_eviction_listener(None)
        count = len(handed)
        self.fill(tier, range(100, 100 + BUDGET // CHUNK))
        assert len(handed) == count  # removed: no longer called

    # -- manifests ----------------------------------------------------------------------------
    def test_manifests_are_kept_beside_the_data_where_the_tier_persists(self, tier: Tier) -> None:
        fp = Fingerprint(b"M" * 16)
        tier.put_manifest(fp, b'{"model": "m"}')
        if self.persistent:
            assert tier.get_manifest(fp) == b'{"model": "m"}'
            assert dict(tier.iter_manifests()) == {fp: b'{"model": "m"}'}
        else:
            assert tier.get_manifest(fp) is None
            assert list(tier.iter_manifests()) == []
        assert tier.get_manifest(Fingerprint(b"N" * 16)) is None


class PersistentTierSuite(TierSuite):
    """The contract of a tier that keeps objects at rest (L2, L3): they survive a restart, and bytes
    damaged at rest are caught by the tier's own checks. :meth:`damage` is the fixture's to write."""

    persistent = True

    def damage(self, tier: Tier, key: ObjectKey) -> None:
        """Change the bytes stored for ``key`` at rest, below the tier's own checks."""
        raise NotImplementedError

    # -- verification -------------------------------------------------------------------------
    def test_a_damaged_object_is_a_counted_miss_and_is_deleted(self, tier: Tier) -> None:
        """Never wrong: bytes that fail verification are never returned, by any read."""
        key, other = make_key(1), make_key(2)
        tier.put(key, payload_for(key, 4096))
        tier.put(other, payload_for(other, 4096))
        self.damage(tier, key)
        heard: list[tuple[ObjectKey, EvictionReason]] = []
        tier.stats.listener = lambda keys, reason: heard.extend((k, reason) for k in keys)
        assert tier.get(key) is None
        stats = tier.stats.snapshot()
        assert stats["verify_failures"] == 1
        assert stats["evictions"].get(EvictionReason.CORRUPT.value) == 1
        assert heard == [(key, EvictionReason.CORRUPT)]
        assert not tier.contains(key)
        assert tier.get(other) == payload_for(other, 4096)  # its neighbour is untouched

    def test_read_into_of_a_damaged_object_is_a_miss_too(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, payload_for(key, 4096))
        self.damage(tier, key)
        out = bytearray(8192)
        assert tier.read_into(key, lambda n: memoryview(out)[:n]) is None
        assert tier.stats.snapshot()["verify_failures"] == 1
        assert not tier.contains(key)

    # -- restart ------------------------------------------------------------------------------
    def test_committed_objects_and_manifests_survive_a_restart(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        first = self.make_tier(tmp_path, clock, BUDGET)
        keys = [make_key(i) for i in range(5)]
        for key in keys:
            first.put(key, payload_for(key, 1000 + key.prefix_hash[-1]))
        first.put_manifest(Fingerprint(b"M" * 16), b"{}")
        abandoned = first.reserve(make_key(50), 100)
        abandoned.buffer[:] = b"z" * 100
        first.flush()
        first.close()
        second = self.make_tier(tmp_path, clock, BUDGET)
        try:
            for key in keys:
                assert second.get(key) == payload_for(key, 1000 + key.prefix_hash[-1])
            assert second.get(make_key(50)) is None
            assert second.usage().objects == 5
            assert second.get_manifest(Fingerprint(b"M" * 16)) == b"{}"
        finally:
            second.close()


class FrontTierSuite(TierSuite):
    """The contract of the engine's first tier (:class:`~tiercache.tier.FrontTier`): an object a
    lower tier is still owed is never evicted until the engine settles the debt."""

    @pytest.fixture
    def tier(self, tmp_path: Path, clock: FakeClock) -> Iterator[Tier]:
        t = self.make_tier(tmp_path, clock, BUDGET)
        assert isinstance(t, FrontTier), "a FrontTierSuite needs a FrontTier"
        yield t
        t.close()

    def test_an_owed_object_outlives_any_churn(self, tier: FrontTier) -> None:
        owed = make_key(0)
        tier.put(owed, payload_for(owed, CHUNK), owed=True)
        self.fill(tier, range(1, 3 * BUDGET // CHUNK))
        assert self.peek(tier, owed) == payload_for(owed, CHUNK)

    def test_an_owed_commit_is_owed_too(self, tier: FrontTier) -> None:
        owed = make_key(0)
        handle = tier.reserve(owed, CHUNK)
        handle.buffer[:] = payload_for(owed, CHUNK)
        tier.commit(handle, owed=True)
        self.fill(tier, range(1, 3 * BUDGET // CHUNK))
        assert self.peek(tier, owed) == payload_for(owed, CHUNK)

    def test_a_key_is_being_written_from_its_reservation_until_commit_or_abort(self, tier: FrontTier) -> None:
        first, second, idle = make_key(0), make_key(1), make_key(2)
        assert tier.writing_many([first, second, idle]) == [False, False, False]
        one, two = tier.reserve(first, CHUNK), tier.reserve(second, CHUNK)
        assert tier.writing_many([first, second, idle]) == [True, True, False]
        assert not tier.wait_written([first], 0.01)  # still open: the wait gives up at its bound
        one.buffer[:] = payload_for(first, CHUNK)
        tier.commit(one)
        tier.abort(two)
        assert tier.writing_many([first, second]) == [False, False]
        assert tier.wait_written([first, second], 0.01)

    def test_an_expired_reservation_is_no_longer_being_written(
        self, tier: FrontTier, clock: FakeClock
    ) -> None:
        tier.reserve(make_key(0), CHUNK)
        clock.advance(AGES)
        assert tier.writing_many([make_key(0)]) == [False]

    def test_two_writers_of_one_key_keep_it_being_written_until_both_end(self, tier: FrontTier) -> None:
        key = make_key(0)
        one, two = tier.reserve(key, CHUNK), tier.reserve(key, CHUNK)
        tier.abort(one)
        assert tier.writing_many([key]) == [True]
        tier.commit(two)
        assert tier.writing_many([key]) == [False]

    def test_when_everything_is_owed_a_reservation_is_refused_until_one_is_settled(
        self, tier: FrontTier
    ) -> None:
        for i in range(BUDGET // CHUNK):
            tier.put(make_key(i), payload_for(make_key(i), CHUNK), owed=True)
        with pytest.raises(TierFullError):
            tier.reserve(make_key(99), CHUNK)
        tier.settle(make_key(3))
        tier.commit(tier.reserve(make_key(99), CHUNK))  # settling made room: the settled one went
        assert not tier.contains(make_key(3))
        assert all(tier.contains(make_key(i)) for i in range(BUDGET // CHUNK) if i != 3)

    def test_a_batch_reservation_is_all_or_nothing(self, tier: FrontTier) -> None:
        batch = [make_key(i) for i in range(3)]
        for key, handle in zip(batch, tier.reserve_many([(k, CHUNK) for k in batch]), strict=True):
            handle.buffer[:] = payload_for(key, CHUNK)
            tier.commit(handle)
        assert all(tier.contains(k) for k in batch)
        owed = [make_key(10 + i) for i in range(BUDGET // CHUNK)]
        for key in owed:  # every byte owed to a lower tier: nothing may be evicted
            tier.put(key, payload_for(key, CHUNK), owed=True)
        tier.settle(owed[0])  # room for one more object, not two
        wanted = [make_key(90), make_key(91)]
        with pytest.raises(TierFullError):
            tier.reserve_many([(k, CHUNK) for k in wanted])
        assert tier.writing_many(wanted) == [False, False]  # the one that fitted was given back
        assert not any(tier.contains(k) for k in wanted)
