"""The tier contract: what L1, L2 and L3 each implement, and all the engine knows of them.

Two-phase moves on every tier:

* **write**: :meth:`Tier.reserve` returns a :class:`WriteHandle` whose ``buffer`` the caller fills,
  then :meth:`Tier.commit` makes the object visible (or :meth:`Tier.abort` drops it). An object is
  never visible before its commit, and a reservation that is never finished expires.
* **read**: :meth:`Tier.pin` returns a :class:`ReadHandle` whose ``buffer`` holds the *verified*
  payload and stays valid until :meth:`Tier.release`. A pinned object is never evicted. A corrupt
  object is a miss (``None``), deleted and counted — never a hit.

Tiers are synchronous and thread-safe. They may block on I/O (LMDB, S3); the engine calls L2/L3 only
from its own bounded executors, never from a request loop. Only :class:`L1 <tiercache.l1.L1Tier>`
promises that its calls do not block on I/O.

Five methods are abstract beyond the write/read pairs; everything else has a default written in terms
of them, which a tier overrides only to be faster (e.g. L2's :meth:`put` writes straight from the
caller's buffer, L3's :meth:`lookup_prefix` searches instead of asking once per chunk).
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tiercache.errors import ReservationError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.latency import LatencySet


class EvictionReason(enum.StrEnum):
    """Why an object left a tier; counted separately in :class:`TierStats`."""

    CAPACITY = "capacity"  # the byte budget needed room
    CORRUPT = "corrupt"  # failed verification on read
    DELETED = "deleted"  # explicit delete / clear
    EXPIRED = "expired"  # lifetime bound reached (L3 capacity on objects this deployment wrote)


class WriteHandle(NamedTuple):
    """A reservation: fill ``buffer`` (exactly ``nbytes``), then commit or abort it.

    Handles are immutable tuples: one is made per chunk on the hottest path, and a tuple is built in
    a third of the time of a frozen dataclass.
    """

    key: ObjectKey
    nbytes: int
    buffer: memoryview
    token: int
    expires_at: float


class ReadHandle(NamedTuple):
    """A pinned, verified object: ``buffer`` is valid until the handle is released."""

    key: ObjectKey
    buffer: memoryview
    token: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes and objects a tier holds against its budget (payload bytes, not file sizes)."""

    bytes_used: int
    bytes_budget: int
    objects: int


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

    def snapshot(self) -> dict[str, object]:
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
    #: Called as ``listener(key, reason)`` for each evicted key a tier names (the server keeps a
    #: bounded record of recent evictions for ``explain``). Runs under the tier's locks: it must be
    #: cheap and must never call back into a tier.
    listener: Callable[[ObjectKey, EvictionReason], None] | None = field(
        default=None, repr=False, compare=False
    )
    #: Seconds per chunk object moved, ``read`` (pin / read into L1) and ``write`` (commit / put).
    #: Recorded by whoever times the call (the engine, around each tier call); not part of
    #: :meth:`snapshot`: :meth:`TieredEngine.latency` reports it, and metrics export it.
    latency: LatencySet = field(
        default_factory=lambda: LatencySet(TRANSFER_OPS), repr=False, compare=False
    )

    def hit(self, nbytes: int) -> None:
        """Count one hit of ``nbytes`` (one lock round trip; hits are the hot path)."""
        with self._lock:
            self.hits += 1
            self.bytes_read += nbytes

    def put(self, nbytes: int, n: int = 1) -> None:
        """Count ``n`` committed writes of ``nbytes`` in all."""
        with self._lock:
            self.puts += n
            self.bytes_written += nbytes

    def evicted(
        self, reason: EvictionReason, n: int = 1, keys: Sequence[ObjectKey] = ()
    ) -> None:
        """Count ``n`` evictions for ``reason``; tell the :attr:`listener` which ``keys`` went."""
        with self._lock:
            self.evictions[reason.value] = self.evictions.get(reason.value, 0) + n
        listener = self.listener
        if listener is not None:
            for key in keys:
                listener(key, reason)


