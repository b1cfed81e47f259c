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


def test_the_oldest_notes_go_past_the_capacity_and_a_key_evicted_again_is_new() -> None:
    clock = FakeClock(100.0)
    record = EvictionRecord(capacity=4, clock=clock)
    l1, disk = record.listener("l1"), record.listener("disk")
    l1([make_key(1), make_key(2), make_key(3)], EvictionReason.CAPACITY)
    clock.advance(1)
    disk([make_key(1), make_key(4), make_key(5)], EvictionReason.CAPACITY)  # key 1 again: the newest
    assert len(record) == 4
    assert record.get(make_key(2)) is None  # the oldest went
    assert [record.get(make_key(i)) is not None for i in (1, 3, 4, 5)] == [True] * 4
    again = record.get(make_key(1))
    assert again is not None and (again.tier, again.at) == ("disk", 101.0)
    l1([make_key(6), make_key(7)], EvictionReason.CAPACITY)
    assert record.get(make_key(3)) is None and record.get(make_key(4)) is None
    assert record.get(make_key(1)) is not None  # kept: noted after 3 and 4
