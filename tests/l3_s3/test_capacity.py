"""Specification of the S3 tier's capacity index (:mod:`tiercache.l3_s3.capacity`): the same answers as
a plain dict of every object, in 48 bytes an object.

* membership, object count and bytes equal the model's after any sequence of writes, reads,
  deletions, evictions, restored deletions and merges (with or without a listing of the prefix);
* an eviction takes the oldest entries, never a skipped one, and no more than it needs;
* a merge's listing adds what other nodes wrote and drops what they deleted, but never overrides
  what this process did while the listing ran (written, read, deleted, evicted);
* a relisted object is aged by S3's time, or by this process's read if later.

No S3 here: the tier's tests (``test_s3_tier.py``, ``test_shared_capacity.py``) run the index
behind a real endpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache.keys import Fingerprint, ObjectKey
from tiercache.l3_s3.capacity import CapacityIndex, Listing, rebuild

POOL = [ObjectKey(Fingerprint(bytes(16)), 0, os.urandom(16)) for _ in range(24)]


class Clock:
    """Whole seconds, one per call: the order of events is the order of stamps."""

    def __init__(self, start: int = 1_000_000) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1
        return float(self.now)


def merged(index: CapacityIndex, listing: Listing | None = None, *, drop: bool = False) -> tuple[int, int]:
    """A whole merge, as the tier's index thread runs it: ``(added, dropped)``."""
    index.begin_rebuild()
    rebuilt = rebuild(index.freeze(), listing, drop_unlisted=drop)
    index.install(rebuilt)
    return rebuilt.added, rebuilt.dropped


def listing(*entries: tuple[ObjectKey, float, int]) -> Listing:
    out = Listing()
    for key, mtime, size in entries:
        out.add(key, mtime, size)
    return out


def test_an_eviction_takes_the_oldest_written_or_read_before_and_after_a_merge() -> None:
    index = CapacityIndex(clock=Clock())
    a, b, c, d = POOL[:4]
    for key in (a, b, c, d):
        index.set(key, 100)
    index.touch(a)  # read: now the youngest
    merged(index)
    assert [k for k, _ in index.take_oldest(150, lambda k: False)] == [b, c]
    index.set(b, 100)
    assert [k for k, _ in index.take_oldest(150, lambda k: k == d)] == [a, b]  # d skipped, not taken
    assert (len(index), index.bytes_used, d in index) == (1, 100, True)


def test_a_failed_deletion_is_put_back_as_the_oldest() -> None:
    index = CapacityIndex(clock=Clock())
    a, b = POOL[:2]
    index.set(a, 10)
    index.set(b, 10)
    [(victim, size)] = index.take_oldest(5, lambda k: False)
    index.restore_oldest(victim, size)
    assert [k for k, _ in index.take_oldest(5, lambda k: False)] == [a]
    index.restore_oldest(a, 10)
    merged(index)
    assert [k for k, _ in index.take_oldest(5, lambda k: False)] == [a]


def test_a_listing_adds_other_nodes_objects_drops_their_deletions_and_ages_by_s3s_time() -> None:
    clock = Clock()
    index = CapacityIndex(clock=clock)
    mine, read, deleted_elsewhere, theirs = POOL[:4]
    index.set(mine, 100)
    index.set(read, 100)
    index.set(deleted_elsewhere, 100)
    index.touch(read)
    merged(index)
    late = clock.now + 1_000  # S3's clock ahead of this node's: read stays older than that
    added, dropped = merged(
        index, listing((mine, late, 100), (read, 5.0, 100), (theirs, 7.0, 300)), drop=True
    )
    assert (added, dropped) == (1, 1)
    assert (len(index), index.bytes_used, deleted_elsewhere in index) == (3, 500, False)
    # theirs (7 s) is older than read (its read, later than S3's 5 s), older than mine (S3's time).
    assert [k for k, _ in index.take_oldest(10**6, lambda k: False)] == [theirs, read, mine]


def test_what_this_process_did_while_a_listing_ran_wins_over_the_listing() -> None:
    index = CapacityIndex(clock=Clock())
    written, deleted, evicted, kept = POOL[:4]
    for key in (deleted, evicted, kept):
        index.set(key, 100)
    merged(index)
    index.begin_rebuild()  # a relisting starts; the listing below is what S3 said meanwhile
    frozen = index.freeze()
    index.set(written, 50)
    index.forget(deleted)
    assert [k for k, _ in index.take_oldest(100, lambda k: k == deleted)] == [evicted]
    stale = listing((deleted, 1.0, 100), (evicted, 1.0, 100), (kept, 1.0, 100))  # lacks written
    index.install(rebuild(frozen, stale, drop_unlisted=True))
    assert (written in index, deleted in index, evicted in index, kept in index) == (True, False, False, True)
    assert (len(index), index.bytes_used) == (2, 150)


