"""The restorable-prefix rule: which chunks of one object group a hit of ``boundary`` chunks needs.

One rule for the server's lookups (:mod:`tiercache.engine`) and the connector's loads
(:mod:`tiercache.connector.layout`), so what the server reports as a hit is exactly what the
workers load:

* a full-attention group needs every chunk before the boundary;
* a sliding-window group needs the ``window_chunks`` chunks before it (its window's tokens span
  ``ceil(window / chunk_size)`` chunks, see :func:`window_chunks`);
* a recurrent group (Mamba, GDN, KDA state) needs only the state snapshot stored with the last chunk.

A prefix of ``boundary`` chunks is restorable iff every group has every chunk it needs.
"""

from __future__ import annotations

from tiercache.keys.fingerprint import GroupKind


def window_chunks(window_tokens: int, chunk_size: int) -> int:
    """Whole chunks a sliding window of ``window_tokens`` spans at a chunk boundary (at least 1)."""
    return max(1, -(-window_tokens // chunk_size))


def needed_chunks(kind: GroupKind, boundary: int, window: int = 0) -> range:
    """The chunk indices a group of ``kind`` needs to restore the first ``boundary`` chunks;
    ``window`` is a sliding-window group's :func:`window_chunks` (ignored for the other kinds)."""
    if boundary <= 0:
        return range(0)
    if kind is GroupKind.FULL_ATTENTION:
        return range(boundary)
    if kind is GroupKind.SLIDING_WINDOW:
        return range(max(0, boundary - window), boundary)
    return range(boundary - 1, boundary)
