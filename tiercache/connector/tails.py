"""Tails: what lies past a request's last full chunk, stored as one object and matched block by block.

tiercache keeps chunk-sized objects for the bulk of a prompt. What follows the last full chunk (a
question after a document, a chat turn's end and its answer) would be recomputed by every request,
where vLLM's own prefix cache reuses every full block. With the ``tails`` setting the connector also
stores, for chunk ``c`` that a request does not fill, one object (per object group) of the chunk's
first ``k`` full blocks, keyed by the tail hash of its last (:func:`tiercache.keys.tail_hashes`: a
chain over the blocks' tokens that continues from the chunk chain before ``c``), and names the
blocks it holds for the server's block index (:mod:`tiercache.engine.blocks`). A lookup then asks,
after the full chunks it found, for the blocks of the next chunk; the server answers with the
object holding the longest prefix of them (a tail, a longer one, or the chunk itself, stored by a
longer request), and the worker loads its first blocks: the hit ends where vLLM's own prefix cache
would end.

A chunk's shorter tails are superseded when the chunk, or a longer tail, is stored: the commit names
them and the server drops them from its local tiers (:meth:`tiercache.client.client.Client.commit`).

Plain Python (no vLLM, no torch): the scheduler half plans with these.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tiercache.connector.blockmap import NULL_BLOCK, freed_blocks
from tiercache.connector.layout import EngineLayout


def unsupported(layout: EngineLayout) -> str | None:
    """Why ``layout`` cannot have tails (``None``: it can).

    Recurrent state exists only at the boundaries vLLM keeps it (chunk boundaries for tiercache), so
    a hit cannot end inside a chunk; groups of different block sizes would need tails at the
    coarsest block and are left for later.
    """
    if layout.has_recurrent:
        return "recurrent-state groups: a hit can only end where a state is stored, at a chunk boundary"
    sizes = set(layout.kv_group_block_sizes())
    if len(sizes) != 1:
        return f"KV-cache groups of different block sizes ({sorted(sizes)} tokens)"
    return None


def tail_block_size(layout: EngineLayout) -> int:
    """The tokens of one tail object: the (single) block size of the layout's groups."""
    return layout.kv_group_block_sizes()[0]


def askable_blocks(prompt_len: int, tail_chunk: int, chunk_size: int, block_size: int) -> int:
    """How many blocks of chunk ``tail_chunk`` a lookup may ask for: full blocks of the prompt
    inside it, short of the chunk's end (a full chunk is a chunk object) and leaving at least one
    prompt token to compute (vLLM needs one to sample from)."""
    start = tail_chunk * chunk_size
    return max(0, min(chunk_size // block_size - 1, (prompt_len - 1 - start) // block_size))


@dataclass(frozen=True, slots=True)
class TailBlock:
    """One tail block to load or store: its index ``j`` inside the chunk (0-based), its prefix hash
    and, per KV-cache group, the engine block holding it (``[]``: the group has none here, e.g. a
    sliding group's null block)."""

    j: int
    prefix_hash: bytes
    block_ids: tuple[tuple[int, ...], ...]


def tail_blocks(
    block_ids: Sequence[Sequence[int]],
    tail_chunk: int,
    chunk_size: int,
    block_size: int,
    hashes: Sequence[bytes],
    first: int,
    last: int,
    *,
    store: bool,
    sliding: Collection[int] = (),
) -> list[TailBlock]:
    """Blocks ``first .. last - 1`` of chunk ``tail_chunk`` with their engine blocks, stopping at the
    first one not allocated in some group (never a partial plan). ``hashes[j]`` is block ``j``'s
    tail hash. A load skips a ``sliding`` group whose block is the null block (out of its window);
    a null block anywhere else, or in any group of a store (a later block would then lack an
    earlier one's object and never be found), ends the list."""
    per_chunk = chunk_size // block_size
    out: list[TailBlock] = []
    for j in range(first, min(last, len(hashes))):
        at = tail_chunk * per_chunk + j
        ids: list[tuple[int, ...]] = []
        for g, group_ids in enumerate(block_ids):
            if at >= len(group_ids):
                return out
            b = group_ids[at]
            if b == NULL_BLOCK and (store or g not in sliding):
                return out
            ids.append((b,) if b != NULL_BLOCK else ())
        out.append(TailBlock(j, hashes[j], tuple(ids)))
    return out


def tail_holds(
    hashes: Sequence[bytes],
    tail_chunk: int,
    chunk_size: int,
    block_size: int,
    windows: Mapping[int, int],
    gone: Mapping[int, int],
) -> list[bytes]:
    """The blocks a tail object of ``len(hashes)`` blocks of chunk ``tail_chunk`` names for the
    server's block index (their tail hashes): each block ``j`` whose hit (ending after it) needs
    none of the blocks the object lacks. ``gone[kv]``: the leading blocks of sliding KV-cache group
    ``kv`` (window ``windows[kv]`` tokens) freed before the store, held as zeros; a hit ending at
    token ``e`` needs that group's blocks from :func:`~tiercache.connector.blockmap.freed_blocks`
    ``(e)`` on."""
    per_chunk = chunk_size // block_size
    out = []
    for j, h in enumerate(hashes):
        end = tail_chunk * chunk_size + (j + 1) * block_size
        if all(
            freed_blocks(end, windows[kv], block_size) - tail_chunk * per_chunk >= gone[kv]
            for kv in gone
            if gone[kv]
        ):
            out.append(h)
    return out
