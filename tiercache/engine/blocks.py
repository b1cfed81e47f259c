"""The block index: which stored object holds a given block of a chunk, for tails.

A tail lookup (:meth:`~tiercache.engine.engine.TieredEngine.lookup_tail`) names the blocks of one
chunk by their tail hashes ``t_0 .. t_{m-1}`` (:func:`tiercache.keys.tail_hashes`: ``t_j`` names
every token up to the end of block ``j``). The objects that hold such blocks are keyed by other
hashes: a tail object of ``k`` blocks by ``t_{k-1}``, a full chunk by its chunk hash. A prompt
shorter than the object that holds its blocks (a question after a document another question
already stored, a chat turn replayed after the next turn filled its chunk) cannot name that
object's key; it can name its blocks. So whoever stores an object says which block hashes it holds,
in order (``Reserve.aliases``), and this index remembers, per block hash, the objects holding that
block (block ``j`` of a chunk is always at position ``j`` of any object holding it, so a hit on
``t_j`` loads the object's first ``j + 1`` blocks).

The index is a hint, never the truth: a lookup checks that the tiers still hold a target before
answering with it, and forgets one no tier holds. It lives in memory, bounded (least recently used
block hashes are forgotten first); :meth:`BlockIndex.export` and :meth:`BlockIndex.restore` carry
it across a server restart (the engine keeps it on the disk tier at a clean stop). A block hash
names every token up to its end and a target names every token of its object, so "target holds
block ``j``" is a fact about token sequences: an entry read back is as true as when it was added,
and an export that does not read back whole (truncated, damaged) is refused as a whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

#: The most objects remembered per block hash, newest first: a block held by a tail, a longer
#: tail and the full chunk, or by several continuations that share it.
MAX_TARGETS = 4
_HASH = 16
#: An export: magic and format version, then per block (least recently asked first) the block
#: hash, its target count (u8) and the targets, newest first; then the xxh3-64 of all that (8 B).
_EXPORT_MAGIC = b"TCBIDX\x00\x01"
_DIGEST = 8


class BlockIndexFormatError(ValueError):
    """An export that cannot be read back whole (another format, truncated, damaged)."""


class BlockIndex:
    """Block hash → the prefix hashes of the objects holding that block (newest first), for at
    most ``capacity`` block hashes. Thread-safe; every method is in-memory work."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the block index needs room for at least one block, got {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        # Targets concatenated (16 bytes each): one bytes object a block instead of a list.
        self._targets: OrderedDict[bytes, bytes] = OrderedDict()  # guarded by _lock
        self.forgotten = 0  # block hashes dropped for room (guarded by _lock)

    def add(self, target: bytes, blocks: Sequence[bytes]) -> None:
        """Object ``target`` (a prefix hash) holds ``blocks[j]`` at position ``j``."""
        if len(target) != _HASH or any(len(b) != _HASH for b in blocks):
            raise ValueError("block and target hashes are 16 bytes each")
        with self._lock:
            for block in blocks:
                old = self._targets.pop(block, b"")
                rest = b"".join(
                    old[i : i + _HASH] for i in range(0, len(old), _HASH) if old[i : i + _HASH] != target
                )
                self._targets[block] = (target + rest)[: MAX_TARGETS * _HASH]
            self._trim()

    def targets(self, block: bytes) -> list[bytes]:
        """The objects said to hold ``block``, newest first (``[]``: none known)."""
        with self._lock:
            joined = self._targets.get(block)
            if joined is None:
                return []
            self._targets.move_to_end(block)
        return [joined[i : i + _HASH] for i in range(0, len(joined), _HASH)]

    def forget(self, block: bytes, target: bytes) -> None:
        """``target`` no longer holds ``block`` (no tier has it)."""
        with self._lock:
            joined = self._targets.get(block)
            if joined is None:
                return
            rest = b"".join(
                joined[i : i + _HASH] for i in range(0, len(joined), _HASH) if joined[i : i + _HASH] != target
            )
            if rest:
                self._targets[block] = rest
            else:
                del self._targets[block]

    def __len__(self) -> int:
        with self._lock:
            return len(self._targets)

    def export(self) -> bytes:
        """Every entry, least recently asked first, as bytes :meth:`restore` reads back."""
        with self._lock:
            items = list(self._targets.items())
        parts = [_EXPORT_MAGIC]
        for block, joined in items:
            parts += (block, bytes((len(joined) // _HASH,)), joined)
        body = b"".join(parts)
        return body + xxhash.xxh3_64_digest(body)

    def restore(self, data: bytes) -> int:
        """Add the entries of an :meth:`export` as the most recently asked, in their order, within
        the capacity (an entry for a block this index names already replaces it); returns how
        many blocks the export named. Raises :class:`BlockIndexFormatError`, adding nothing, when
        ``data`` is not a whole export."""
        view = memoryview(data)
        body = view[: len(view) - _DIGEST]
        if (
            len(view) < len(_EXPORT_MAGIC) + _DIGEST
            or bytes(view[: len(_EXPORT_MAGIC)]) != _EXPORT_MAGIC
            or xxhash.xxh3_64_digest(body) != bytes(view[len(body) :])
        ):
            raise BlockIndexFormatError(
                "not a whole block index export (another format, truncated or damaged)"
            )
        entries: list[tuple[bytes, bytes]] = []
        at = len(_EXPORT_MAGIC)
        while at < len(body):
            n = body[at + _HASH] if at + _HASH < len(body) else 0
            end = at + _HASH + 1 + n * _HASH
            if not 1 <= n <= MAX_TARGETS or end > len(body):
                raise BlockIndexFormatError(f"a block index entry at byte {at} is malformed")
            entries.append((bytes(body[at : at + _HASH]), bytes(body[at + _HASH + 1 : end])))
            at = end
        with self._lock:
            for block, joined in entries:
                self._targets.pop(block, None)
                self._targets[block] = joined
            self._trim()
        return len(entries)

    def _trim(self) -> None:
        """Forget the least recently asked blocks beyond the capacity. Caller holds ``_lock``."""
        while len(self._targets) > self._capacity:
            self._targets.popitem(last=False)
            self.forgotten += 1


__all__ = ["MAX_TARGETS", "BlockIndex", "BlockIndexFormatError"]
