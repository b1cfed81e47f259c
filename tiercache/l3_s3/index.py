"""The S3 tier's existence cache: recent HEAD answers with a TTL each, so a lookup of a long prompt
costs a few requests, and a repeated one none. (The tier's other memory of the bucket, what the
capacity bound evicts from, is :mod:`tiercache.l3_s3.capacity`.)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from tiercache.keys.object_key import ObjectKey

#: Bound on remembered existence answers, so a long-running server's memory stays flat.
EXISTENCE_CACHE_ENTRIES = 1 << 18


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
