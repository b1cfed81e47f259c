"""The slot allocator: aligned, non-overlapping slots; freed neighbours merge back into one extent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.l1.allocator import Extent, SlotAllocator

A = 4096


def test_slots_start_on_the_alignment_and_are_rounded_up_to_it() -> None:
    alloc = SlotAllocator(16 * A, A)
    slots = [alloc.allocate(n) for n in (1, A, A + 1, 0)]
    assert [s.size for s in slots if s] == [A, A, 2 * A, A]
    assert all(s is not None and s.offset % A == 0 for s in slots)


def test_a_ragged_capacity_is_rounded_down_to_whole_units() -> None:
    alloc = SlotAllocator(3 * A + 100, A)
    assert alloc.capacity == 3 * A
    assert alloc.free_bytes() == 3 * A


def test_an_allocation_that_does_not_fit_returns_none() -> None:
    alloc = SlotAllocator(4 * A, A)
    assert alloc.allocate(5 * A) is None
    assert alloc.allocate(4 * A) == Extent(0, 4 * A)
    assert alloc.allocate(1) is None


def test_freeing_neighbours_merges_them_into_one_extent() -> None:
    alloc = SlotAllocator(4 * A, A)
    a, b, c, d = (alloc.allocate(A) for _ in range(4))
    assert alloc.free_bytes() == 0
    alloc.free(a.offset)
    alloc.free(c.offset)
    assert alloc.largest_free() == A  # two holes, not adjacent
    alloc.free(b.offset)  # bridges a and c
    assert alloc.extents() == [Extent(0, 3 * A)]
    alloc.free(d.offset)
    assert alloc.extents() == [Extent(0, 4 * A)]
    assert alloc.largest_free() == 4 * A


def test_best_fit_keeps_large_extents_whole() -> None:
    alloc = SlotAllocator(8 * A, A)
    slots = [alloc.allocate(A) for _ in range(8)]
    alloc.free(slots[1].offset)  # a 1-unit hole
    for s in slots[4:]:
        alloc.free(s.offset)  # a 4-unit hole at the end
    assert alloc.extents() == [Extent(slots[1].offset, A), Extent(4 * A, 4 * A)]  # merged
    small = alloc.allocate(2000)
    assert small == Extent(slots[1].offset, A)
    assert alloc.largest_free() == 4 * A


def test_a_freed_slot_is_reused_for_the_same_size_at_once() -> None:
    alloc = SlotAllocator(8 * A, A)
    slots = [alloc.allocate(2 * A) for _ in range(4)]
    alloc.free(slots[2].offset)
    assert alloc.free_bytes() == 2 * A
    assert alloc.allocate(2 * A) == slots[2]


def test_fragmented_quick_lists_are_merged_before_an_allocation_fails() -> None:
    alloc = SlotAllocator(8 * A, A)
    slots = [alloc.allocate(A) for _ in range(8)]
    for s in slots[2:6]:
        alloc.free(s.offset)  # four 1-unit slots, adjacent once merged
    assert alloc.allocate(4 * A) == Extent(2 * A, 4 * A)
    assert alloc.allocate(A) is None


def test_double_free_is_refused() -> None:
    alloc = SlotAllocator(4 * A, A)
    slot = alloc.allocate(10)
    alloc.free(slot.offset)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(slot.offset)


def test_alignment_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        SlotAllocator(4096, 3000)


@settings(max_examples=200, deadline=None)
@given(
    alignment=st.sampled_from([1, 64, 4096]),
    units=st.integers(1, 64),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 20_000)),
            st.tuples(st.just("free"), st.integers(0, 1000)),
        ),
        max_size=120,
    ),
)
def test_random_allocs_and_frees_never_overlap_and_free_space_returns_to_full(
    alignment: int, units: int, ops: list[tuple[str, int]]
) -> None:
    capacity = units * 4096
    alloc = SlotAllocator(capacity, alignment)
    live: dict[int, Extent] = {}
    for op, n in ops:
        if op == "alloc":
            slot = alloc.allocate(n)
            if slot is None:
                assert alloc.largest_free() < alloc.slot_size(n)
                continue
            assert slot.offset % alignment == 0 and slot.size % alignment == 0
            assert slot.size >= n and 0 <= slot.offset and slot.offset + slot.size <= capacity
            for other in live.values():
                disjoint = slot.offset + slot.size <= other.offset
                assert disjoint or other.offset + other.size <= slot.offset
            live[slot.offset] = slot
        elif live:
            victim = sorted(live)[n % len(live)]
            alloc.free(victim)
            del live[victim]
        assert alloc.free_bytes() == capacity - sum(s.size for s in live.values())
    for offset in list(live):
        alloc.free(offset)
    assert alloc.free_bytes() == capacity
    assert alloc.extents() == [Extent(0, capacity)]
