"""A bounded record of recent evictions, so ``explain`` can say *why* a chunk is gone.

Every tier reports evicted keys through :attr:`TierStats.listener`; the server points each tier's
listener at one :class:`EvictionRecord`. It keeps the last ``capacity`` keys (an LRU: a key evicted
again moves to the front) with the tier, the reason and the time. ~100k entries cost ~20 MiB.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

from tiercache.keys.object_key import ObjectKey
from tiercache.tier import EvictionReason


@dataclass(frozen=True, slots=True)
class EvictionNote:
    """Where ``key`` was last evicted from, why, and when (``time.monotonic``)."""

    tier: str
    reason: str
    at: float


class EvictionRecord:
    """Thread-safe bounded LRU of :class:`EvictionNote` by key.

    :meth:`listener` runs under the tiers' own locks (see ``TierStats.listener``): it is one dict
    operation under a private lock and never calls into a tier.
    """

    def __init__(self, capacity: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        # By the key's binary form: bytes hash in C, where an ObjectKey calls its Python
        # __hash__ (a store into a full L1 notes as many evictions as it has chunks).
        self._notes: OrderedDict[bytes, EvictionNote] = OrderedDict()  # guarded by _lock

    def listener(self, tier: str) -> Callable[[Sequence[ObjectKey], EvictionReason], None]:
        """The callback to install as ``tier.stats.listener`` for the tier named ``tier``."""

        def note(keys: Sequence[ObjectKey], reason: EvictionReason) -> None:
            entry = EvictionNote(tier, reason.value, self._clock())  # one note for the batch
            raws = [key.raw for key in keys]
            notes = self._notes
            with self._lock:  # the loops in C, but for keys evicted again (moved to the new end)
                again = list(filter(notes.__contains__, raws))  # (keys() & raws would copy them all)
                notes.update(zip(raws, repeat(entry)))
                for raw in again:
                    notes.move_to_end(raw)
                excess = len(notes) - self._capacity
                if excess > 0:
                    deque(map(notes.popitem, repeat(False, excess)), maxlen=0)  # the oldest

        return note

    def get(self, key: ObjectKey) -> EvictionNote | None:
        """The last eviction of ``key`` still remembered, if any."""
        with self._lock:
            return self._notes.get(key.raw)

    def age(self, note: EvictionNote) -> float:
        """Seconds since ``note`` was taken."""
        return max(0.0, self._clock() - note.at)

    def __len__(self) -> int:
        with self._lock:
            return len(self._notes)
