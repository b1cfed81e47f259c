"""Write-behind: committed L1 chunks flow down to the lower tiers on background threads.

A chunk committed to L1 is queued for the first lower tier (L2, or S3 with tiers ``l1,s3``); with
the ``through`` policy a chunk written to L2 is then queued for S3, with ``back`` the disk tier hands
each chunk it evicts to S3. Queues are bounded: a full queue drops the write and counts it instead
of blocking. Until the first lower tier holds it, the L1 copy is *owed* and L1 will not evict it.

A write-through drop leaves the chunk in the tier above; a write-back drop (or failed S3 write) does
not, since the disk has already let it go: that chunk is *lost*, counted apart and warned about
(:class:`WriteBackLosses`). Blocking the eviction instead would hold the disk's write transaction on
S3 and only move the loss to the newest chunks (see docs/caveats.md).

Which chunks S3 gets at all is the admission rule's call (:mod:`tiercache.engine.admission`): every
one (``all``), or only those read since they were stored (``read``); a refused chunk is counted as
refused, never as lost.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from time import monotonic, perf_counter
from typing import Generic, Literal, TypeVar

from tiercache.config.parts import EngineConfig, L3Admission, L3WritePolicy
from tiercache.engine.admission import AdmissionRule
from tiercache.engine.counters import EngineCounters, IntegrityReport, hold, timed_pin
from tiercache.errors import CircuitOpenError, IntegrityError, TierCacheError
from tiercache.keys.object_key import ObjectKey
from tiercache.tier.contract import FrontTier, ReadHandle, Tier

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Why a write-back chunk was lost: the S3 queue was full, its S3 write failed, or the engine closed
#: before writing it.
LossReason = Literal["queue_full", "write_failed", "shutdown"]
_NO_LOSSES: dict[LossReason, int] = {"queue_full": 0, "write_failed": 0, "shutdown": 0}
#: At most one write-back loss warning per this many seconds; the next one carries the count since.
LOSS_WARNING_INTERVAL_S = 30.0


class WriteBackLosses:
    """Counts chunks lost on write-back (``writeback_lost_<reason>``) and warns about them, at most
    once per ``interval_s``, each warning with the count since the previous one. Thread-safe.

    The first loss is warned about at once; losses within the interval after a warning wait for the
    next loss after it, or for :meth:`close`, so every loss is reported exactly once.
    """

    def __init__(
        self,
        counters: EngineCounters,
        *,
        interval_s: float = LOSS_WARNING_INTERVAL_S,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self._counters = counters
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = dict(_NO_LOSSES)  # guarded by _lock
        self._last_warning: float | None = None  # guarded by _lock

    def lost(self, reason: LossReason, n: int = 1) -> None:
        """``n`` chunks the disk evicted never reached S3 for ``reason``: count them, maybe warn."""
        self._counters.add(f"writeback_lost_{reason}", n)
        with self._lock:
            self._pending[reason] += n
            now = self._clock()
            if self._last_warning is not None and now - self._last_warning < self._interval_s:
                return
            when = (
                "since start-up"
                if self._last_warning is None
                else f"in the last {now - self._last_warning:.0f} s"
            )
            self._last_warning = now
            self._warn(when)

    def close(self) -> None:
        """Warn about losses not yet reported (at shutdown)."""
        with self._lock:
            if any(self._pending.values()):
                self._warn("since the last warning")

    def _warn(self, when: str) -> None:  # caller holds _lock
        p = self._pending
        n = sum(p.values())
        log.warning(
            "write-back lost %d chunk%s %s (queue full %d, S3 write failed %d, at shutdown %d): "
            "evicted from disk and never written to S3, so in no tier now "
            "(tiercache_engine_writeback_lost_total; see docs/caveats.md on sizing --write-queue-depth)",
            n,
            "" if n == 1 else "s",
            when,
            p["queue_full"],
            p["write_failed"],
            p["shutdown"],
        )
        self._pending = dict(_NO_LOSSES)


class WorkQueue(Generic[T]):
    """A bounded FIFO of work with a count of unfinished items, so that :meth:`wait_idle` can wait
    on a condition instead of polling. Thread-safe."""

    def __init__(self, depth: int) -> None:
        self._depth = depth
        lock = threading.Lock()
        self._not_empty = threading.Condition(lock)  # an item was queued, or the queue closed
        self._all_done = threading.Condition(lock)  # nothing is queued or being worked on
        self._items: deque[T] = deque()  # guarded by lock
        self._unfinished = 0  # queued or being worked on; guarded by lock
        self._closed = False  # guarded by lock

    def put_nowait(self, item: T) -> bool:
        """Queue ``item``; ``False`` (nothing queued) when the queue is full or closed."""
        with self._not_empty:
            if self._closed or len(self._items) >= self._depth:
                return False
            self._items.append(item)
            self._unfinished += 1
            self._not_empty.notify()
            return True

    def get(self) -> T | None:
        """The next item, waiting for one; ``None`` once the queue is closed and empty."""
        with self._not_empty:
            self._not_empty.wait_for(lambda: self._items or self._closed)
            return self._items.popleft() if self._items else None

    def task_done(self) -> None:
        """One item taken by :meth:`get` is finished."""
        with self._all_done:
            self._unfinished -= 1
            if self._unfinished == 0:
                self._all_done.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until every queued item is finished; ``False`` if ``timeout`` passed first."""
        with self._all_done:
            return self._all_done.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self) -> None:
        """Accept nothing more; getters drain what is queued, then get ``None``."""
        with self._not_empty:
            self._closed = True
            self._not_empty.notify_all()

    def take_all(self) -> list[T]:
        """Remove and return every queued item (none will be worked on); each counts as finished."""
        with self._not_empty:
            items = list(self._items)
            self._items.clear()
        for _ in items:
            self.task_done()
        return items

    def qsize(self) -> int:
        with self._not_empty:
            return len(self._items)


