"""L1: hot chunks in a shared host-memory arena, the only tier the inference engine copies to/from.

All calls run on the server (usually its request loop) and **never block on I/O**: every method is a
few dict/heap operations plus O(log n) allocator work under one lock; the byte copies happen in the
worker processes through :meth:`L1Tier.slot_of` (or in the caller's thread via ``handle.buffer``).

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

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tiercache.config.parts import L1Config
from tiercache.config.units import format_bytes
from tiercache.errors import (
    ArenaError,
    ConfigError,
    LeaseError,
    ReservationError,
    TierError,
    TierFullError,
)
from tiercache.keys.digest import digest as digest_of
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT, tenant_label
from tiercache.l1.allocator import SlotAllocator
from tiercache.l1.arena import ArenaSlot, SharedArena, reclaim_stale_arenas
from tiercache.l1.policy import EvictionPolicy, make_policy
from tiercache.l1.tenants import TenantLedger
from tiercache.tier.contract import FrontTier, ReadHandle, TierUsage, WriteHandle
from tiercache.tier.stats import EvictionReason, TierStats

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Builds a NamedTuple handle as its generated ``__new__`` does, minus that Python call (a ticket's
#: holds build one per object of a long prompt).
_new_tuple = tuple.__new__


@dataclass(slots=True, eq=False)
class _Slot:
    """One allocation holding one version of one key's bytes."""

    key: ObjectKey
    offset: int
    nbytes: int
    tenant: bytes = DEFAULT_TENANT
    pins: int = 0
    owed: bool = False
    visible: bool = False  # committed and currently the object readers get for ``key``
    digest: int = 0  # the payload's digest, set at commit (its writer's)
    #: The read-only view of the committed bytes every lease of this slot hands out, made at its
    #: first pin (views are never released by their holders; a slot's bytes never change while
    #: it is visible or pinned): a hit costs no new view.
    view: memoryview | None = None


@dataclass(slots=True, eq=False)
class _Ticket:
    """An open reservation on a slot (a read lease is its slot alone: its deadline is in the heap)."""

    slot: _Slot
    expires_at: float


@dataclass(slots=True)
class L1Stats(TierStats):
    """:class:`TierStats` plus the quarantine (module docstring): slots quarantined, released by
    their writer's late commit or abort, freed when ``quarantine_s`` ran out, freed early because a
    quarter of the arena was quarantined; and the bytes quarantined now (a gauge)."""

    quarantined: int = 0
    quarantine_writer_done: int = 0
    quarantine_timed_out: int = 0
    quarantine_overflow: int = 0
    quarantine_bytes: int = 0


