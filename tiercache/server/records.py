"""A bounded record of recent evictions, so ``explain`` can say *why* a chunk is gone.

Every tier reports evicted keys through :attr:`TierStats.listener`; the server points each tier's
listener at one :class:`EvictionRecord`. It keeps the last ``capacity`` evictions with the tier, the
reason and the time; a key evicted more than once is told by its newest.

A store into a full L1 evicts as many objects as it has chunks, and the listener runs under the
tier's lock on the request loop: an eviction batch is kept as one note and its keys' binary forms
joined into one ``bytes`` (35 bytes a key: 3.5 MiB for 100,000 evicted a store's batch at a time,
14 MiB if every one came alone, as a delete's does). Asking is the rare side:
:meth:`EvictionRecord.get_many` splits the batches into keys (milliseconds for a full record).
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from tiercache.keys.object_key import KEY_BYTES, ObjectKey
from tiercache.tier import EvictionReason

_KEY = struct.Struct(f"{KEY_BYTES}s")  # one key's binary form inside a batch's joined bytes
_FIRST = itemgetter(0)


@dataclass(frozen=True, slots=True)
class EvictionNote:
    """Where ``key`` was last evicted from, why, and when (``time.monotonic``)."""

    tier: str
    reason: str
    at: float


class EvictionRecord:
    """Thread-safe bounded record of the last ``capacity`` evictions, by batch.

    :meth:`listener` runs under the tiers' own locks (see ``TierStats.listener``): it joins the
    batch's keys, appends under a private lock and never calls into a tier.
    """

    def __init__(self, capacity: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        # Oldest first: one note per eviction batch and its keys' binary forms, joined.
        self._batches: deque[tuple[EvictionNote, bytes]] = deque()  # guarded by _lock
        self._count = 0  # evictions in _batches; guarded by _lock

    def listener(self, tier: str) -> Callable[[Sequence[ObjectKey], EvictionReason], None]:
        """The callback to install as ``tier.stats.listener`` for the tier named ``tier``."""

        def note(keys: Sequence[ObjectKey], reason: EvictionReason) -> None:
            if not keys:
                return
            batch = (EvictionNote(tier, reason.value, self._clock()), b"".join([key.raw for key in keys]))
            batches = self._batches
            with self._lock:
                batches.append(batch)
                self._count += len(keys)
                excess = self._count - self._capacity
                while excess > 0:  # the oldest go; a batch partly
                    oldest_note, oldest = batches[0]
                    n = len(oldest) // KEY_BYTES
                    if n <= excess:
                        batches.popleft()
                        self._count -= n
                        excess -= n
                    else:
                        batches[0] = (oldest_note, oldest[excess * KEY_BYTES :])
                        self._count -= excess
                        excess = 0

        return note

    def get_many(self, keys: Sequence[ObjectKey]) -> list[EvictionNote | None]:
        """The newest eviction still remembered of each of ``keys`` (``None``: none). Splits every
        batch (outside the lock, which evictions take under the tiers' locks): ask once for all
        the keys of a question."""
        with self._lock:
            batches = list(self._batches)
        wanted = {key.raw for key in keys}
        found: dict[bytes, EvictionNote] = {}
        for note, joined in reversed(batches):  # the newest first: a key's newest note wins
            if len(found) == len(wanted):
                break
            for raw in wanted.intersection(map(_FIRST, _KEY.iter_unpack(joined))):
                found.setdefault(raw, note)
        return [found.get(key.raw) for key in keys]

    def get(self, key: ObjectKey) -> EvictionNote | None:
        """The last eviction of ``key`` still remembered, if any (:meth:`get_many` of one)."""
        return self.get_many([key])[0]

    def age(self, note: EvictionNote) -> float:
        """Seconds since ``note`` was taken."""
        return max(0.0, self._clock() - note.at)

    def __len__(self) -> int:
        """Evictions remembered (a key evicted twice counts twice)."""
        with self._lock:
            return self._count
