"""Counters every tier keeps, and why objects leave a tier.

:class:`TierStats` lives on each tier (``tier.stats``); the engine and the server read
:meth:`~Counters.snapshot` for ``tiercache inspect`` and metrics. Increments are thread-safe.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercache.keys.object_key import ObjectKey
from tiercache.tier.latency import LatencySet


class EvictionReason(enum.StrEnum):
    """Why an object left a tier; counted separately in :class:`TierStats`."""

    CAPACITY = "capacity"  # the byte budget needed room
    CORRUPT = "corrupt"  # failed verification on read
    DELETED = "deleted"  # explicit delete / clear
    EXPIRED = "expired"  # lifetime bound reached (L3 capacity on objects this deployment wrote)


@dataclass(slots=True)
class Counters:
    """Counters shared between threads: a subclass declares them as fields with defaults.

    :meth:`snapshot` copies every public field that takes part in comparisons (a field declared with
    ``compare=False`` is not a counter).
    """

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, n: int = 1) -> None:
        """Increment counter ``name`` by ``n``."""
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, Any]:
        """A consistent plain-dict copy of every counter (dicts of counts copied too)."""
        with self._lock:
            return {
                name: dict(value) if isinstance(value, dict) else value
                for name, f in self.__dataclass_fields__.items()
                if f.compare and not name.startswith("_")
                for value in (getattr(self, name),)
            }


#: The transfer directions timed per tier (see :attr:`TierStats.latency`).
TRANSFER_OPS = ("read", "write")

#: ``listener(keys, reason)``: told about the objects a tier names as gone, a batch at a time (see
#: :attr:`TierStats.listener`).
RemovalListener = Callable[[Sequence[ObjectKey], EvictionReason], None]
#: ``arrival(keys)``: told about the objects a tier committed, a batch at a time (see
#: :attr:`TierStats.arrival`).
ArrivalListener = Callable[[Sequence[ObjectKey]], None]


@dataclass(slots=True)
class TierStats(Counters):
    """Counters every tier keeps. Thread-safe increments through :meth:`add`."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    verify_failures: int = 0
    errors: int = 0
    skipped: int = 0  # operations not attempted (circuit open, tier full)
    expired_reservations: int = 0
    expired_leases: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    #: Called as ``listener(keys, reason)`` with the evicted keys a tier names, once per batch (the
    #: server keeps a bounded record of recent evictions for ``explain``). Runs under the tier's
    #: locks: it must be cheap and must never call back into a tier.
    listener: RemovalListener | None = field(default=None, repr=False, compare=False)
    #: Called as ``arrival(keys)`` with the objects a tier committed, once per batch (a store, a
    #: write to a lower tier, a promotion into L1; the server's residency log). Same rules as
    #: :attr:`listener`.
    arrival: ArrivalListener | None = field(default=None, repr=False, compare=False)
    #: Seconds per chunk object moved, ``read`` (pin / read into L1) and ``write`` (commit / put).
    #: Recorded by whoever times the call (the engine, around each tier call); not part of
    #: :meth:`snapshot`: the engine's ``latency()`` reports it, and metrics export it.
    latency: LatencySet = field(default_factory=lambda: LatencySet(TRANSFER_OPS), repr=False, compare=False)

    def hit(self, nbytes: int, n: int = 1) -> None:
        """Count ``n`` hits of ``nbytes`` in all (one lock round trip; hits are the hot path)."""
        with self._lock:
            self.hits += n
            self.bytes_read += nbytes

    def put(self, nbytes: int, n: int = 1, keys: Sequence[ObjectKey] = ()) -> None:
        """Count ``n`` committed writes of ``nbytes`` in all; tell the :attr:`arrival` listener
        which ``keys`` they were."""
        with self._lock:
            self.puts += n
            self.bytes_written += nbytes
        arrival = self.arrival
        if arrival is not None and keys:
            arrival(keys)

    def evicted(self, reason: EvictionReason, n: int = 1, keys: Sequence[ObjectKey] = ()) -> None:
        """Count ``n`` evictions for ``reason``; tell the :attr:`listener` which ``keys`` went."""
        with self._lock:
            self.evictions[reason.value] = self.evictions.get(reason.value, 0) + n
        listener = self.listener
        if listener is not None and keys:
            listener(keys, reason)
