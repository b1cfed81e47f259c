"""The S3 tier's memory of the bucket: the capacity index and the existence cache.

* :class:`CapacityIndex` — object size by key, oldest first, and their byte total: what the capacity
  bound evicts from, and what ``usage`` reports without a request. Built from one listing of the
  prefix at start-up, then kept by the tier's own puts, reads and deletes.
* :class:`ExistenceCache` — recent HEAD answers with a TTL each, so a lookup of a long prompt costs a
  few requests, and a repeated one none.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection

from tiercache.keys.object_key import ObjectKey

#: Bound on remembered existence answers, so a long-running server's memory stays flat.
EXISTENCE_CACHE_ENTRIES = 1 << 18


class CapacityIndex:
    """Object sizes by key, oldest first. Not thread-safe: the tier calls it under its own lock.

    While the start-up listing runs (until :meth:`merge_listing`), the keys this process wrote or
    deleted are remembered, so the listing cannot resurrect or resize them with what it saw earlier.
    """

    def __init__(self) -> None:
        self._sizes: OrderedDict[ObjectKey, int] = OrderedDict()
        self._bytes = 0
        self._touched: set[ObjectKey] | None = set()  # None once the listing is merged

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
        self._bytes += size
        self._touch(key)

    def touch(self, key: ObjectKey) -> None:
        """``key`` was read: it becomes the youngest (LRU-ish)."""
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def forget(self, key: ObjectKey) -> None:
        """``key`` is gone from the bucket."""
        old = self._sizes.pop(key, None)
        if old is not None:
            self._bytes -= old
        self._touch(key)

    def restore_oldest(self, key: ObjectKey, size: int) -> None:
        """A deletion of ``key`` failed: it is back, as the oldest, so the next eviction retries it."""
        if key not in self._sizes:
            self._sizes[key] = size
            self._sizes.move_to_end(key, last=False)
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
        """Merge the start-up listing ``(last modified, key, size)``: listed objects oldest first,
        then everything this process wrote meanwhile (newer than anything listed)."""
        touched = self._touched or set()
        merged: OrderedDict[ObjectKey, int] = OrderedDict()
        for _mtime, key, size in sorted(listed, key=lambda t: t[0]):
            if key not in touched:
                merged[key] = size
        for key, size in self._sizes.items():
            merged.pop(key, None)
            merged[key] = size
        self._sizes = merged
        self._bytes = sum(merged.values())
        self._touched = None

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
