"""What the engine counts and times: its own counters, and the one timed read every move uses."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic, perf_counter

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
    # A lookup's questions to a remote tier (S3) that it stopped waiting for: past its budget
    # (--remote-lookup-budget-s), or not asked because the remote lookup workers were all busy.
    # The lookup answered what the local tiers hold.
    remote_lookups_late: int = 0
    remote_lookups_busy: int = 0
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
    # Copies out of the shared L1 arena that did not match the object's digest (a late, stray or
    # torn write into its slot), by where they were caught; each was a miss, never served.
    integrity_failures_l1_read: int = 0  # a client's copy (a vLLM load, an SGLang get, a tool)
    integrity_failures_server_read: int = 0  # the server's own read for a get over the socket
    integrity_failures_promotion: int = 0  # a promotion's copy into its L1 reservation
    integrity_failures_write_through: int = 0  # L1's copy to the first lower tier


#: Where an integrity failure can be caught (the ``integrity_failures_<path>`` counters).
INTEGRITY_PATHS = ("l1_read", "server_read", "promotion", "write_through")


#: ``report(path, key, offset, suspects)``: a copy out of L1 did not match its digest
#: (:meth:`TieredEngine.integrity_failure <tiercache.engine.TieredEngine.integrity_failure>`).
IntegrityReport = Callable[[str, ObjectKey, int | None, str], bool | None]


class Throttle:
    """At most one event per ``interval_s`` goes through (a log line); the rest are counted and
    the next one that goes through says how many were held back. Thread-safe."""

    def __init__(self, interval_s: float = 30.0, clock: Callable[[], float] = monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None  # guarded by _lock
        self._held = 0  # guarded by _lock

    def allow(self) -> int | None:
        """``None`` if this event is held back; else how many were held back since the last one."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last < self._interval_s:
                self._held += 1
                return None
            held, self._held, self._last = self._held, 0, now
            return held


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