def test_fifty_thousand_objects_cost_48_bytes_each_in_the_columns() -> None:
    index = CapacityIndex()
    keys = ObjectKey.many(Fingerprint(bytes(16)), 0, [os.urandom(16) for _ in range(50_000)])
    merged(index, listing(*((k, 1_700_000_000.0 + i, 4096) for i, k in enumerate(keys))))
    assert (len(index), index.bytes_used) == (50_000, 50_000 * 4096)
    assert index.memory_bytes == 48 * 50_000


@dataclass
class Entry:
    size: int
    stamp: int
    read: bool = False


class IndexAgainstADict(RuleBasedStateMachine):
    """Random writes, reads, deletions, evictions, restores and merges against a dict model."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.index = CapacityIndex(clock=self.clock)
        self.index.install(rebuild(self.index.freeze(), None, drop_unlisted=False))  # start-up done
        self.model: dict[ObjectKey, Entry] = {}

    @rule(key=st.sampled_from(POOL), size=st.integers(1, 1000))
    def write(self, key: ObjectKey, size: int) -> None:
        self.index.set(key, size)
        self.model[key] = Entry(size, self.clock.now)

    @rule(key=st.sampled_from(POOL))
    def read(self, key: ObjectKey) -> None:
        self.index.touch(key)
        if key in self.model:
            self.model[key] = Entry(self.model[key].size, self.clock.now, read=True)

    @rule(key=st.sampled_from(POOL))
    def delete(self, key: ObjectKey) -> None:
        self.index.forget(key)
        self.model.pop(key, None)

    @rule(excess=st.integers(1, 3000), pinned=st.sets(st.sampled_from(POOL), max_size=4))
    def evict(self, excess: int, pinned: set[ObjectKey]) -> None:
        victims = self.index.take_oldest(excess, lambda k: k in pinned)
        taken = [k for k, _ in victims]
        assert not set(taken) & pinned and len(set(taken)) == len(taken)
        assert [s for _, s in victims] == [self.model[k].size for k in taken]
        freed = sum(s for _, s in victims)
        rest = {k: e for k, e in self.model.items() if k not in pinned and k not in taken}
        assert freed >= excess or not rest  # enough, unless nothing else may go
        assert not victims or freed - victims[-1][1] < excess  # and no more than needed
        if victims and rest:  # the oldest: no survivor older than a victim
            assert max(self.model[k].stamp for k in taken) <= min(e.stamp for e in rest.values())
        for key in taken:
            del self.model[key]

    @rule(key=st.sampled_from(POOL), size=st.integers(1, 1000))
    def restore(self, key: ObjectKey, size: int) -> None:
        self.index.restore_oldest(key, size)
        if key not in self.model:
            self.model[key] = Entry(size, -1)

    @rule()
    def merge(self) -> None:
        merged(self.index)

    @rule(
        listed=st.dictionaries(st.sampled_from(POOL), st.tuples(st.integers(0, 50), st.integers(1, 1000))),
        drop=st.booleans(),
        meanwhile=st.sampled_from(POOL),
    )
    def relist(self, listed: dict[ObjectKey, tuple[int, int]], drop: bool, meanwhile: ObjectKey) -> None:
        """A listing (S3's times far in the past, from 1,000,000 - 50 on), with one write while it ran."""
        base = 1_000_000 - 50
        self.index.begin_rebuild()
        frozen = self.index.freeze()
        self.index.set(meanwhile, 7)
        written = Entry(7, self.clock.now)
        self.index.install(
            rebuild(frozen, listing(*((k, base + t, s) for k, (t, s) in listed.items())), drop_unlisted=drop)
        )
        for key in list(self.model):
            if key in listed:
                entry = self.model[key]
                mtime = base + listed[key][0]
                entry.stamp = max(entry.stamp, mtime) if entry.read else mtime
            elif drop:
                del self.model[key]
        for key, (t, s) in listed.items():
            self.model.setdefault(key, Entry(s, base + t))
        self.model[meanwhile] = written

    @invariant()
    def same_objects_and_bytes(self) -> None:
        assert {k for k in POOL if k in self.index} == set(self.model)
        assert len(self.index) == len(self.model)
        assert self.index.bytes_used == sum(e.size for e in self.model.values())

    @precondition(lambda self: len(self.model) > 0)
    @invariant()
    def newest_first_names_every_object_once(self) -> None:
        assert sorted(k.raw for k in self.index.newest_first()) == sorted(k.raw for k in self.model)


TestIndexAgainstADict = IndexAgainstADict.TestCase
TestIndexAgainstADict.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
