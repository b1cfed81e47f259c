"""L1-specific behaviour beyond the shared contract: batches, owed entries, leases, versions, policies."""

from __future__ import annotations

import pytest

from tests.conftest import FakeClock, make_key, payload_for
from tiercache.config import EvictionPolicyName
from tiercache.errors import LeaseError, ReservationError, TierError, TierFullError
from tiercache.tier import EvictionReason

KiB = 1024
UNIT = 4 * KiB  # the default alignment: one slot per UNIT-sized object


def fill(tier, keys: range, size: int = UNIT) -> None:
    for i in keys:
        key = make_key(i)
        tier.put(key, payload_for(key, size))


# -- batches: one lock round trip per request of many chunks ----------------------------------------
def test_batches_reserve_commit_pin_and_release_many_objects(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT)
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


def test_a_batch_that_does_not_fit_reserves_nothing(make_l1) -> None:
    tier = make_l1(size_bytes=16 * UNIT)
    before = tier.usage().bytes_used
    with pytest.raises(TierFullError):
        tier.reserve_many([(make_key(1), 100), (make_key(2), 17 * UNIT)])
    assert tier.usage().bytes_used == before


# -- owed entries (the eviction rule itself is in the FrontTier suite) --------------------------------
def test_when_everything_is_owed_a_reservation_fails_and_says_why(make_l1) -> None:
    tier = make_l1(size_bytes=2 * UNIT)
    for i in range(2):
        tier.put(make_key(i), b"x" * UNIT, owed=True)
    with pytest.raises(TierFullError, match="2 owed to a lower tier"):
        tier.reserve(make_key(9), UNIT)
    assert tier.stats.snapshot()["skipped"] == 1


def test_when_everything_is_pinned_a_reservation_fails_and_says_why(make_l1) -> None:
    tier = make_l1(size_bytes=2 * UNIT)
    fill(tier, range(2))
    handles = [tier.pin(make_key(i)) for i in range(2)]
    with pytest.raises(TierFullError, match="2 objects pinned"):
        tier.reserve(make_key(9), UNIT)
    for h in handles:
        tier.release(h)
    tier.reserve(make_key(9), UNIT)  # room can be made again


def test_an_object_larger_than_the_arena_is_refused_with_the_fix(make_l1) -> None:
    tier = make_l1(size_bytes=2 * UNIT)
    with pytest.raises(TierFullError, match="larger than the L1 arena"):
        tier.reserve(make_key(1), 2 * UNIT + 1)


# -- leases ------------------------------------------------------------------------------------------
def test_an_expired_lease_is_counted_and_no_longer_protects(make_l1, clock: FakeClock) -> None:
    tier = make_l1(size_bytes=2 * UNIT, lease_ttl_s=10.0)
    key = make_key(0)
    tier.put(key, payload_for(key, UNIT))
    handle = tier.pin(key)
    assert handle is not None
    clock.advance(9.0)
    fill(tier, range(1, 5))
    assert tier.contains(key)  # still leased: survived the churn
    clock.advance(1.0)
    fill(tier, range(5, 9))
    assert not tier.contains(key)
    assert tier.stats.snapshot()["expired_leases"] == 1
    tier.release(handle)  # after expiry: harmless
    with pytest.raises(LeaseError, match="pin the key again"):
        tier.slot_of(handle)


def test_a_batch_of_holds_expires_together_each_lease_counted(make_l1, clock: FakeClock) -> None:
    """The engine's holds of many keys (a ticket) share one deadline: every one of them expires
    at it, each counted, and none protects its object after; a released one is not counted."""
    tier = make_l1(size_bytes=8 * UNIT, lease_ttl_s=10.0)
    keys = [make_key(i) for i in range(4)]
    fill(tier, range(4))
    held = tier.pin_many([*keys, make_key(99)], count=False)
    assert held[-1] is None and all(held[:-1])
    assert [bytes(h.buffer) for h in held[:-1] if h] == [payload_for(k, UNIT) for k in keys]
    tier.release_many([held[0]])  # type: ignore[list-item]
    clock.advance(10.0)
    fill(tier, range(10, 18))  # churn through the whole arena
    assert not any(tier.contains(k) for k in keys)
    assert tier.stats.snapshot()["expired_leases"] == 3
    assert tier.release_many([h for h in held if h]) == [False] * 4  # gone: none still held