class Tier(ABC):
    """One storage tier. See the module docstring for the contract."""

    #: Short name used in stats, logs and the CLI ("l1", "disk", "s3").
    name: str = "tier"
    #: True when every lookup costs a network round trip (S3): the engine then asks
    #: :meth:`lookup_prefix` for whole runs of keys instead of :meth:`contains` per key.
    remote: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()

    # -- writes --------------------------------------------------------------------------------
    @abstractmethod
    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        """Reserve room for ``nbytes`` under ``key``; evicts if needed.

        Raises :class:`~tiercache.errors.TierFullError` if no room can be made. Reserving a key that is
        already committed is allowed; the new object replaces the old one at commit.
        """

    @abstractmethod
    def commit(self, handle: WriteHandle, *, owed: bool = False) -> None:
        """Make the reserved object visible.

        ``owed=True`` says this is the only copy and a lower tier is still owed it: the tier must not
        evict it until :meth:`settle` is called. Raises :class:`~tiercache.errors.ReservationError` if
        the reservation is unknown, finished or expired.
        """

    @abstractmethod
    def abort(self, handle: WriteHandle) -> None:
        """Drop a reservation; a no-op if it already expired."""

    # -- reads ---------------------------------------------------------------------------------
    @abstractmethod
    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` is (believed) committed here. Cheap; does not verify the bytes."""

    @abstractmethod
    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        """Verified payload of ``key``, held until :meth:`release`; ``None`` on a miss.

        A failed verification deletes the object, counts ``verify_failures`` and returns ``None``.
        ``count=False`` is for the engine's own reads that serve no reader (the source of a write to
        a lower tier): neither a hit nor a miss, and no recency touch.
        """

    @abstractmethod
    def release(self, handle: ReadHandle) -> None:
        """End a pin. Releasing twice or after expiry is harmless."""

    # -- management ----------------------------------------------------------------------------
    @abstractmethod
    def delete(self, key: ObjectKey) -> bool:
        """Remove ``key``; ``True`` if it was there. Pinned objects go once released."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes and objects held against the budget."""

    @abstractmethod
    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every committed key (order unspecified)."""

    def iter_keys_by_use(self) -> Iterator[ObjectKey]:
        """Every committed key, most recently used first where the tier keeps a use order (the
        disk tier's LRU records, the S3 tier's index); :meth:`iter_keys` order otherwise. What
        ``tiercache warm`` promotes first under a byte budget."""
        return self.iter_keys()

    # -- defaults ------------------------------------------------------------------------------
    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview, *, owed: bool = False) -> None:
        """Store ``data`` under ``key`` in one call (reserve, copy, commit)."""
        view = memoryview(data).cast("B")
        handle = self.reserve(key, view.nbytes)
        try:
            handle.buffer[:] = view
        except BaseException:
            self.abort(handle)
            raise
        self.commit(handle, owed=owed)

    def reserve_many(self, items: Sequence[tuple[ObjectKey, int]]) -> list[WriteHandle]:
        """Reserve for each ``(key, nbytes)``, all or nothing (a request storing many chunks).

        Tiers whose per-call overhead matters (L1) override this to take their lock once.
        """
        handles: list[WriteHandle] = []
        try:
            for key, nbytes in items:
                handles.append(self.reserve(key, nbytes))
        except BaseException:
            for handle in handles:
                self.abort(handle)
            raise
        return handles

    def commit_many(self, handles: Sequence[WriteHandle], *, owed: bool = False) -> None:
        """Commit each reservation in order; stops at the first that is not open (raising)."""
        for handle in handles:
            self.commit(handle, owed=owed)

    def pin_many(self, keys: Sequence[ObjectKey]) -> list[ReadHandle | None]:
        """Pin each key; ``None`` for each miss."""
        return [self.pin(key) for key in keys]

    def release_many(self, handles: Sequence[ReadHandle]) -> None:
        """Release each lease."""
        for handle in handles:
            self.release(handle)

    def get(self, key: ObjectKey) -> bytes | None:
        """A verified copy of the payload of ``key``, or ``None`` on a miss."""
        handle = self.pin(key)
        if handle is None:
            return None
        try:
            return bytes(handle.buffer)
        finally:
            self.release(handle)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> bool:
        """Copy the verified payload of ``key`` into ``alloc(payload length)``; ``False`` on a miss.

        For moving an object into a buffer the caller owns (promotion into an L1 reservation). A
        tier may copy first and verify the destination; so after a ``False`` for which ``alloc``
        was called the destination holds unverified bytes and must be discarded. Default: pin,
        copy, release.
        """
        handle = self.pin(key)
        if handle is None:
            return False
        try:
            alloc(handle.buffer.nbytes)[:] = handle.buffer
        finally:
            self.release(handle)
        return True

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """:meth:`contains` for each key; tiers override it to answer in one lock or transaction."""
        return [self.contains(key) for key in keys]

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` are present. Tiers with costly lookups override this."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def put_manifest(self, fingerprint: Fingerprint, data: bytes) -> None:
        """Keep a layout manifest (canonical JSON) beside the data. No-op on tiers that do not persist."""

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        """The manifest stored for ``fingerprint``, or ``None``."""
        return None

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest JSON)``."""
        return iter(())

    def set_eviction_listener(
        self, listener: Callable[[ObjectKey, memoryview], None] | None
    ) -> None:
        """Have ``listener(key, payload)`` called before each capacity eviction (write-back uses it).

        The payload view is only valid during the call. Default: ignored, for tiers whose evictions
        need no write-back.
        """

    def settle(self, key: ObjectKey) -> None:
        """A lower tier now holds ``key``: it may be evicted here. No-op on tiers that never owe."""

    def flush(self, timeout: float | None = None) -> None:
        """Make committed objects durable (LMDB sync). No-op where commit already is durable."""

    def close(self) -> None:
        """Release files, sockets and memory. Idempotent."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Staged:
    key: ObjectKey
    buffer: bytearray
    expires_at: float


class StagedWrites:
    """Reservations held as private buffers until commit, for tiers whose storage cannot hand out
    a writable region to fill in place (LMDB, S3): ``reserve`` allocates, ``take`` hands the filled
    buffer to the tier's commit, ``drop`` aborts, ``expire`` sweeps. Thread-safe; counts expiries in
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
                f"reservation {handle.token} for {handle.key} is unknown or already finished; "
                "reserve again"
            )
        if self._clock() >= staged.expires_at:
            self._stats.add("expired_reservations")
            raise ReservationError(
                f"reservation {handle.token} for {handle.key} expired after {self._ttl_s:g} s; "
                "reserve again"
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

    def clear(self) -> None:
        """Forget every reservation (the tier is closing)."""
        with self._lock:
            self._open.clear()


def deadline(seconds: float) -> float:
    """The monotonic time ``seconds`` from now (handles carry monotonic expiry times)."""
    return time.monotonic() + seconds
