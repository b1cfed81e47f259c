"""Specification: the block index remembers, per block hash, the objects said to hold that block,
newest first, a few per block, for a bounded number of blocks (least recently asked forgotten first)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tiercache.engine.blocks import MAX_TARGETS, BlockIndex, BlockIndexFormatError


def h(n: int) -> bytes:
    return n.to_bytes(16, "little")


def test_each_block_names_the_objects_that_hold_it_newest_first() -> None:
    index = BlockIndex(100)
    index.add(h(100), [h(1), h(2)])  # a tail of two blocks
    index.add(h(200), [h(1), h(2), h(3)])  # the full chunk holding them and one more
    assert index.targets(h(1)) == [h(200), h(100)]
    assert index.targets(h(3)) == [h(200)]
    assert index.targets(h(4)) == []


def test_adding_an_object_again_moves_it_to_the_front_once() -> None:
    index = BlockIndex(100)
    index.add(h(100), [h(1)])
    index.add(h(200), [h(1)])
    index.add(h(100), [h(1)])
    assert index.targets(h(1)) == [h(100), h(200)]


def test_a_block_keeps_only_the_newest_few_objects() -> None:
    index = BlockIndex(100)
    for target in range(MAX_TARGETS + 2):
        index.add(h(1000 + target), [h(1)])
    assert index.targets(h(1)) == [h(1000 + t) for t in reversed(range(2, MAX_TARGETS + 2))]


def test_a_forgotten_object_is_no_longer_named_and_an_empty_block_goes() -> None:
    index = BlockIndex(100)
    index.add(h(100), [h(1)])
    index.add(h(200), [h(1)])
    index.forget(h(1), h(200))
    assert index.targets(h(1)) == [h(100)]
    index.forget(h(1), h(100))
    assert index.targets(h(1)) == [] and len(index) == 0
    index.forget(h(9), h(100))  # nothing known: nothing happens


def test_the_least_recently_asked_blocks_are_forgotten_beyond_the_capacity() -> None:
    index = BlockIndex(2)
    index.add(h(100), [h(1), h(2)])
    assert index.targets(h(1)) == [h(100)]  # asked: now the most recent
    index.add(h(200), [h(3)])
    assert len(index) == 2 and index.forgotten == 1
    assert index.targets(h(2)) == []
    assert index.targets(h(1)) == [h(100)] and index.targets(h(3)) == [h(200)]


def test_hashes_of_another_length_are_refused() -> None:
    index = BlockIndex(10)
    with pytest.raises(ValueError, match="16 bytes"):
        index.add(b"short", [h(1)])
    with pytest.raises(ValueError, match="at least one"):
        BlockIndex(0)


def test_an_export_reads_back_the_same_entries_in_the_same_order() -> None:
    index = BlockIndex(100)
    index.add(h(100), [h(1), h(2)])
    index.add(h(200), [h(1), h(2), h(3)])
    assert index.targets(h(1))  # asked: now the most recent
    copy = BlockIndex(100)
    assert copy.restore(index.export()) == 3
    assert [copy.targets(h(n)) for n in (1, 2, 3, 4)] == [[h(200), h(100)], [h(200), h(100)], [h(200)], []]
    small = BlockIndex(1)  # room for one block: the most recently asked one stays
    small.restore(index.export())
    assert (len(small), small.targets(h(1)), small.forgotten) == (1, [h(200), h(100)], 2)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-1],  # truncated
        lambda data: data[:20] + bytes([data[20] ^ 1]) + data[21:],  # a bit flipped in an entry
        lambda data: b"X" + data[1:],  # another format
        lambda data: b"",
    ],
    ids=["truncated", "flipped", "foreign", "empty"],
)
def test_an_export_that_does_not_read_back_whole_is_refused_and_adds_nothing(
    damage: Callable[[bytes], bytes],
) -> None:
    index = BlockIndex(100)
    index.add(h(100), [h(1), h(2)])
    copy = BlockIndex(100)
    with pytest.raises(BlockIndexFormatError):
        copy.restore(damage(index.export()))
    assert len(copy) == 0