def test_lease_slots_names_each_open_lease_and_refuses_a_closed_one(make_l1) -> None:
    tier = make_l1(size_bytes=8 * UNIT)
    keys = [make_key(i) for i in range(3)]
    fill(tier, range(3))
    held = [h for h in tier.pin_many(keys, count=False) if h]
    built = tier.lease_slots(held, lambda raw, offset, nbytes, token, digest: (raw, offset, nbytes, token))
    for handle, (raw, offset, nbytes, token) in zip(held, built, strict=True):
        where = tier.slot_of(handle)
        assert (raw, offset, nbytes, token) == (
            handle.key.to_bytes(),
            where.offset,
            where.nbytes,
            handle.token,
        )
    tier.release(held[1])
    with pytest.raises(LeaseError, match="pin the key again"):
        tier.lease_slots(held, lambda *a: a)


# -- holds of many objects as one lease (a lookup ticket's) ------------------------------------------
def test_pin_all_holds_every_object_or_none(make_l1) -> None:
    tier = make_l1(size_bytes=8 * UNIT)
    keys = [make_key(i) for i in range(3)]
    fill(tier, range(3))
    assert tier.pin_all([k.raw for k in [*keys, make_key(99)]]) is None  # one absent: nothing held
    assert tier.pin_all([k.raw for k in [keys[0], make_key(99), keys[1]]]) is None  # wherever it is
    fill(tier, range(3, 8))  # nothing was left pinned: the arena churns freely
    fill(tier, range(3))
    held = tier.pin_all([k.raw for k in keys])
    assert held is not None and held.count == 3
    fill(tier, range(10, 30))  # churn through the arena: the held objects stay
    assert all(tier.contains(k) for k in keys)
    assert tier.release_all(held) == 0
    fill(tier, range(30, 50))
    assert not any(tier.contains(k) for k in keys)
    assert tier.release_all(held) == 3  # twice: harmless, and said to hold nothing


def test_held_slots_and_columns_name_each_object_under_the_hold_token_and_refuse_a_released_hold(
    make_l1,
) -> None:
    tier = make_l1(size_bytes=8 * UNIT)
    keys = [make_key(i) for i in (2, 0, 1)]
    fill(tier, range(3))
    held = tier.pin_all([k.raw for k in keys])
    assert held is not None
    built = tier.held_slots(held, lambda *fields: fields)
    leases = [h for h in tier.pin_many(keys) if h]
    expected = [
        (k.to_bytes(), tier.slot_of(h).offset, UNIT, held.token, h.digest)
        for k, h in zip(keys, leases, strict=True)
    ]
    assert built == expected  # in the keys' order, with each writer's digest
    keys_raw, offsets, sizes, _tokens, digests = zip(*expected, strict=True)
    assert tier.held_columns(held) == (list(keys_raw), list(offsets), list(sizes), list(digests))
    tier.release_many(leases)
    tier.release_all(held)
    with pytest.raises(LeaseError, match="pin the keys again"):
        tier.held_slots(held, lambda *fields: fields)
    with pytest.raises(LeaseError, match="pin the keys again"):
        tier.held_columns(held)


def test_a_hold_expires_as_a_whole_each_object_counted(make_l1, clock: FakeClock) -> None:
    tier = make_l1(size_bytes=8 * UNIT, lease_ttl_s=10.0)
    keys = [make_key(i) for i in range(4)]
    fill(tier, range(4))
    held = tier.pin_all([k.raw for k in keys])
    assert held is not None and held.expires_at == clock() + 10.0
    clock.advance(9.0)
    fill(tier, range(10, 18))
    assert all(tier.contains(k) for k in keys)  # still held
    clock.advance(1.0)
    fill(tier, range(20, 28))
    assert not any(tier.contains(k) for k in keys)
    assert tier.stats.snapshot()["expired_leases"] == 4
    assert tier.release_all(held) == 4  # expired first: the reader may not trust its copies


