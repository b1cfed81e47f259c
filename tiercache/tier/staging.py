"""Reservations held as private buffers until commit, for tiers that cannot write in place.

LMDB and S3 cannot hand out a writable region of their storage to fill; their :meth:`Tier.reserve
<tiercache.tier.Tier.reserve>` allocates a private buffer instead, and their commit writes it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tiercache.errors import ReservationError
from tiercache.keys.object_key import ObjectKey
from tiercache.tier.contract import WriteHandle
from tiercache.tier.stats import TierStats


@dataclass(slots=True)
class _Staged:
    key: ObjectKey
    buffer: bytearray
    expires_at: float


class StagedWrites:
    """Open reservations of one tier: ``reserve`` allocates, ``take`` hands the filled buffer to the
    tier's commit, ``drop`` aborts, ``expire`` sweeps. Thread-safe; counts expiries in
    ``stats.expired_reservations``.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float], stats: TierStats) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._stats = stats
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._open: dict[int, _Staged] = {}  # guarded by _lock

    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        """A zeroed private buffer of ``nbytes`` for ``key``. One allocation."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size ({nbytes}) for {key}")
        buffer = bytearray(nbytes)
        expires_at = self._clock() + self._ttl_s
        with self._lock:
            token = next(self._tokens)
            self._open[token] = _Staged(key, buffer, expires_at)
        return WriteHandle(key, nbytes, memoryview(buffer), token, expires_at)

    def take(self, handle: WriteHandle) -> bytearray:
        """End the reservation and return its filled buffer, or raise :class:`ReservationError`."""
        with self._lock:
            staged = self._open.pop(handle.token, None)
        if staged is None or staged.key != handle.key:
            raise ReservationError(
                f"reservation {handle.token} for {handle.key} is unknown or already finished; reserve again"
            )
        if self._clock() >= staged.expires_at:
            self._stats.add("expired_reservations")
            raise ReservationError(
                f"reservation {handle.token} for {handle.key} expired after {self._ttl_s:g} s; reserve again"
            )
        return staged.buffer

    def drop(self, handle: WriteHandle) -> None:
        """Abort a reservation; harmless if it is already gone."""
        with self._lock:
            self._open.pop(handle.token, None)

    def expire(self) -> None:
        """Drop every reservation whose time is up."""
        now = self._clock()
        with self._lock:
            dead = [t for t, staged in self._open.items() if staged.expires_at <= now]
            for token in dead:
                del self._open[token]
        if dead:
            self._stats.add("expired_reservations", len(dead))
