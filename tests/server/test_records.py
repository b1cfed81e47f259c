"""The server's record of recent evictions (what ``explain`` says of a chunk that is gone)."""

from __future__ import annotations

from tiercache.keys import Fingerprint, ObjectKey
from tiercache.server.records import EvictionRecord
from tiercache.tier import EvictionReason


def key(i: int) -> ObjectKey:
    return ObjectKey(Fingerprint(b"F" * 16), 0, i.to_bytes(16, "big"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_evicted_key_is_noted_with_its_tier_reason_and_time() -> None:
    clock = Clock()
    record = EvictionRecord(capacity=10, clock=clock)
    record.listener("l1")([key(1), key(2)], EvictionReason.CAPACITY)
    clock.now = 107.0
    note = record.get(key(2))
    assert note is not None
    assert (note.tier, note.reason) == ("l1", EvictionReason.CAPACITY.value)
    assert record.age(note) == 7.0
    assert record.get(key(3)) is None


def test_the_oldest_notes_go_past_the_capacity_and_a_key_evicted_again_is_new() -> None:
    clock = Clock()
    record = EvictionRecord(capacity=4, clock=clock)
    l1, disk = record.listener("l1"), record.listener("disk")
    l1([key(1), key(2), key(3)], EvictionReason.CAPACITY)
    clock.now = 101.0
    disk([key(1), key(4), key(5)], EvictionReason.CAPACITY)  # key 1 again: now the newest
    assert len(record) == 4
    assert record.get(key(2)) is None  # the oldest went
    assert [record.get(key(i)) is not None for i in (1, 3, 4, 5)] == [True] * 4
    again = record.get(key(1))
    assert again is not None and (again.tier, again.at) == ("disk", 101.0)
    l1([key(6), key(7)], EvictionReason.CAPACITY)
    assert record.get(key(3)) is None and record.get(key(4)) is None
    assert record.get(key(1)) is not None  # kept: noted after 3 and 4
