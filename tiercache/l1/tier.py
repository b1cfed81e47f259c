"""L1: hot chunks in a shared host-memory arena, the only tier the inference engine copies to/from.

All calls run on the server (usually its request loop) and **never block on I/O**: every method is a
few dict/heap operations plus O(log n) allocator work under one lock; the byte copies happen in the
worker processes through :meth:`L1Tier.slot_of` (or in the caller's thread via ``handle.buffer``).
One object in three layers: :mod:`~tiercache.l1.core` (the records, the state and the internals
under the lock), :mod:`~tiercache.l1.slots` (the batches of reservations and leases the request
loop uses) and here the tier contract.

Lifetimes, all measured with the injected ``clock`` and swept lazily at the start of each call
(no timer thread):

* a reservation (:meth:`~L1Tier.reserve`) that is neither committed nor aborted within
  ``reservation_ttl_s`` is freed and counted in ``stats.expired_reservations``;
* a read lease (:meth:`~L1Tier.pin`) older than ``lease_ttl_s`` stops protecting its object and is
  counted in ``stats.expired_leases``; its bytes may then be reused. TTLs must therefore exceed the
  slowest copy a healthy worker does — they exist to reclaim memory from crashed clients.

Versions: a key's committed bytes live in one slot. Overwriting (reserve + commit under the same key)
or deleting a pinned object hides it from new readers at once, but its slot is freed only when the last
pin on it ends, so a reader never sees its bytes change under it.

Integrity: every committed object carries its payload digest (:mod:`tiercache.keys.digest`), the
writer's, and every lease hands it out with the slot. The arena is shared memory that every client
maps writable, so L1 cannot keep a late, stalled or buggy writer from scribbling on it; what it does:

* **quarantine**: the slot of a reservation that ended without its writer's word (expired, or
  :meth:`L1Tier.abandon_many` when the server drops the writer's session) is not reused for
  ``quarantine_s`` unless that writer commits or aborts it meanwhile (then it has stopped writing),
  so a writer that resumes late writes into dead space, not into another object. At most a quarter
  of the arena is held so (the oldest go first beyond it);
* **detection**: readers check what they copied against the digest; a mismatch is a miss, reported
  back (:meth:`L1Tier.recheck` re-checks the slot and drops the object), and the recent
  abandoned reservations overlapping the slot are the suspects (:meth:`L1Tier.abandoned_over`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from tiercache.config.parts import L1Config
from tiercache.keys.digest import digest as digest_of
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.l1.arena import SharedArena
from tiercache.l1.core import QUARANTINE_SHARE, Abandoned, L1Stats
from tiercache.l1.slots import L1Slots
from tiercache.tier.contract import ReadHandle, TierUsage, WriteHandle
from tiercache.tier.stats import EvictionReason

# Abandoned and L1Stats live with the state (core) but are named from here, the tier's module.
__all__ = ["QUARANTINE_SHARE", "Abandoned", "L1Stats", "L1Tier"]


class L1Tier(L1Slots):
    """The shared-memory tier. See the module docstring for lifetimes and versions.

    Thread-safe: one lock guards all metadata. Owns (creates, and unlinks at :meth:`close`) its
    :class:`SharedArena` unless one is passed in, in which case the caller keeps ownership.
    """

    name = "l1"

    # -- what the server hands to workers ------------------------------------------------------
    @property
    def arena_name(self) -> str:
        """Name workers pass to :meth:`SharedArena.attach`."""
        return self._arena.name

    @property
    def arena(self) -> SharedArena:
        """This process's mapping of the arena."""
        return self._arena

    @property
    def config(self) -> L1Config:
        """The settings this tier was built with."""
        return self._config

    def free_bytes(self) -> int:
        """Arena bytes not allocated to any slot (possibly fragmented), after expiring what is due."""
        with self._lock:
            self._sweep(self._clock())
            return self._allocator.free_bytes()

    def largest_free(self) -> int:
        """The largest slot that fits without evicting, after expiring what is due."""
        with self._lock:
            self._sweep(self._clock())
            return self._allocator.largest_free()

    # -- writes --------------------------------------------------------------------------------
    def reserve(self, key: ObjectKey, nbytes: int, *, tenant: bytes = DEFAULT_TENANT) -> WriteHandle:
        """Allocate a slot for ``key`` (an object of ``tenant``), evicting by policy and tenant
        quotas (:mod:`tiercache.l1.tenants`) if needed. Request loop; never blocks.

        Cost: O(1) for a size freed before (quick lists), else O(log n), plus O(1) per eviction.
        Raises :class:`TierFullError` when the object is larger than the arena or everything
        evictable is gone (or, for a tenant over its quota, everything it may evict) and it still
        does not fit.
        """
        return self.reserve_many([(key, nbytes)], tenants=(tenant,))[0]

    def commit(self, handle: WriteHandle, *, owed: bool = False, digest: int | None = None) -> None:
        """Make a filled reservation the visible object for its key. Request loop; O(1) (O(size)
        with ``digest=None``, which hashes the slot).

        A previous version is hidden at once and freed when its last pin ends. ``owed=True`` keeps the
        object from eviction until :meth:`settle`. ``digest`` is the payload's, as its writer
        computed it over its own bytes; ``None`` only for a writer in this process that filled the
        slot from bytes of its own. Raises :class:`ReservationError` if the reservation is unknown,
        already finished or expired.
        """
        self.commit_many([handle], owed=owed, digests=[digest])

    def abort(self, handle: WriteHandle) -> None:
        """Free a reservation (its writer has stopped writing: a quarantined one is freed too); a
        no-op if it already finished. Request loop; O(log n)."""
        with self._lock:
            if self._closed:
                return
            self._sweep(self._clock())
            if self._writer_done(handle.token):
                return
            ticket = self._reservations.get(handle.token)
            if ticket is not None and ticket.slot.key == handle.key:
                self._end_reservation(handle.token)
                self._free(ticket.slot)

    def abandoned_over(self, offset: int, nbytes: int) -> list[Abandoned]:
        """The recent abandoned reservations whose slot overlapped ``[offset, offset + nbytes)``:
        the writers that may have written there late. Newest first."""
        with self._lock:
            return [
                a
                for a in reversed(self._abandoned)
                if a.offset < offset + nbytes and offset < a.offset + a.nbytes
            ]

    def recheck(self, key: ObjectKey, offset: int | None = None) -> bool | None:
        """A reader found the bytes it copied from ``key``'s slot at ``offset`` (``None``: its slot
        now) differ from the object's digest. Re-check the slot: if it still differs, the object is
        dropped (counted as an eviction for ``corrupt``) and ``True``; ``False`` if its bytes match
        now (the reader's copy was torn by a write that has since ended); ``None`` if that object
        is no longer there (replaced, evicted). Hashes the slot outside the lock."""
        with self._lock:
            self._check_open()
            slot = self._objects.get(key.raw)
            if slot is None or (offset is not None and slot.offset != offset):
                return None
            slot.pins += 1  # held while we hash it: never freed and reused meanwhile
            view = self._arena.view(slot.offset, slot.nbytes)
        try:
            intact = digest_of(view) == slot.digest
        finally:
            with self._lock:
                self._unpin(slot)
        if intact:
            return False
        with self._lock:
            if self._objects.get(key.raw) is not slot:
                return None
            self._unlist(key, slot)
            self.stats.add("verify_failures")
        self.stats.evicted(EvictionReason.CORRUPT, keys=(key,))
        return True

    # -- reads ---------------------------------------------------------------------------------
    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` is committed here. O(1); does not count a hit or miss."""
        with self._lock:
            self._check_open()
            return key.raw in self._objects

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Presence of each key under one lock acquisition. O(len(keys))."""
        with self._lock:
            self._check_open()
            objects = self._objects
            return [key.raw in objects for key in keys]

    def committed_keys(self, raws: Sequence[bytes]) -> list[ObjectKey | None]:
        """The committed objects' keys by their binary forms (``None`` where not committed), under
        one lock acquisition and without building a key. O(len(raws))."""
        with self._lock:
            self._check_open()
            objects = self._objects
            return [None if (slot := objects.get(raw)) is None else slot.key for raw in raws]

    def writing_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether a reservation of each key is open (its bytes are being written, not yet
        committed), under one lock acquisition. O(len(keys))."""
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            writing = self._writing
            return [key.raw in writing for key in keys]

    def wait_written(self, keys: Sequence[ObjectKey], timeout: float) -> bool:
        """Block until no reservation of ``keys`` is open (each was committed, aborted or expired),
        or ``timeout`` seconds pass; ``True`` if none is open. For tools and tests: the request loop
        asks :meth:`writing_many` instead."""
        deadline = time.monotonic() + timeout
        with self._written:
            while True:
                if self._closed:
                    return True
                self._sweep(self._clock())
                if not any(key.raw in self._writing for key in keys):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # Bounded: an expiry is noticed by a sweep, and nothing notifies when a TTL passes.
                self._written.wait(min(left, 0.05))

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` are committed here, under one lock acquisition. O(len(keys))."""
        with self._lock:
            self._check_open()
            for i, key in enumerate(keys):
                if key.raw not in self._objects:
                    return i
            return len(keys)

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        """Lease the committed bytes of ``key`` (read-only view) for up to ``lease_ttl_s``. O(1).

        Arena memory is never corrupted by storage, so L1 trusts its bytes: verification happens when
        they arrive from L2/L3. Returns ``None`` (a counted miss) if ``key`` is not committed.
        ``count=False`` is for the engine's own pins (holding a lookup's objects for its ticket, the
        source of a write-through): they serve nobody, so they are neither hits nor misses.
        """
        return self.pin_many([key], count=count)[0]

    def release(self, handle: ReadHandle) -> None:
        """End a lease. Releasing twice, after expiry or after close is harmless. O(log n)."""
        self.release_many([handle])

    # -- management ----------------------------------------------------------------------------
    def delete(self, key: ObjectKey) -> bool:
        """Hide ``key`` now; its bytes are freed at once or when the last pin ends. O(log n)."""
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            slot = self._objects.get(key.raw)
            if slot is None:
                return False
            self._unlist(key, slot)
            self.stats.evicted(EvictionReason.DELETED, keys=(key,))
            return True

    def settle(self, key: ObjectKey) -> None:
        """A lower tier now holds ``key``; it may be evicted from L1 again. O(1)."""
        with self._lock:
            slot = self._objects.get(key.raw)
            if slot is not None:
                slot.owed = False

    def usage(self) -> TierUsage:
        """Payload bytes of every live slot (reservations and still-pinned old versions included)."""
        with self._lock:
            if not self._closed:
                self._sweep(self._clock())
            return TierUsage(
                bytes_used=self._bytes_held,
                bytes_budget=self._config.size_bytes,
                objects=len(self._objects),
            )

    def tenant_of(self, key: ObjectKey) -> bytes:
        """The tenant of the committed object ``key`` (the default tenant if there is none). O(1)."""
        with self._lock:
            slot = self._objects.get(key.raw)
            return DEFAULT_TENANT if slot is None else slot.tenant

    def tenants(self) -> dict[str, dict[str, int]]:
        """Per tenant (labelled as :func:`~tiercache.keys.tenant.tenant_label` does): bytes held,
        objects, quota in bytes, evictions for room, objects committed. O(tenants)."""
        with self._lock:
            if not self._closed:
                self._sweep(self._clock())
            return self._tenants.snapshot()

    @property
    def tenant_quotas(self) -> bool:
        """Whether tenant quotas decide evictions (some share below the whole arena)."""
        return self._tenants.enforcing

    def iter_keys(self) -> Iterator[ObjectKey]:
        """A snapshot of the committed keys. O(n) copy under the lock."""
        with self._lock:
            return iter([slot.key for slot in self._objects.values()])

    def close(self) -> None:
        """Forget every object, unmap the arena and unlink it if this tier created it. Idempotent.

        Buffers already handed out stay readable until dropped (see :meth:`SharedArena.close`).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._objects.clear()
            self._reservations.clear()
            self._writing.clear()
            self._written.notify_all()
            self._leases.clear()
            self._held.clear()
            self._reservation_deadlines.clear()
            self._lease_deadlines.clear()
            self._quarantine.clear()
            self.stats.quarantine_bytes = 0
            self._bytes_held = 0
            self._tenants.clear()
        self._arena.close()
        if self._owns_arena:
            self._arena.unlink()
