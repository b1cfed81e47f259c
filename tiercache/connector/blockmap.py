"""Chunks ↔ engine blocks, per KV-cache group (plain Python: no vLLM, no torch).

A chunk is ``chunk_size`` tokens; KV-cache group ``g`` keeps them in ``chunk_size // block_sizes[g]``
of its own blocks. Groups may use different block sizes (Gemma 4: sliding group 64-token blocks, full
group 32-token blocks, both 16 KiB pages), so chunk ``c`` is blocks ``c*n_g .. (c+1)*n_g - 1`` of
group ``g``'s block list, with ``n_g`` its own. ``chunk_size`` is a multiple of every group's block
size (checked at start-up by :func:`tiercache.connector.layout.check_block_sizes`).

Block id 0 is vLLM's null block: a sliding-window group's blocks before its window are 0 in the
request's block list. These functions never return 0 as a block to load into, and never a save that
reads one from a full-attention group.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

NULL_BLOCK = 0


def blocks_per_chunk(chunk_size: int, block_size: int) -> int:
    """How many of a group's blocks hold one chunk (``chunk_size`` must be a multiple)."""
    if block_size <= 0 or chunk_size % block_size:
        raise ValueError(f"chunk size {chunk_size} is not a multiple of the block size {block_size}")
    return chunk_size // block_size


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """One chunk's blocks, per KV-cache group: ``block_ids[g][i]`` is the engine block that holds
    position ``positions[g][i]`` (0-based inside the chunk, in that group's block size) of the chunk.
    A load skips 0s (a sliding group's null blocks); a full-attention group never has one."""

    chunk: int
    positions: tuple[tuple[int, ...], ...]
    block_ids: tuple[tuple[int, ...], ...]


def blocks_to_load(
    block_ids: Sequence[Sequence[int]],
    block_sizes: Sequence[int],
    chunk_size: int,
    start: int,
    end: int,
    skip: Collection[int] = (),
) -> list[ChunkBlocks]:
    """The blocks each chunk of tokens ``[start, end)`` is copied into, per group.

    Only blocks wholly inside ``[start, end)`` are written (blocks below ``start`` the engine already
    has). Stops before the first chunk whose blocks are not all allocated in some group: the worker
    could not place it, so the hit is cut there (loading less is safe, garbage never is). Groups in
    ``skip`` (recurrent state, which is not per-block KV) get no positions; the caller places them.
    """
    out: list[ChunkBlocks] = []
    for c in range(start // chunk_size, -(-end // chunk_size)):
        positions: list[tuple[int, ...]] = []
        ids: list[tuple[int, ...]] = []
        for g, (group_ids, bs) in enumerate(zip(block_ids, block_sizes)):
            if g in skip:
                positions.append(())
                ids.append(())
                continue
            n = blocks_per_chunk(chunk_size, bs)
            first = c * n
            pos = tuple(j for j in range(n) if start <= (first + j) * bs and (first + j + 1) * bs <= end)
            if pos and len(group_ids) <= first + pos[-1]:
                return out
            positions.append(pos)
            ids.append(tuple(group_ids[first + j] for j in pos))
        if not any(positions):
            continue
        out.append(ChunkBlocks(c, tuple(positions), tuple(ids)))
    return out


def freed_blocks(computed_before: int, window: int, block_size: int) -> int:
    """Blocks of a sliding-window group that vLLM may already have freed (replaced by the null
    block) once ``computed_before`` tokens are computed: those wholly before the window of the next
    token. vLLM frees on a basis no later than this, so blocks below it are never read."""
    return max(0, computed_before - window + 1) // block_size


def blocks_to_save(
    block_ids: Sequence[Sequence[int]],
    block_sizes: Sequence[int],
    windows: Mapping[int, int],
    chunk_size: int,
    first: int,
    end: int,
    computed_before: int,
    skip: Collection[int] = (),
) -> list[tuple[int, list[list[int]]]]:
    """``(chunk, per-group block ids)`` for each chunk in ``[first, end)`` that can be stored.

    ``windows`` maps sliding groups to their window in tokens. A sliding group whose blocks in the
    chunk may already be freed gets all 0s (the worker stores no object of that group for the
    chunk). Stops at the first chunk that is not fully allocated or has a null block in a
    full-attention group: later chunks cannot be stored either (stores are a prefix). Groups in
    ``skip`` (recurrent state) get an empty list; the caller fills in their state block.
    """
    out: list[tuple[int, list[list[int]]]] = []
    for c in range(first, end):
        ids: list[list[int]] = []
        for g, (group_ids, bs) in enumerate(zip(block_ids, block_sizes)):
            if g in skip:
                ids.append([])
                continue
            n = blocks_per_chunk(chunk_size, bs)
            chunk_ids = list(group_ids[c * n : (c + 1) * n])
            if len(chunk_ids) != n:
                return out  # blocks not (all) allocated: never store those
            if g in windows:
                if c * n < freed_blocks(computed_before, windows[g], bs) or NULL_BLOCK in chunk_ids:
                    chunk_ids = [NULL_BLOCK] * n
            elif NULL_BLOCK in chunk_ids:
                return out  # a null block in a full-attention group: never store that
            ids.append(chunk_ids)
        out.append((c, ids))
    return out
