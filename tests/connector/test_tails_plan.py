"""Planning tails (plain Python): which blocks a lookup may ask for, and which blocks load or store."""

from __future__ import annotations

from tiercache.connector.tails import askable_blocks, tail_blocks

CHUNK, BLOCK = 128, 32
HASHES = [bytes([j]) * 16 for j in range(3)]


def test_a_lookup_asks_for_full_blocks_short_of_the_chunk_end_and_the_last_token() -> None:
    assert askable_blocks(200, 1, CHUNK, BLOCK) == 2  # tokens 128..191 of 200: the 200th is computed
    assert askable_blocks(193, 1, CHUNK, BLOCK) == 2
    assert (
        askable_blocks(192, 1, CHUNK, BLOCK) == 1
    )  # its 3rd block would hold the last token, which vLLM computes
    assert askable_blocks(1000, 1, CHUNK, BLOCK) == 3  # a chunk's 4th block is the chunk itself
    assert askable_blocks(129, 1, CHUNK, BLOCK) == 0


def test_blocks_stop_at_the_first_one_not_allocated_in_some_group() -> None:
    ids = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24]]  # group 1 lacks chunk 1's block 1
    got = tail_blocks(ids, 1, CHUNK, BLOCK, HASHES, 0, 3, store=True)
    assert [(t.j, t.block_ids) for t in got] == [(0, ((14,), (24,)))]


def test_a_sliding_groups_null_block_is_skipped_on_load_and_ends_a_store() -> None:
    ids = [[10, 11, 12, 13, 14, 15], [0, 0, 0, 0, 0, 25]]
    load = tail_blocks(ids, 1, CHUNK, BLOCK, HASHES, 0, 2, store=False, sliding={1})
    assert [t.block_ids for t in load] == [((14,), ()), ((15,), (25,))]
    assert tail_blocks(ids, 1, CHUNK, BLOCK, HASHES, 0, 2, store=True, sliding={1}) == []
    # A null block in a full-attention group is never skipped: the list ends before it.
    assert tail_blocks(ids, 1, CHUNK, BLOCK, HASHES, 0, 2, store=False) == []