class WriteBehind:
    """The write queues and writer threads between ``l1`` and its lower tiers (fastest first).

    The first lower tier receives write-through from L1; the S3 tier (if it is not the first)
    receives either write-through after it or write-back on its eviction.
    """

    def __init__(
        self,
        l1: FrontTier,
        lower: list[Tier],
        config: EngineConfig,
        counters: EngineCounters,
        on_integrity: IntegrityReport,
    ) -> None:
        self._l1 = l1
        self._on_integrity = on_integrity
        self._l2 = lower[0] if lower else None
        self._l3 = lower[1] if len(lower) > 1 else None
        self._config = config
        self._counters = counters
        self._losses = WriteBackLosses(counters)
        self._admission = AdmissionRule(config, counters)
        self._l2_queue: WorkQueue[ObjectKey] = WorkQueue(config.write_queue_depth)
        # Write-through items are keys (read back from L2); write-back items carry their payload.
        self._l3_queue: WorkQueue[ObjectKey | tuple[ObjectKey, bytes]] = WorkQueue(config.write_queue_depth)
        self._writers: list[threading.Thread] = []
        if config.l3_admission is L3Admission.READ and self._l3 is None and any(t.remote for t in lower):
            raise ValueError(
                "--l3-admission read writes chunks read while on the disk tier, and there is none in "
                "front of S3; use tiers l1,disk,s3 or --l3-admission all"
            )
        if self._l3 is not None and config.l3_write_policy is L3WritePolicy.BACK:
            if self._l2 is None:
                raise ValueError("write-back to S3 needs a tier in front of it to evict from")
            # Raises when that tier cannot hand over its evictions: refuse rather than never write.
            self._l2.set_eviction_listener(self._on_l2_evict)
        if self._l2 is not None:
            self._start(self._l2_queue, self._write_l2, "tiercache-write-l2")
        if self._l3 is not None:
            self._start(self._l3_queue, self._write_l3, "tiercache-write-l3")

    @property
    def owes(self) -> bool:
        """Whether a committed L1 chunk is owed to a lower tier (there is one)."""
        return self._l2 is not None

    def _start(self, q: WorkQueue[T], work: Callable[[T], None], name: str) -> None:
        for i in range(self._config.write_workers):
            t = threading.Thread(target=self._drain, args=(q, work), name=f"{name}-{i}", daemon=True)
            t.start()
            self._writers.append(t)

    def _drain(self, q: WorkQueue[T], work: Callable[[T], None]) -> None:
        while (item := q.get()) is not None:
            try:
                work(item)
            except Exception:  # a background failure is a counted result, never a dead thread
                self._counters.add("write_failures")
                log.exception("background write failed")
            finally:
                q.task_done()

    def queue(self, key: ObjectKey) -> None:
        """Queue a committed L1 chunk for the first lower tier. Non-blocking; a full queue drops it."""
        if self._l3 is not None:
            self._admission.stored(key)  # before its disk write, so that a read meanwhile counts
        if not self._l2_queue.put_nowait(key):
            # Dropping the write-through means L1 no longer owes it: let it be evicted normally.
            self._counters.add("l2_queue_drops")
            self._admission.forget(key)
            self._l1.settle(key)

    @property
    def watches_reads(self) -> bool:
        """Whether :meth:`read` matters (S3 admission ``read``), so callers can skip collecting keys."""
        return self._l3 is not None and self._admission.watches_reads

    def read(self, keys: Iterable[ObjectKey]) -> None:
        """``keys`` were read (prefetched, loaded, pinned): tell the admission rule, and queue for
        S3 the chunks their first read admits (write-through). Non-blocking."""
        if self._l3 is None:
            return
        for key in self._admission.read(keys):
            self._enqueue_l3(key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes reached their tiers; ``False`` if ``timeout`` passed first."""
        end = None if timeout is None else monotonic() + timeout
        for q in (self._l2_queue, self._l3_queue):
            left = None if end is None else max(0.0, end - monotonic())
            if not q.wait_idle(left):
                return False
        return True

    def close(self) -> None:
        """Stop the writers once the queues are drained (waiting at most 2 s per writer)."""
        self._l2_queue.close()
        self._l3_queue.close()
        for t in self._writers:
            t.join(timeout=2.0)
        # Writers that did not drain in time leave these behind; a write-back payload exists nowhere else.
        left = sum(1 for item in self._l3_queue.take_all() if isinstance(item, tuple))
        if left:
            self._losses.lost("shutdown", left)
        self._losses.close()

    def depths(self) -> dict[str, int]:
        """Writes waiting per queue (``l2_queue_depth``, ``l3_queue_depth``) and chunks the admission
        rule still waits to decide (``l3_admission_waiting``), for stats."""
        return {
            "l2_queue_depth": self._l2_queue.qsize(),
            "l3_queue_depth": self._l3_queue.qsize(),
            "l3_admission_waiting": self._admission.waiting(),
        }

    def _write_l2(self, key: ObjectKey) -> None:
        """Copy one owed chunk from L1 to the first lower tier, then let L1 evict it again.

        The lower tier checks the copy it keeps against the digest the chunk's writer committed,
        so it never keeps bytes another process scribbled into the L1 slot (then nothing is
        written, and the corrupt L1 object is dropped: ``integrity_failures_write_through``).

        One chunk per call on purpose: LMDB commits one large value per transaction fastest
        (measured: 6.3 GB/s, but 1.7 GB/s with two 256 KiB values per transaction).
        """
        l2 = self._l2
        assert l2 is not None
        pinned = hold(self._l1, key)
        if pinned is None:  # deleted or replaced meanwhile; nothing owed any more
            return
        try:
            t0 = perf_counter()
            l2.put(key, pinned.buffer, tenant=self._l1.tenant_of(key), digest=pinned.digest)
            l2.stats.latency.observe("write", perf_counter() - t0)
            self._counters.add("l2_writes")
        except IntegrityError:
            self._admission.forget(key)
            self._l1.release(pinned)
            pinned = None
            self._on_integrity("write_through", key, None, "")
            return
        except CircuitOpenError as exc:  # tiers l1,s3: see _write_l3
            self._counters.add("write_failures")
            self._admission.forget(key)
            log.debug("write of %s to %s skipped: %s", key, l2.name, exc)
            return
        except TierCacheError as exc:
            self._counters.add("write_failures")
            self._admission.forget(key)
            log.warning("write of %s to %s failed: %s", key, l2.name, exc)
            return
        finally:
            if pinned is not None:
                self._l1.release(pinned)
            self._l1.settle(key)
        if (
            self._l3 is not None
            and self._config.l3_write_policy is L3WritePolicy.THROUGH
            and self._admission.on_disk(key)
        ):
            self._enqueue_l3(key)

    def _enqueue_l3(self, key: ObjectKey) -> None:
        """Write-through: queue a chunk now on disk for S3; if the queue is full it stays on disk."""
        if not self._l3_queue.put_nowait(key):
            self._counters.add("l3_queue_drops")

    def _write_l3(self, item: ObjectKey | tuple[ObjectKey, bytes]) -> None:
        l2, l3 = self._l2, self._l3
        assert l3 is not None
        pinned: ReadHandle | None = None
        payload: bytes | memoryview
        write_back = isinstance(item, tuple)
        if isinstance(item, tuple):  # write-back: (key, payload bytes) handed over on L2 eviction
            key, payload = item
        else:
            assert l2 is not None
            key, pinned = item, timed_pin(l2, item, count=False)  # serves no reader
            if pinned is None:  # evicted from L2 before its turn: nothing left to copy
                return
            payload = pinned.buffer
        written = False
        try:
            t0 = perf_counter()
            # A disk frame's digest, where known: S3 checks its own copy against it for free.
            l3.put(key, payload, digest=None if pinned is None else pinned.digest)
            l3.stats.latency.observe("write", perf_counter() - t0)
            self._counters.add("l3_writes")
            written = True
        except CircuitOpenError as exc:
            # Not attempted: the tier already failed and said so. Counted, but not one warning per
            # chunk, which during an outage would flood the log at the write rate.
            self._counters.add("write_failures")
            log.debug("write of %s to %s skipped: %s", key, l3.name, exc)
        except TierCacheError as exc:
            self._counters.add("write_failures")
            log.warning("write of %s to %s failed: %s", key, l3.name, exc)
        finally:
            if pinned is not None and l2 is not None:
                l2.release(pinned)
            # In ``finally`` so that an unexpected error (counted by _drain) is a loss too.
            if write_back and not written:  # the disk no longer holds it
                self._losses.lost("write_failed")

    def _on_l2_evict(self, key: ObjectKey, payload: memoryview) -> None:
        """Write-back: hand a chunk the disk tier is evicting to S3 if the admission rule admits it
        (bounded queue; if it is full the chunk is lost, counted and warned about, rather than
        stalling the disk's write transaction). A refused chunk is counted by the rule, not lost.

        Copies the payload because the view dies with the eviction's transaction.
        """
        if not self._admission.evicted(key):
            return
        if not self._l3_queue.put_nowait((key, bytes(payload))):
            self._losses.lost("queue_full")
