"""The conformance suite every tier passes.

A tier's test module subclasses :class:`TierContract` and implements :meth:`make_tier`; pytest then
runs every test below against it. Persistent tiers also set ``persistent = True`` and the restart tests
reopen the same storage with a second :meth:`make_tier` call.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import FakeClock, make_key, payload_for
from tiercache.errors import ReservationError, TierFullError
from tiercache.tier import EvictionReason, Tier

CHUNK = 64 * 1024
BUDGET = 16 * CHUNK


class TierContract:
    persistent: bool = False

    def make_tier(self, tmp_path: Path, clock: FakeClock, budget: int) -> Tier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path: Path, clock: FakeClock):
        t = self.make_tier(tmp_path, clock, BUDGET)
        yield t
        t.close()

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
        clock.advance(3600)
        with pytest.raises(ReservationError):
            tier.commit(handle)
        assert tier.get(key) is None

    def test_an_object_larger_than_the_budget_is_refused(self, tier: Tier) -> None:
        with pytest.raises(TierFullError):
            tier.reserve(make_key(1), BUDGET + 1)

    def test_read_into_copies_the_payload_into_the_callers_buffer(self, tier: Tier) -> None:
        key = make_key(1)
        tier.put(key, payload_for(key, 3000))
        out = bytearray(5000)
        sizes: list[int] = []

        def alloc(n: int) -> memoryview:
            sizes.append(n)
            return memoryview(out)[:n]

        assert tier.read_into(key, alloc) is True
        assert sizes == [3000]
        assert bytes(out[:3000]) == payload_for(key, 3000)
        assert tier.read_into(make_key(2), alloc) is False
        assert sizes == [3000]  # a miss never asks for a buffer

    def test_contains_many_answers_for_each_key(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(5)]
        for key in keys[1:4:2]:
            tier.put(key, b"c" * 32)
        assert tier.contains_many(keys) == [False, True, False, True, False]
        assert tier.contains_many([]) == []

    def test_batches_reserve_commit_pin_and_release_many_objects(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(4)]
        handles = tier.reserve_many([(key, 100 + i) for i, key in enumerate(keys)])
        for i, handle in enumerate(handles):
            handle.buffer[:] = payload_for(keys[i], 100 + i)
        tier.commit_many(handles)
        pinned = tier.pin_many([*keys, make_key(99)])
        assert pinned[-1] is None
        assert [bytes(h.buffer) for h in pinned[:-1] if h] == [
            payload_for(k, 100 + i) for i, k in enumerate(keys)
        ]
        tier.release_many([h for h in pinned if h])

    def test_a_batch_that_does_not_fit_reserves_nothing(self, tier: Tier) -> None:
        before = tier.usage().bytes_used
        with pytest.raises(TierFullError):
            tier.reserve_many([(make_key(1), 100), (make_key(2), BUDGET + 1)])
        assert tier.usage().bytes_used == before

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
        for i in range(3 * BUDGET // CHUNK):
            key = make_key(i)
            tier.put(key, payload_for(key, CHUNK))
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
        for i in range(1, 3 * BUDGET // CHUNK):
            key = make_key(i)
            tier.put(key, payload_for(key, CHUNK))
        assert bytes(handle.buffer) == payload_for(first, CHUNK)
        tier.release(handle)

    def test_lookup_prefix_counts_leading_present_keys(self, tier: Tier) -> None:
        keys = [make_key(i) for i in range(6)]
        for key in keys[:4]:
            tier.put(key, b"p" * 64)
        assert tier.lookup_prefix(keys) == 4
        assert tier.lookup_prefix(keys[:2]) == 2
        assert tier.lookup_prefix([]) == 0
        assert tier.lookup_prefix(keys[4:]) == 0

    # -- restart ------------------------------------------------------------------------------
    def test_committed_objects_survive_a_restart(
        self, tmp_path: Path, clock: FakeClock
    ) -> None:
        if not self.persistent:
            pytest.skip("this tier is not persistent by design")
        first = self.make_tier(tmp_path, clock, BUDGET)
        keys = [make_key(i) for i in range(5)]
        for key in keys:
            first.put(key, payload_for(key, 1000 + key.prefix_hash[-1]))
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
        finally:
            second.close()