def test_an_object_replaced_while_held_keeps_its_bytes_until_the_hold_ends(make_l1) -> None:
    tier = make_l1(size_bytes=4 * UNIT)
    key = make_key(0)
    tier.put(key, b"a" * UNIT)
    held = tier.pin_all([key.raw])
    assert held is not None
    [(_, offset, nbytes, _, _)] = tier.held_slots(held, lambda *fields: fields)
    tier.put(key, b"b" * UNIT)  # a new version: the held one is hidden, not freed
    assert bytes(tier.arena.view(offset, nbytes)) == b"a" * UNIT
    assert tier.free_bytes() == 2 * UNIT
    assert tier.release_all(held) == 0
    assert tier.free_bytes() == 3 * UNIT  # freed at the release
    assert tier.get(key) == b"b" * UNIT


@pytest.mark.parametrize("end", ["release", "expiry"])
def test_a_replaced_object_a_hold_names_twice_is_freed_once_when_the_hold_ends(
    make_l1, clock: FakeClock, end: str
) -> None:
    tier = make_l1(size_bytes=4 * UNIT, lease_ttl_s=10.0)
    key, other = make_key(0), make_key(1)
    tier.put(key, b"a" * UNIT)
    tier.put(other, b"o" * UNIT)
    held = tier.pin_all([key.raw, other.raw, key.raw])  # a client may name a chunk twice
    assert held is not None and held.count == 3
    tier.put(key, b"b" * UNIT)  # the held version is hidden, pinned twice
    assert tier.free_bytes() == UNIT
    if end == "release":
        assert tier.release_all(held) == 0
    else:
        clock.advance(10.0)
        tier.put(make_key(2), b"c" * UNIT)  # the sweep ends the hold
    # Freed once (a second free raises: it would hand the same bytes to two objects).
    assert tier.free_bytes() == (2 if end == "release" else 1) * UNIT
    assert tier.get(key) == b"b" * UNIT


@pytest.mark.parametrize("read", [True, False], ids=["read", "unread"])
def test_a_hold_released_as_read_counts_each_object_as_a_hit(make_l1, read: bool) -> None:
    tier = make_l1(size_bytes=4 * UNIT, eviction_policy=EvictionPolicyName.LRU)
    fill(tier, range(2))
    before = tier.stats.snapshot()["hits"]
    held = tier.pin_all([make_key(0).raw])
    assert held is not None and tier.stats.snapshot()["hits"] == before  # uncounted until read
    assert tier.release_all(held, read=read) == 0
    assert tier.stats.snapshot()["hits"] - before == (1 if read else 0)
    fill(tier, range(2, 5))  # one more than fits: the least recently used goes
    assert tier.contains(make_key(0)) is read and tier.contains(make_key(1)) is not read


def test_committed_keys_finds_committed_objects_by_their_binary_key(make_l1) -> None:
    tier = make_l1(size_bytes=8 * UNIT)
    fill(tier, range(2))
    tier.reserve(make_key(5), UNIT)  # being written: not committed
    found = tier.committed_keys([make_key(i).to_bytes() for i in (0, 5, 1, 7)])
    assert found == [make_key(0), None, make_key(1), None]


def test_a_new_version_is_read_through_its_own_view_and_the_old_pin_keeps_its_bytes(make_l1) -> None:
    """Leases of one slot share its read-only view; a new version of the key is another slot."""
    tier = make_l1(size_bytes=8 * UNIT)
    key = make_key(0)
    tier.put(key, b"a" * UNIT)
    first, second = tier.pin(key), tier.pin_many([key], count=False)[0]
    assert first is not None and second is not None and bytes(second.buffer) == b"a" * UNIT
    tier.put(key, b"b" * UNIT)
    third = tier.pin(key)
    assert third is not None and bytes(third.buffer) == b"b" * UNIT
    assert bytes(first.buffer) == bytes(second.buffer) == b"a" * UNIT
    with pytest.raises(TypeError):
        second.buffer[0] = 0  # read-only, like every pin's
    tier.release_many([first, second, third])


