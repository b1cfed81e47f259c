"""The server's record of recent evictions (what ``explain`` says of a chunk that is gone)."""

from __future__ import annotations

from tiercache.server.records import EvictionRecord
from tiercache.testing.fixtures import FakeClock, make_key
from tiercache.tier import EvictionReason


def test_each_evicted_key_is_noted_with_its_tier_reason_and_time() -> None:
    clock = FakeClock(100.0)
    record = EvictionRecord(capacity=10, clock=clock)
    record.listener("l1")([make_key(1), make_key(2)], EvictionReason.CAPACITY)
    clock.advance(7)
    note = record.get(make_key(2))
    assert note is not None
    assert (note.tier, note.reason) == ("l1", EvictionReason.CAPACITY.value)
    assert record.age(note) == 7.0
    assert record.get(make_key(3)) is None


def test_the_record_keeps_the_last_evictions_and_tells_a_key_by_its_newest() -> None:
    clock = FakeClock(100.0)
    record = EvictionRecord(capacity=4, clock=clock)
    l1, disk = record.listener("l1"), record.listener("disk")
    l1([make_key(1), make_key(2), make_key(3)], EvictionReason.CAPACITY)
    clock.advance(1)
    disk([make_key(1), make_key(4), make_key(5)], EvictionReason.CAPACITY)  # key 1 again
    assert len(record) == 4  # the last four evictions: 3 (of the first batch), 1, 4, 5
    assert record.get(make_key(2)) is None
    assert [record.get(make_key(i)) is not None for i in (1, 3, 4, 5)] == [True] * 4
    again = record.get(make_key(1))
    assert again is not None and (again.tier, again.at) == ("disk", 101.0)
    l1([make_key(6), make_key(7)], EvictionReason.CAPACITY)
    assert record.get_many([make_key(i) for i in range(1, 8)]) == [None, None, None] + [
        record.get(make_key(i)) for i in (4, 5, 6, 7)
    ]
    assert None not in record.get_many([make_key(i) for i in (4, 5, 6, 7)])


def test_a_batch_larger_than_the_record_keeps_its_last_keys() -> None:
    record = EvictionRecord(capacity=3, clock=FakeClock(0.0))
    record.listener("l1")([make_key(i) for i in range(10)], EvictionReason.CAPACITY)
    assert len(record) == 3
    assert [record.get(make_key(i)) is not None for i in range(10)] == [False] * 7 + [True] * 3
