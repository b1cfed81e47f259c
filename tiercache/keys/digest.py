"""The digest of an object's payload: xxh3-64 of its bytes, in order.

One value follows an object everywhere: the writer computes it over the bytes it meant to store
(its own memory, never the shared arena), the commit carries it, L1 keeps it beside the slot, the
frames on disk and in S3 carry it as their payload checksum, and every copy out of the shared arena
is checked against it once the copy is done. Bytes that differ are a miss, never a hit
(:class:`~tiercache.errors.IntegrityError`).

xxh3-64 hashes at tens of GB/s from cache, so a check right after a copy, while the bytes are still
cached, costs a fraction of the copy itself (see docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import xxhash

#: Any C-contiguous buffer (a numpy array too).
Buffer = bytes | bytearray | memoryview | Any


def digest(data: Buffer) -> int:
    """xxh3-64 of ``data`` (any C-contiguous buffer): an object's payload digest."""
    return xxhash.xxh3_64_intdigest(data)


class Digest:
    """The digest of bytes fed in pieces, in order: ``Digest().update(a).update(b).value`` equals
    ``digest(a + b)``. For writers whose object is gathered from several places."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: Buffer) -> Digest:
        """Feed the next piece (any C-contiguous buffer)."""
        self._h.update(data)
        return self

    @property
    def value(self) -> int:
        """The digest of everything fed so far."""
        return int(self._h.intdigest())
