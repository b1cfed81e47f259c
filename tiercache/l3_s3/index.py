"""The S3 tier's memory of the bucket: the capacity index and the existence cache.

* :class:`CapacityIndex` — object size by key, oldest first, and their byte total: what the capacity
  bound evicts from, and what ``usage`` reports without a request. Built from a listing of the
  prefix at start-up, kept by the tier's own puts, reads and deletes, and reconciled with a new
  listing every ``relist_interval_s`` (other nodes' writes and deletions).
* :class:`ExistenceCache` — recent HEAD answers with a TTL each, so a lookup of a long prompt costs a
  few requests, and a repeated one none.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

from tiercache.keys.object_key import ObjectKey

#: Bound on remembered existence answers, so a long-running server's memory stays flat.
EXISTENCE_CACHE_ENTRIES = 1 << 18


class CapacityIndex:
    """Object sizes by key, oldest first, each with the wall-clock time it was last written or read
    (S3's ``LastModified`` for listed objects): what the capacity bound evicts from. Not thread-safe:
    the tier calls it under its own lock.

    While a listing of the prefix runs (until :meth:`merge_listing` or :meth:`reconcile`), the keys
    this process writes or deletes are remembered, so the listing cannot resurrect or resize them
    with what it saw earlier.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # wall clock: compared with S3's LastModified
        self._sizes: OrderedDict[ObjectKey, int] = OrderedDict()  # oldest first
        self._stamps: dict[ObjectKey, float] = {}  # the order's times
        self._reads: dict[ObjectKey, float] = {}  # when this process last read each key
        self._bytes = 0
        self._touched: set[ObjectKey] | None = set()  # None while no listing runs

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def newest_first(self) -> list[ObjectKey]:
        """A snapshot of the keys, most recently written or read first."""
        return list(reversed(self._sizes))

    def set(self, key: ObjectKey, size: int) -> None:
        """``key`` was just written with ``size`` bytes: the youngest entry."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self._bytes -= old
        self._sizes[key] = size
        self._stamps[key] = self._clock()
        self._bytes += size
        self._touch(key)

    def touch(self, key: ObjectKey) -> None:
        """``key`` was read: it becomes the youngest (LRU-ish)."""
        if key in self._sizes:
            self._sizes.move_to_end(key)
            self._stamps[key] = self._reads[key] = self._clock()

    def forget(self, key: ObjectKey) -> None:
        """``key`` is gone from the bucket."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self._bytes -= old
            del self._stamps[key]
            self._reads.pop(key, None)
        self._touch(key)

    def restore_oldest(self, key: ObjectKey, size: int) -> None:
        """A deletion of ``key`` failed: it is back, as the oldest, so the next eviction retries it."""
        if key not in self._sizes:
            self._sizes[key] = size
            self._sizes.move_to_end(key, last=False)
            self._stamps[key] = float("-inf")
            self._bytes += size

    def take_oldest(self, excess: int, skip: Callable[[ObjectKey], bool]) -> list[tuple[ObjectKey, int]]:
        """Remove and return the oldest entries (not ``skip``\\ ped) until ``excess`` bytes are freed."""
        victims: list[tuple[ObjectKey, int]] = []
        for key, size in self._sizes.items():
            if excess <= 0:
                break
            if skip(key):
                continue
            victims.append((key, size))
            excess -= size
        for key, _size in victims:
            self.forget(key)
        return victims

    def merge_listing(self, listed: Collection[tuple[float, ObjectKey, int]]) -> None:
        """Merge the start-up listing ``(last modified, key, size)``: listed objects by their time,
        and everything this process wrote meanwhile."""
        self.reconcile(listed, drop_unlisted=False)

    def begin_relisting(self) -> None:
        """A later listing of the prefix starts (see :meth:`reconcile`)."""
        self._touched = set()

    def abandon_relisting(self) -> None:
        """The listing failed: keep the index as it is."""
        self._touched = None

    def reconcile(
        self, listed: Collection[tuple[float, ObjectKey, int]], *, drop_unlisted: bool = True
    ) -> tuple[int, int]:
        """Merge a listing ``(last modified, key, size)``. Keys it lacks that this process did not
        write meanwhile were deleted by another node (forgotten, with ``drop_unlisted``); keys this
        index lacks (and this process did not delete meanwhile) were written by another node. Then
        every listed key is ordered by S3's time for it (or this process's last read, if later), ties
        by key: the same order on every node that lists the same objects, so nodes evicting down to
        one capacity evict the same objects. Returns ``(added, dropped)``."""
        touched = self._touched or set()
        seen = {key: (mtime, size) for mtime, key, size in listed}
        dropped = (
            [key for key in self._sizes if key not in seen and key not in touched] if drop_unlisted else []
        )
        for key in dropped:
            self._bytes -= self._sizes.pop(key)
            del self._stamps[key]
            self._reads.pop(key, None)
        added = 0
        for key, (mtime, size) in seen.items():
            if key in touched:
                continue  # written, read or deleted while listing: this process knows better
            if key not in self._sizes:
                self._sizes[key] = size
                self._bytes += size
                added += 1
            self._stamps[key] = max(mtime, self._reads.get(key, mtime))
        stamps = self._stamps
        self._sizes = OrderedDict(
            sorted(self._sizes.items(), key=lambda item: (stamps[item[0]], item[0].to_bytes()))
        )
        self._touched = None
        return added, len(dropped)

    def _touch(self, key: ObjectKey) -> None:
        if self._touched is not None:
            self._touched.add(key)


class ExistenceCache:
    """Recent answers to "does this object exist?", each trusted for its TTL. Thread-safe."""

    def __init__(self, exists_ttl_s: float, missing_ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl = {True: exists_ttl_s, False: missing_ttl_s}
        self._clock = clock
        self._lock = threading.Lock()
        self._answers: OrderedDict[ObjectKey, tuple[bool, float]] = OrderedDict()  # guarded by _lock

    def remember(self, key: ObjectKey, present: bool) -> None:
        with self._lock:
            self._answers[key] = (present, self._clock() + self._ttl[present])
            self._answers.move_to_end(key)
            while len(self._answers) > EXISTENCE_CACHE_ENTRIES:
                self._answers.popitem(last=False)

    def get(self, key: ObjectKey) -> bool | None:
        """The remembered answer, or ``None`` when there is none (or it expired)."""
        with self._lock:
            entry = self._answers.get(key)
            if entry is None:
                return None
            present, expires_at = entry
            if self._clock() >= expires_at:
                del self._answers[key]
                return None
            return present
