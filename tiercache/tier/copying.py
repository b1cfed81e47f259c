"""Copying an object's bytes between buffers without holding the GIL.

A memoryview slice assignment (``dst[:] = src``) is one memcpy under the GIL, so every other thread
of the process waits behind it: in the server, the request loop and the I/O threads behind the
copies of promotions from disk into L1. numpy's copy releases the GIL for the memcpy at the same
speed; ``benchmarks/copy_gil.py`` measures both (docs/benchmarks.md), and the tiers' copies of an
object's bytes go through :func:`copy_into`.
"""

from __future__ import annotations

import numpy as np

from tiercache.keys.digest import Buffer

#: Below this many bytes a slice assignment is over before any other thread could have run, and
#: cheaper than building two numpy views.
_INLINE_BYTES = 64 * 1024


def copy_into(dst: Buffer, src: Buffer) -> None:
    """Copy ``src`` into ``dst`` (a writable buffer of the same length, in bytes) with the GIL
    released for a large copy. Raises :class:`ValueError` when the lengths differ."""
    d, s = memoryview(dst).cast("B"), memoryview(src).cast("B")
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy size mismatch: destination {d.nbytes} bytes, source {s.nbytes}")
    if d.nbytes < _INLINE_BYTES:
        d[:] = s
    else:
        np.copyto(np.frombuffer(d, np.uint8), np.frombuffer(s, np.uint8))
