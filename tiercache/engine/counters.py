"""What the engine counts and times: its own counters, and the one timed read every move uses."""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

from tiercache.keys.object_key import ObjectKey
from tiercache.tier.contract import ReadHandle, Tier
from tiercache.tier.stats import Counters


@dataclass(slots=True)
class EngineCounters(Counters):
    """Engine-level counters (tier counters live on each tier)."""

    lookups: int = 0
    lookup_chunks_hit: int = 0
    stores: int = 0
    stores_dropped: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    inflight_waits: int = 0  # objects a prefetch waited for while another writer stored them
    inflight_wait_misses: int = 0  # of those, not committed in time (aborted, expired, too slow)
    l2_queue_drops: int = 0
    l3_queue_drops: int = 0  # write-through only: the chunk is still on disk
    # Write-back: chunks the disk evicted that never reached S3, so they are in no tier (lost).
    writeback_lost_queue_full: int = 0
    writeback_lost_write_failed: int = 0
    writeback_lost_shutdown: int = 0
    # L3 admission (--l3-admission): chunks handed to S3, and chunks the rule kept from it, by why.
    l3_admitted: int = 0
    l3_refused_unread: int = 0  # never read since stored
    l3_refused_untracked: int = 0  # no mark: stored before start-up, or forgotten past the window
    l2_writes: int = 0
    l3_writes: int = 0
    write_failures: int = 0
    tails_superseded: int = (
        0  # tail objects dropped from a local tier once an object covering them was stored
    )
    tail_lookups: int = 0  # lookups of the blocks of one chunk (tails)
    tail_blocks_hit: int = 0  # blocks those found, in stored tails and chunks


def timed_pin(tier: Tier, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
    """``tier.pin(key, count=count)``, its duration recorded as a ``read`` when it hits."""
    t0 = perf_counter()
    handle = tier.pin(key, count=count)
    if handle is not None:
        tier.stats.latency.observe("read", perf_counter() - t0)
    return handle


def hold(tier: Tier, key: ObjectKey) -> ReadHandle | None:
    """Pin ``key`` for the engine's own use (a ticket's hold, a write-through source): not a hit or a
    miss, since it serves no reader; the reader's own pin (``get``, the server's pin op) counts.
    Timed as a ``read`` like every pin."""
    return timed_pin(tier, key, count=False)