def test_each_pin_is_its_own_lease(make_l1) -> None:
    tier = make_l1(size_bytes=2 * UNIT)
    key = make_key(0)
    tier.put(key, payload_for(key, UNIT))
    first, second = tier.pin(key), tier.pin(key)
    tier.release(first)
    fill(tier, range(1, 5))
    assert bytes(second.buffer) == payload_for(key, UNIT)  # still pinned by the second lease
    tier.release(second)
    fill(tier, range(5, 9))
    assert not tier.contains(key)


def test_pinned_buffers_are_read_only(make_l1) -> None:
    tier = make_l1()
    key = make_key(0)
    tier.put(key, b"abc")
    handle = tier.pin(key)
    assert handle.buffer.readonly
    tier.release(handle)


# -- reservations ------------------------------------------------------------------------------------
def test_an_expired_reservation_is_freed_and_counted(make_l1, clock: FakeClock) -> None:
    tier = make_l1(size_bytes=2 * UNIT, reservation_ttl_s=5.0)
    handle = tier.reserve(make_key(0), 2 * UNIT)
    assert tier.free_bytes() == 0
    clock.advance(5.0)
    assert tier.free_bytes() == 2 * UNIT
    assert tier.stats.snapshot()["expired_reservations"] == 1
    with pytest.raises(ReservationError, match="reserve again"):
        tier.commit(handle)
    tier.abort(handle)  # harmless


def test_open_reservations_are_not_evicted(make_l1) -> None:
    tier = make_l1(size_bytes=2 * UNIT)
    handle = tier.reserve(make_key(0), UNIT)
    handle.buffer[:] = b"r" * UNIT
    fill(tier, range(1, 6))
    tier.commit(handle)
    assert tier.get(make_key(0)) == b"r" * UNIT


def test_slot_of_gives_the_offset_and_size_workers_copy(make_l1) -> None:
    tier = make_l1()
    key = make_key(0)
    handle = tier.reserve(key, 1000)
    slot = tier.slot_of(handle)
    assert slot.nbytes == 1000 and slot.offset % UNIT == 0
    tier.arena.view(slot.offset, slot.nbytes)[:] = payload_for(key, 1000)
    tier.commit(handle)
    assert tier.get(key) == payload_for(key, 1000)
    with pytest.raises(ReservationError):
        tier.slot_of(handle)


# -- versions ----------------------------------------------------------------------------------------
def test_overwriting_a_pinned_object_keeps_the_old_bytes_for_the_pin_holder(make_l1) -> None:
    tier = make_l1(size_bytes=4 * UNIT)
    key = make_key(0)
    tier.put(key, b"old" * 1000)
    handle = tier.pin(key)
    tier.put(key, b"new" * 1000)
    fill(tier, range(1, 10))  # churn: the old slot must not be reused while pinned
    assert bytes(handle.buffer) == b"old" * 1000
    assert tier.get(key) in (None, b"new" * 1000)
    tier.release(handle)
    tier.put(key, b"new" * 1000)
    assert tier.get(key) == b"new" * 1000
    assert tier.usage().objects <= 4


def test_the_old_version_is_freed_when_its_pin_ends(make_l1) -> None:
    tier = make_l1(size_bytes=4 * UNIT)
    key = make_key(0)
    tier.put(key, b"a" * UNIT)
    handle = tier.pin(key)
    tier.put(key, b"b" * UNIT)
    assert tier.free_bytes() == 2 * UNIT
    tier.release(handle)
    assert tier.free_bytes() == 3 * UNIT
    assert tier.usage().bytes_used == UNIT