#: Share of the arena that quarantined slots may hold; beyond it the oldest are freed early.
QUARANTINE_SHARE = 0.25
#: Abandoned reservations remembered for naming suspects of a corrupt slot.
_ABANDONED_KEPT = 1024


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A reservation that ended without its writer's word: whose writer may still write at
    ``[offset, offset + nbytes)`` (its slot was quarantined, or freed)."""

    token: int
    key: ObjectKey
    offset: int
    nbytes: int
    at: float  # when it was abandoned (the L1 clock)
    reason: str  # "expired" (its TTL passed) or "dropped" (its client's session was dropped)


class L1Tier(FrontTier):
    """The shared-memory tier. See the module docstring for lifetimes and versions.

    Thread-safe: one lock guards all metadata. Owns (creates, and unlinks at :meth:`close`) its
    :class:`SharedArena` unless one is passed in, in which case the caller keeps ownership.
    """

    name = "l1"

    def __init__(
        self,
        config: L1Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        arena: SharedArena | None = None,
    ) -> None:
        super().__init__()
        self.stats: L1Stats = L1Stats()
        self._config = config
        self._clock = clock
        self._allocator = SlotAllocator(config.size_bytes, config.alignment)
        if self._allocator.capacity == 0:
            raise ConfigError(
                f"L1 size {config.size_bytes} bytes is smaller than the alignment {config.alignment}; "
                "raise --l1-size-gb"
            )
        if arena is None:
            if config.name is None:
                removed = reclaim_stale_arenas()
                if removed:
                    log.warning(
                        "removed %d L1 arena(s) left in /dev/shm by servers that died: %s",
                        len(removed),
                        ", ".join(removed),
                    )
            self._arena = SharedArena.create(config.name, config.size_bytes)
            self._owns_arena = True
            # Off the request path: a promotion or store into a page this process never mapped
            # would pay the page fault in its copy.
            self._arena.populate_in_background(self._populated)
        else:
            if arena.size < config.size_bytes:
                raise ArenaError(
                    f"L1 arena {arena.name!r} has {arena.size} bytes but the L1 size is "
                    f"{config.size_bytes}; create a larger arena or lower --l1-size-gb"
                )
            self._arena = arena
            self._owns_arena = False
        # All fields below are guarded by _lock: the index, the open reservations and leases and
        # their expiry heaps, the allocator, the policy and the byte count. Never held across I/O.
        self._lock = threading.Lock()
        # Visible (committed) objects by their key's binary form (ObjectKey.raw): bytes hash and
        # compare in C, where an ObjectKey would call its Python __hash__ and __eq__ on every probe.
        self._objects: dict[bytes, _Slot] = {}
        self._reservations: dict[int, _Ticket] = {}  # token -> open reservation
        self._writing: dict[ObjectKey, int] = {}  # key -> how many of its reservations are open
        # Notified whenever a reservation ends (committed, aborted, expired): wait_written waits on it.
        self._written = threading.Condition(self._lock)
        # token -> the slot of an open read lease (its deadline is in _lease_deadlines)
        self._leases: dict[int, _Slot] = {}
        self._reservation_deadlines: list[tuple[float, int]] = []  # heap of (expires_at, token)
        # Heap of (expires_at, first token, last token): the leases of one batch (tokens drawn in a
        # row under the lock, one deadline) share an entry.
        self._lease_deadlines: list[tuple[float, int, int]] = []
        self._policy: EvictionPolicy[ObjectKey] = make_policy(config.eviction_policy)
        self._tenants = TenantLedger(config)  # bytes per tenant; quotas choose victims
        self._bytes_held = 0  # payload bytes of every live slot (reserved, visible, hidden-but-pinned)
        # Slots of abandoned reservations kept out of use: token -> (slot, until); oldest first.
        self._quarantine: OrderedDict[int, tuple[_Slot, float]] = OrderedDict()
        self._quarantine_limit = int(self._allocator.capacity * QUARANTINE_SHARE)
        self._abandoned: deque[Abandoned] = deque(maxlen=_ABANDONED_KEPT)
        self._tokens = itertools.count(1)
        self._closed = False

    def _populated(self, done: bool, seconds: float) -> None:
        size = format_bytes(self._arena.size)
        if done:
            log.info(
                "L1 arena %s: all %s mapped ahead of the copies in %.1f s", self._arena.name, size, seconds
            )
        else:
            log.info("L1 arena %s: not mapped ahead (closed, or a kernel before 5.14)", self._arena.name)

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

    def slot_of(self, handle: WriteHandle | ReadHandle) -> ArenaSlot:
        """Where an open reservation's or lease's bytes live, for a worker to copy. O(1), server side.

        Raises :class:`ReservationError` / :class:`LeaseError` if the handle is no longer open.
        """
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            if isinstance(handle, WriteHandle):
                ticket = self._reservations.get(handle.token)
                if ticket is None or ticket.slot.key != handle.key:
                    raise ReservationError(self._reservation_gone(handle))
                slot = ticket.slot
            else:
                leased = self._leases.get(handle.token)
                if leased is None or leased.key != handle.key:
                    raise LeaseError(
                        f"read lease {handle.token} for {handle.key} is not open (released or expired "
                        f"after lease_ttl_s={self._config.lease_ttl_s}s); pin the key again"
                    )
                slot = leased
            return ArenaSlot(slot.offset, slot.nbytes)

    def lease_slots(
        self, handles: Sequence[ReadHandle], build: Callable[[bytes, int, int, int, int], T]
    ) -> list[T]:
        """``build(key bytes, offset, nbytes, token, digest)`` of each lease, where :meth:`slot_of`
        says it lies, under one lock acquisition (a lookup's reply names one slot per pinned object:
        512 for a 128k-token prompt; ``build`` is the reply's slot type). Raises :class:`LeaseError`
        if any lease is no longer open."""
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            leases = self._leases
            out = []
            for handle in handles:
                slot = leases.get(handle.token)
                if slot is None or (slot.key is not handle.key and slot.key != handle.key):
                    raise LeaseError(
                        f"read lease {handle.token} for {handle.key} is not open (released or expired "
                        f"after lease_ttl_s={self._config.lease_ttl_s}s); pin the key again"
                    )
                out.append(build(handle.key.raw, slot.offset, slot.nbytes, handle.token, slot.digest))
            return out

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

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        """Reserve a slot for each ``(key, nbytes)`` under one lock acquisition, all or nothing.

        ``tenants`` names each item's tenant (empty: all the default tenant). What a store request
        of many chunks uses; raises :class:`TierFullError` (reserving none) if any does not fit.
        """
        if tenants and len(tenants) != len(items):
            raise ValueError(f"{len(items)} items but {len(tenants)} tenants")
        handles: list[WriteHandle] = []
        evicted: list[ObjectKey] = []  # told to the stats once, for the whole batch
        with self._lock:
            self._check_open()
            now = self._clock()
            self._sweep(now)
            try:
                for i, (key, nbytes) in enumerate(items):
                    tenant = tenants[i] if tenants else DEFAULT_TENANT
                    handles.append(self._reserve_locked(key, nbytes, now, tenant, evicted))
            except BaseException:
                for handle in handles:
                    ticket = self._end_reservation(handle.token)
                    if ticket is not None:
                        self._free(ticket.slot)
                raise
            finally:
                if evicted:
                    self.stats.evicted(EvictionReason.CAPACITY, len(evicted), evicted)
        return handles

    def _reserve_locked(
        self, key: ObjectKey, nbytes: int, now: float, tenant: bytes, evicted: list[ObjectKey]
    ) -> WriteHandle:
        """Reserve ``key``'s slot, evicting for room; appends the evicted keys to ``evicted``."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size ({nbytes}) for {key}")
        capacity = self._allocator.capacity
        if self._allocator.slot_size(nbytes) > capacity:
            self.stats.add("skipped")
            raise TierFullError(
                f"object {key} of {nbytes} bytes is larger than the L1 arena ({capacity} usable "
                "bytes); raise --l1-size-gb or use a smaller --chunk-size"
            )
        extent = self._allocator.allocate(nbytes)
        while extent is None:
            victim = self._tenants.choose_victim(
                tenant, nbytes, self._policy, self._can_evict, self._tenant_of
            )
            if victim is None:
                self.stats.add("skipped")
                raise TierFullError(self._full_message(key, nbytes, tenant))
            self._evict(victim)
            evicted.append(victim)
            extent = self._allocator.allocate(nbytes)
        slot = _Slot(key, extent.offset, nbytes, tenant)
        self._bytes_held += nbytes
        self._tenants.charge(tenant, nbytes)
        token = next(self._tokens)
        expires_at = now + self._config.reservation_ttl_s
        self._reservations[token] = _Ticket(slot, expires_at)
        self._writing[key] = self._writing.get(key, 0) + 1
        heapq.heappush(self._reservation_deadlines, (expires_at, token))
        buffer = self._arena.view(slot.offset, nbytes)
        return WriteHandle(key=key, nbytes=nbytes, buffer=buffer, token=token, expires_at=expires_at)

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

    def commit_many(
        self,
        handles: Sequence[WriteHandle],
        *,
        owed: bool = False,
        digests: Sequence[int | None] | None = None,
    ) -> None:
        """Commit several reservations under one lock acquisition, each with its digest
        (``digests`` in order; ``None`` as in :meth:`commit`).

        Raises :class:`ReservationError` at the first one that is not open; those before it are
        committed. A reservation that ended without its writer's word and is quarantined is
        released by this (its writer is done writing), then refused like any other.
        """
        if digests is None:
            digests = [None] * len(handles)
        if len(digests) != len(handles):
            raise ValueError(f"{len(handles)} reservations but {len(digests)} digests")
        known = [digest_of(h.buffer) if d is None else d for h, d in zip(handles, digests)]
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            for handle in handles:
                self._writer_done(handle.token)
            done = nbytes = 0
            try:
                for handle, digest in zip(handles, known):
                    nbytes += self._commit_locked(handle, owed, digest)
                    done += 1
            finally:
                if done:  # one stats update per batch, also when a later handle was refused
                    self.stats.put(
                        nbytes, done, [h.key for h in handles[:done]] if self.stats.arrival else ()
                    )

    def _commit_locked(self, handle: WriteHandle, owed: bool, digest: int) -> int:
        ticket = self._reservations.get(handle.token)
        if ticket is None or ticket.slot.key != handle.key:
            raise ReservationError(self._reservation_gone(handle))
        self._end_reservation(handle.token)
        slot = ticket.slot
        slot.owed = owed
        slot.visible = True
        slot.digest = digest
        old = self._objects.get(slot.key.raw)
        if old is not None:
            self._policy.on_remove(slot.key)
            self._tenants.on_remove(slot.key, old.tenant)
            self._hide(old)
        self._objects[slot.key.raw] = slot
        self._policy.on_insert(slot.key)
        self._tenants.on_insert(slot.key, slot.tenant)
        return slot.nbytes

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

    def abandon_many(self, handles: Sequence[WriteHandle]) -> None:
        """End open reservations whose writer may still be writing (the server dropped its
        session): their slots are quarantined (see the module docstring), not freed. O(k log n)."""
        with self._lock:
            if self._closed:
                return
            now = self._clock()
            self._sweep(now)
            for handle in handles:
                ticket = self._reservations.get(handle.token)
                if ticket is not None and ticket.slot.key == handle.key:
                    self._end_reservation(handle.token)
                    self._quarantine_slot(ticket.slot, handle.token, now, "dropped")

    def release_quarantined(self, tokens: Sequence[int]) -> int:
        """The writer of these reservations, abandoned when its session was dropped, says it is
        done with them (its late commit or abort came): free their quarantined slots. How many."""
        with self._lock:
            if self._closed:
                return 0
            return sum(1 for token in tokens if self._writer_done(token))

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
            return [key in writing for key in keys]

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
                if not any(key in self._writing for key in keys):
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

    def pin_many(self, keys: Sequence[ObjectKey], *, count: bool = True) -> list[ReadHandle | None]:
        """Pin several keys under one lock acquisition (what a load request of many chunks uses)."""
        with self._lock:
            self._check_open()
            now = self._clock()
            self._sweep(now)
            handles = self._hold_locked(keys, now)
            if count:
                self._count_reads([self._leases[h.token] for h in handles if h is not None])
                misses = sum(1 for h in handles if h is None)
                if misses:
                    self.stats.add("misses", misses)
            return handles

    def _count_reads(self, slots: Sequence[_Slot]) -> None:
        """Count a read of each of ``slots`` (held under the lock): the hits and bytes read, and an
        access for the eviction policy and the tenants' order."""
        if not slots:
            return
        on_access, tenant_access = self._policy.on_access, self._tenants.on_access
        for slot in slots:
            on_access(slot.key)
            tenant_access(slot.key, slot.tenant)
        self.stats.hit(sum(slot.nbytes for slot in slots), len(slots))

    def _hold_locked(self, keys: Sequence[ObjectKey], now: float) -> list[ReadHandle | None]:
        """Pin ``keys`` (under the lock; :meth:`pin_many` counts the reads when asked): one lease
        per object found and one heap entry for all (a ticket pins every object of a long prompt:
        512 for 128k tokens), with the loop's lookups hoisted out of it. Each handle
        names its slot's own key object (equal to the one asked for), so that the checks of a
        later release or :meth:`lease_slots` find it by identity."""
        objects, leases, deadlines, tokens = self._objects, self._leases, self._lease_deadlines, self._tokens
        whole: memoryview | None = None
        expires_at = now + self._config.lease_ttl_s
        out: list[ReadHandle | None] = []
        first = token = 0
        for key in keys:
            slot = objects.get(key.raw)
            if slot is None:
                out.append(None)
                continue
            slot.pins += 1
            token = next(tokens)
            first = first or token
            leases[token] = slot
            view = slot.view
            if view is None:
                if whole is None:  # one bounds check and one read-only view: slots lie in the arena
                    whole = self._arena.view(0, self._arena.size).toreadonly()
                view = slot.view = whole[slot.offset : slot.offset + slot.nbytes]
            out.append(_new_tuple(ReadHandle, (slot.key, view, token, expires_at, slot.digest)))
        if first:  # the tokens first..token were drawn in a row, under the lock: one heap entry
            heapq.heappush(deadlines, (expires_at, first, token))
        return out

    def release(self, handle: ReadHandle) -> None:
        """End a lease. Releasing twice, after expiry or after close is harmless. O(log n)."""
        self.release_many([handle])

    def release_many(self, handles: Sequence[ReadHandle], *, read: bool = False) -> list[bool]:
        """End several leases under one lock acquisition. Says, per handle, whether its lease was
        still held: ``False`` means it expired first, so its bytes may have been reused while the
        holder read them (a reader must not trust what it copied). ``read``: the leases were the
        engine's own holds (``pin(count=False)``) and a client copied from their slots meanwhile;
        each one still held then counts as the hit (and eviction-policy access) that a pin of its
        own would have counted."""
        held: list[bool] = []
        with self._lock:
            if self._closed:
                return [False] * len(handles)
            self._sweep(self._clock())
            reads: list[_Slot] = []
            for handle in handles:
                slot = self._leases.get(handle.token)
                if slot is not None and (slot.key is handle.key or slot.key == handle.key):
                    del self._leases[handle.token]
                    if read:
                        reads.append(slot)
                    self._unpin(slot)
                    held.append(True)
                else:
                    held.append(False)
            self._count_reads(reads)
        return held

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
            self._reservation_deadlines.clear()
            self._lease_deadlines.clear()
            self._quarantine.clear()
            self.stats.quarantine_bytes = 0
            self._bytes_held = 0
            self._tenants.clear()
        self._arena.close()
        if self._owns_arena:
            self._arena.unlink()

    # -- internals (all called with _lock held) -------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TierError(
                f"L1 tier (arena {self._arena.name!r}) is closed (by its owner, e.g. at server shutdown); "
                "create a new L1Tier"
            )

    def _sweep(self, now: float) -> None:
        """Expire reservations and leases whose deadline passed. O(k log n) for k expired."""
        heap = self._reservation_deadlines
        while heap and heap[0][0] <= now:
            _, token = heapq.heappop(heap)
            ticket = self._end_reservation(token)
            if ticket is not None:
                # Its writer never said it is done: it may be stalled mid-copy.
                self._quarantine_slot(ticket.slot, token, now, "expired")
                self.stats.add("expired_reservations")
        quarantine = self._quarantine
        while quarantine:
            token, (_, until) = next(iter(quarantine.items()))
            if until > now:
                break
            self._end_quarantine(token)
            self.stats.add("quarantine_timed_out")
        leases = self._lease_deadlines
        while leases and leases[0][0] <= now:
            _, first, last = heapq.heappop(leases)
            for token in range(first, last + 1):  # one batch's leases (those released are gone)
                slot = self._leases.pop(token, None)
                if slot is not None:
                    self.stats.add("expired_leases")
                    self._unpin(slot)

    def _quarantine_slot(self, slot: _Slot, token: int, now: float, reason: str) -> None:
        """Keep the slot of reservation ``token``, abandoned for ``reason``, out of use (module
        docstring), or free it where there is no quarantine."""
        self._abandoned.append(Abandoned(token, slot.key, slot.offset, slot.nbytes, now, reason))
        if self._config.quarantine_s <= 0:
            self._free(slot)
            return
        self._quarantine[token] = (slot, now + self._config.quarantine_s)
        self.stats.quarantine_bytes += slot.nbytes  # guarded by _lock, like the quarantine
        self.stats.add("quarantined")
        while self.stats.quarantine_bytes > self._quarantine_limit and self._quarantine:
            self._end_quarantine(next(iter(self._quarantine)))
            self.stats.add("quarantine_overflow")

    def _end_quarantine(self, token: int) -> bool:
        """Free quarantined slot ``token``; whether there was one."""
        found = self._quarantine.pop(token) if token in self._quarantine else None
        if found is None:
            return False
        self.stats.quarantine_bytes -= found[0].nbytes
        self._free(found[0])
        return True

    def _writer_done(self, token: int) -> bool:
        """The writer of reservation ``token`` committed or aborted it: if it was quarantined, it
        is freed now (nothing will write there any more). Whether it was."""
        if self._end_quarantine(token):
            self.stats.add("quarantine_writer_done")
            return True
        return False

    def _end_reservation(self, token: int) -> _Ticket | None:
        """Close reservation ``token`` (the caller frees or publishes its slot) and wake the waiters
        of :meth:`wait_written`."""
        ticket = self._reservations.pop(token, None)
        if ticket is None:
            return None
        key = ticket.slot.key
        left = self._writing[key] - 1
        if left:
            self._writing[key] = left
        else:
            del self._writing[key]
        self._written.notify_all()
        return ticket

    def _can_evict(self, key: ObjectKey) -> bool:
        slot = self._objects.get(key.raw)
        return slot is not None and slot.pins == 0 and not slot.owed

    def _tenant_of(self, key: ObjectKey) -> bytes:
        return self._objects[key.raw].tenant

    def _evict(self, key: ObjectKey) -> None:
        """Drop ``key`` for capacity; the caller tells the stats (once per batch)."""
        slot = self._objects.pop(key.raw)
        slot.visible = False
        self._tenants.evicted(slot.tenant)
        self._free(slot)

    def _unlist(self, key: ObjectKey, slot: _Slot) -> None:
        """Take committed object ``key`` (its ``slot``) out of the index, the policy and its
        tenant's account; its bytes go once no reader holds them."""
        del self._objects[key.raw]
        self._policy.on_remove(key)
        self._tenants.on_remove(key, slot.tenant)
        self._hide(slot)

    def _hide(self, slot: _Slot) -> None:
        """Take a version out of the index's view; free it unless a reader still holds it."""
        slot.visible = False
        if slot.pins == 0:
            self._free(slot)

    def _unpin(self, slot: _Slot) -> None:
        slot.pins -= 1
        if slot.pins == 0 and not slot.visible:
            self._free(slot)

    def _free(self, slot: _Slot) -> None:
        slot.view = None  # its holders keep theirs; no new lease will hand it out
        self._allocator.free(slot.offset)
        self._bytes_held -= slot.nbytes
        self._tenants.refund(slot.tenant, slot.nbytes)

    def _reservation_gone(self, handle: WriteHandle) -> str:
        return (
            f"reservation {handle.token} for {handle.key} is not open: already committed or aborted, "
            f"or expired after reservation_ttl_s={self._config.reservation_ttl_s}s; reserve again"
        )

    def _full_message(self, key: ObjectKey, nbytes: int, tenant: bytes) -> str:
        pinned = sum(1 for s in self._objects.values() if s.pins > 0)
        owed = sum(1 for s in self._objects.values() if s.owed and s.pins == 0)
        held = self._tenants.usage(tenant).bytes
        quota = self._tenants.quota(tenant)
        if self._tenants.enforcing and held + nbytes > quota:
            return (
                f"L1 arena full for tenant {tenant_label(tenant)}: cannot fit {key} ({nbytes} bytes). "
                f"It holds {held} bytes against a quota of {quota}, and every object it may evict "
                "(its own, and those of tenants over their quotas) is pinned or owed to a lower tier; "
                "other tenants within their quotas keep theirs. Raise its share (--l1-tenant-quotas) "
                "or --l1-size-gb."
            )
        return (
            f"L1 arena full: cannot fit {key} ({nbytes} bytes). Free {self._allocator.free_bytes()} "
            f"bytes, largest free extent {self._allocator.largest_free()}; nothing left to evict: "
            f"{pinned} objects pinned, {owed} owed to a lower tier, {len(self._reservations)} open "
            f"reservations, {self.stats.quarantine_bytes} bytes quarantined (slots of abandoned "
            "reservations). Release pins, let writes to lower tiers settle, or raise --l1-size-gb."
        )