def test_delete_while_pinned_hides_now_and_frees_at_release(make_l1) -> None:
    tier = make_l1(size_bytes=4 * UNIT)
    key = make_key(0)
    tier.put(key, b"d" * UNIT)
    handle = tier.pin(key)
    assert tier.delete(key) is True
    assert not tier.contains(key) and tier.get(key) is None
    assert bytes(handle.buffer) == b"d" * UNIT
    assert tier.free_bytes() == 3 * UNIT
    tier.release(handle)
    assert tier.free_bytes() == 4 * UNIT
    assert tier.stats.snapshot()["evictions"] == {EvictionReason.DELETED.value: 1}


# -- eviction policy ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "survives"),
    [(EvictionPolicyName.S3FIFO, True), (EvictionPolicyName.LRU, False)],
)
def test_a_hot_shared_prefix_survives_a_scan_of_one_off_prompts_only_with_s3fifo(
    make_l1, policy: EvictionPolicyName, survives: bool
) -> None:
    tier = make_l1(size_bytes=16 * UNIT, eviction_policy=policy)
    hot = make_key(0)
    tier.put(hot, payload_for(hot, UNIT))
    assert tier.get(hot) is not None and tier.get(hot) is not None  # reused
    fill(tier, range(1, 200))  # one-off prompts, each stored once, never read
    assert tier.contains(hot) is survives
    if survives:
        assert tier.get(hot) == payload_for(hot, UNIT)


@pytest.mark.parametrize("read", [True, False], ids=["read", "unread"])
def test_an_uncounted_hold_released_as_read_counts_as_the_pin_it_stood_for(make_l1, read: bool) -> None:
    """A lookup ticket's holds (``count=False``) that a client copied from: released as read, each
    is one hit and one access for the eviction policy, as the client's own pin would have been;
    released unread, nothing. Under LRU the read object then outlives an older unread one."""
    tier = make_l1(size_bytes=4 * UNIT, eviction_policy=EvictionPolicyName.LRU)
    fill(tier, range(2))
    before = tier.stats.snapshot()["hits"]
    [held] = tier.pin_many([make_key(0)], count=False)
    assert held is not None
    assert tier.release_many([held], read=read) == [True]
    assert tier.stats.snapshot()["hits"] - before == (1 if read else 0)
    fill(tier, range(2, 5))  # one more than fits: the least recently used goes
    assert tier.contains(make_key(0)) is read and tier.contains(make_key(1)) is not read


def test_eviction_frees_contiguous_room_for_a_large_object(make_l1) -> None:
    tier = make_l1(size_bytes=8 * UNIT)
    fill(tier, range(8))
    big = make_key(100)
    tier.put(big, payload_for(big, 5 * UNIT))
    assert tier.get(big) == payload_for(big, 5 * UNIT)
    assert tier.stats.snapshot()["evictions"][EvictionReason.CAPACITY.value] >= 5


# -- lifecycle ---------------------------------------------------------------------------------------
def test_a_closed_tier_refuses_work_but_release_and_abort_stay_harmless(make_l1) -> None:
    tier = make_l1()
    key = make_key(0)
    tier.put(key, b"x")
    pinned = tier.pin(key)
    pending = tier.reserve(make_key(1), 10)
    tier.close()
    tier.release(pinned)
    tier.abort(pending)
    with pytest.raises(TierError, match="closed"):
        tier.reserve(key, 1)
    with pytest.raises(TierError, match="closed"):
        tier.pin(key)


def test_concurrent_writers_and_readers_only_ever_see_whole_committed_objects(make_l1) -> None:
    import threading

    tier = make_l1(size_bytes=32 * UNIT, eviction_policy=EvictionPolicyName.S3FIFO)
    errors: list[str] = []

    def work(worker: int) -> None:
        for round_ in range(200):
            key = make_key((worker * 7 + round_) % 24)
            try:
                tier.put(key, payload_for(key, UNIT + round_))
            except TierFullError:
                pass
            handle = tier.pin(key)
            if handle is not None:
                data = bytes(handle.buffer)
                if data != payload_for(key, len(data)):
                    errors.append(f"{key}: torn or foreign bytes")
                tier.release(handle)

    threads = [threading.Thread(target=work, args=(w,), name=f"l1-test-{w}") for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.usage().bytes_used <= 32 * UNIT
