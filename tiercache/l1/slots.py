"""The batch operations on L1's slots that the server's request loop uses (:class:`L1Slots`).

Reservations (:meth:`~L1Slots.reserve_many`, :meth:`~L1Slots.commit_many`, and for writers that
went silent :meth:`~L1Slots.abandon_many` and :meth:`~L1Slots.release_quarantined`), read leases
(:meth:`~L1Slots.pin_many`, :meth:`~L1Slots.release_many`) and where their bytes lie in the arena
(:meth:`~L1Slots.slot_of`, :meth:`~L1Slots.lease_slots`): each a batch under one acquisition of
the lock of :class:`~tiercache.l1.core.L1Core`, since a long prompt is hundreds of chunks.
:class:`~tiercache.l1.tier.L1Tier` adds the single-object forms of the tier contract.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from tiercache.errors import LeaseError, ReservationError, TierFullError
from tiercache.keys.digest import digest as digest_of
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.l1.arena import ArenaSlot
from tiercache.l1.core import L1Core, Slot, Ticket
from tiercache.tier.contract import HeldSet, ReadHandle, WriteHandle
from tiercache.tier.stats import EvictionReason

T = TypeVar("T")


class HeldColumns(NamedTuple):
    """The objects of a :meth:`L1Slots.pin_all` hold, field by field, in its keys' order."""

    keys: list[bytes]  # binary forms
    offsets: list[int]
    nbytes: list[int]
    digests: list[int]


#: Builds a NamedTuple handle as its generated ``__new__`` does, minus that Python call (a ticket's
#: holds build one per object of a long prompt).
_new_tuple = tuple.__new__
_NBYTES = operator.attrgetter("nbytes")


class L1Slots(L1Core):
    """Reservations and read leases in batches, and where their bytes lie (module docstring);
    abstract: :class:`~tiercache.l1.tier.L1Tier` is the tier to build."""

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

    def reservation_slots(
        self, handles: Sequence[WriteHandle], build: Callable[[bytes, int, int, int], T]
    ) -> list[T]:
        """``build(key bytes, offset, nbytes, token)`` of each open reservation, where
        :meth:`slot_of` says it lies, under one lock acquisition (a store's reply names one slot
        per object). Raises :class:`ReservationError` if one is no longer open."""
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            reservations = self._reservations
            out = []
            for handle in handles:
                ticket = reservations.get(handle.token)
                if ticket is None or (ticket.slot.key is not handle.key and ticket.slot.key != handle.key):
                    raise ReservationError(self._reservation_gone(handle))
                slot = ticket.slot
                out.append(build(handle.key.raw, slot.offset, slot.nbytes, handle.token))
            return out

    def held_slots(
        self, held: HeldSet, build: Callable[[bytes, int, int, int, int], T], *, count: bool = False
    ) -> list[T]:
        """:meth:`lease_slots` of a :meth:`pin_all` hold, in its keys' order: every slot named with
        the hold's token. ``count``: a client reads the objects now (its pin), counted as
        :meth:`pin_many` counts its reads. Raises :class:`LeaseError` if the hold is no longer open."""
        with self._lock:
            slots, raws = self._open_hold(held)
            if count:
                self._count_reads(slots, raws)
            token = held.token
            return [
                build(raw, slot.offset, slot.nbytes, token, slot.digest) for raw, slot in zip(raws, slots)
            ]

    def held_columns(self, held: HeldSet) -> HeldColumns:
        """:meth:`held_slots` field by field (every slot under ``held.token``): a lookup's reply
        names its ticket's slots so, without an object built for each. Raises
        :class:`LeaseError` if the hold is no longer open."""
        with self._lock:
            slots, raws = self._open_hold(held)
            return HeldColumns(
                list(raws), [s.offset for s in slots], [s.nbytes for s in slots], [s.digest for s in slots]
            )

    def _open_hold(self, held: HeldSet) -> tuple[list[Slot], Sequence[bytes]]:
        """The slots and keys of the open hold ``held`` (under the lock), or :class:`LeaseError`."""
        self._check_open()
        self._sweep(self._clock())
        slots, raws = self._held.get(held.token, (None, ()))
        if slots is None:
            raise LeaseError(
                f"read lease {held.token} of {held.count} objects is not open (released or "
                f"expired after lease_ttl_s={self._config.lease_ttl_s}s); pin the keys again"
            )
        return slots, raws

    def pin_all(self, raws: Sequence[bytes]) -> HeldSet | None:
        """Hold every object of ``raws`` (keys' binary forms) as one lease (one token, one
        deadline), or none of them: ``None`` when one is not committed. Uncounted (see
        :meth:`release_all`). A ticket of a long prompt pins hundreds of objects: a lease per
        object was most of a lookup's cost."""
        with self._lock:
            self._check_open()
            now = self._clock()
            self._sweep(now)
            get = self._objects.get
            if raws and get(raws[-1]) is None:  # a chain's last object first: a partial hit reads one
                return None
            slots = list(map(get, raws))
            if not all(slots):  # (a slot is always true: no Python call per slot)
                return None
            for slot in slots:
                slot.pins += 1  # type: ignore[union-attr]  # all() found each
            token = next(self._tokens)
            expires_at = now + self._config.lease_ttl_s
            self._held[token] = (slots, raws)  # type: ignore[assignment]  # all() found each
            heapq.heappush(self._lease_deadlines, (expires_at, token, token))
            return HeldSet(token, expires_at, len(slots))

    def release_all(self, held: HeldSet, *, read: bool = False) -> int:
        """End a :meth:`pin_all` hold: 0, or ``held.count`` when it had expired first (or was
        released before). ``read``: counted as :meth:`release_many` counts its reads."""
        with self._lock:
            if self._closed:
                return held.count
            self._sweep(self._clock())
            slots, raws = self._held.pop(held.token, (None, ()))
            if slots is None:
                return held.count
            self._unpin_all(slots)
            if read:
                self._count_reads(slots, raws)
            return 0

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        """Reserve a slot for each ``(key, nbytes)`` under one lock acquisition, all or nothing.

        ``tenants`` names each item's tenant (empty: all the default tenant). What a store request
        of many chunks uses; raises :class:`TierFullError` (reserving none) if any does not fit.
        """
        if tenants and len(tenants) != len(items):
            raise ValueError(f"{len(items)} items but {len(tenants)} tenants")
        evicted: list[ObjectKey] = []  # told to the stats once, for the whole batch
        with self._lock:
            self._check_open()
            now = self._clock()
            self._sweep(now)
            try:
                return self._reserve_locked(items, tenants, now, evicted)
            finally:
                if evicted:
                    self.stats.evicted(EvictionReason.CAPACITY, len(evicted), evicted)

    def _reserve_locked(
        self,
        items: Sequence[tuple[ObjectKey, int]],
        tenants: Sequence[bytes],
        now: float,
        evicted: list[ObjectKey],
    ) -> list[WriteHandle]:
        """:meth:`reserve_many` under the lock; appends the keys it evicts to ``evicted``.

        A store's chunks are a few sizes, each rounded once; without quotas, room for the whole
        batch is made first, in the policy's order, so that no allocation fails before its
        eviction (one allocation per object, one heap entry for the batch: its tokens are drawn in
        a row under the lock, as a lease batch's are)."""
        allocator = self._allocator
        sizes: dict[int, int] = {}  # nbytes -> slot size
        needs: list[int] = []
        for key, nbytes in items:
            need = sizes.get(nbytes)
            if need is None:
                if nbytes < 0:
                    raise ValueError(f"cannot reserve a negative size ({nbytes}) for {key}")
                need = sizes[nbytes] = allocator.slot_size(nbytes)
                if need > allocator.capacity:
                    self.stats.add("skipped")
                    raise TierFullError(
                        f"object {key} of {nbytes} bytes is larger than the L1 arena "
                        f"({allocator.capacity} usable bytes); raise --l1-size-gb or use a smaller "
                        "--chunk-size"
                    )
            needs.append(need)
        # Without quotas, room for the batch is made first and its bytes charged once at the end;
        # with them, victims are chosen per object for its tenant, each charge seen as it comes.
        per_object = self._tenants.enforcing
        if not per_object:
            self._make_room(sum(needs), evicted)
        expires_at = now + self._config.reservation_ttl_s
        whole = self._arena.view(0, self._arena.size)  # one bounds check: slots lie in the arena
        reservations, writing, tokens = self._reservations, self._writing, self._tokens
        charge = self._tenants.charge
        handles: list[WriteHandle] = []
        try:
            for i, (key, nbytes) in enumerate(items):
                tenant = tenants[i] if tenants else DEFAULT_TENANT
                need = needs[i]
                offset = allocator.take(need)
                while offset is None:  # quotas, or room made ahead but fragmented
                    victim = self._tenants.choose_victim(
                        tenant, nbytes, self._policy, self._can_evict, self._tenant_of
                    )
                    if victim is None:
                        self.stats.add("skipped")
                        raise TierFullError(self._full_message(key, nbytes, tenant))
                    evicted.append(self._evict(victim))
                    offset = allocator.take(need)
                slot = Slot(key, offset, nbytes, tenant)
                if per_object:
                    self._bytes_held += nbytes
                    charge(tenant, nbytes)
                token = next(tokens)
                reservations[token] = Ticket(slot, expires_at)
                raw = key.raw
                writing[raw] = writing.get(raw, 0) + 1
                buffer = whole[offset : offset + nbytes]
                handles.append(_new_tuple(WriteHandle, (key, nbytes, buffer, token, expires_at)))
        except BaseException:
            if not per_object:
                self._charge_batch(handles, tenants)  # what the undo refunds
            for handle in handles:
                ticket = self._end_reservation(handle.token)
                if ticket is not None:
                    self._free(ticket.slot)
            raise
        if not per_object:
            self._charge_batch(handles, tenants)
        if handles:
            heapq.heappush(self._reservation_deadlines, (expires_at, handles[0].token, handles[-1].token))
        return handles

    def _charge_batch(self, handles: Sequence[WriteHandle], tenants: Sequence[bytes]) -> None:
        """Hold and charge the bytes of ``handles``, reserved for ``tenants`` in order (empty: the
        default tenant), once per tenant."""
        if not tenants:
            total = sum(map(_NBYTES, handles))
            self._bytes_held += total
            self._tenants.charge(DEFAULT_TENANT, total)
            return
        per_tenant: dict[bytes, int] = {}
        for handle, tenant in zip(handles, tenants):
            per_tenant[tenant] = per_tenant.get(tenant, 0) + handle.nbytes
        for tenant, nbytes in per_tenant.items():
            self._bytes_held += nbytes
            self._tenants.charge(tenant, nbytes)

    def _make_room(self, need: int, evicted: list[ObjectKey]) -> None:
        """Evict in the policy's order until ``need`` bytes are free (not necessarily in one
        extent), or nothing more may go; appends the keys to ``evicted``. :meth:`_evict` of each,
        its accounts kept once for the batch (a store into a full L1 evicts one object per chunk)."""
        allocator = self._allocator
        short = need - allocator.free_bytes()
        if short <= 0:
            return
        objects, evict_one, can_evict, free = (
            self._objects,
            self._policy.evict_one,
            self._can_evict,
            allocator.free,
        )
        gone: list[tuple[bytes, int]] = []
        while short > 0:
            victim = evict_one(can_evict)
            if victim is None:
                break
            slot = objects.pop(victim)
            slot.visible = False
            slot.view = None  # as _free: no new lease will hand it out
            short -= free(slot.offset)
            gone.append((slot.tenant, slot.nbytes))
            evicted.append(slot.key)
        self._bytes_held -= sum(nbytes for _, nbytes in gone)
        self._tenants.evicted_many(gone)

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
        committed (its ``committed`` says how many). A reservation that ended without its
        writer's word and is quarantined is released by this (its writer is done writing), then
        refused like any other.
        """
        if digests is None:
            digests = [None] * len(handles)
        if len(digests) != len(handles):
            raise ValueError(f"{len(handles)} reservations but {len(digests)} digests")
        known = [digest_of(h.buffer) if d is None else d for h, d in zip(handles, digests)]
        with self._lock:
            self._check_open()
            self._sweep(self._clock())
            if self._quarantine:  # a writer's late commit frees its quarantined slot (rare)
                for handle in handles:
                    self._writer_done(handle.token)
            done = nbytes = 0
            try:
                for handle, digest in zip(handles, known):
                    nbytes += self._commit_locked(handle, owed, digest)
                    done += 1
            except ReservationError as exc:
                exc.committed = done
                raise
            finally:
                if done:  # one wake-up and one stats update per batch, also when one was refused
                    self._written.notify_all()
                    self.stats.put(
                        nbytes, done, [h.key for h in handles[:done]] if self.stats.arrival else ()
                    )

    def _commit_locked(self, handle: WriteHandle, owed: bool, digest: int) -> int:
        """Publish reservation ``handle`` (under the lock; the caller wakes the waiters of
        :meth:`wait_written`); its payload bytes."""
        ticket = self._reservations.get(handle.token)
        if ticket is None or (ticket.slot.key is not handle.key and ticket.slot.key != handle.key):
            raise ReservationError(self._reservation_gone(handle))
        self._close_reservation(handle.token)
        slot = ticket.slot
        slot.owed = owed
        slot.visible = True
        slot.digest = digest
        old = self._objects.get(slot.key.raw)
        if old is not None:
            self._policy.on_remove(slot.key.raw)
            self._tenants.on_remove(slot.key.raw, old.tenant)
            self._hide(old)
        self._objects[slot.key.raw] = slot
        self._policy.on_insert(slot.key.raw)
        self._tenants.on_insert(slot.key.raw, slot.tenant)
        return slot.nbytes

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

    def pin_many(self, keys: Sequence[ObjectKey], *, count: bool = True) -> list[ReadHandle | None]:
        """Pin several keys under one lock acquisition (what a load request of many chunks uses)."""
        return self._pin_raws([key.raw for key in keys], count)

    def pin_many_raw(self, raws: Sequence[bytes]) -> list[ReadHandle | None]:
        """:meth:`pin_many` of keys in their binary form (``ObjectKey.to_bytes()``, which the
        caller checked), counted as reads: the server's pin request looks its keys up as they came."""
        return self._pin_raws(raws, True)

    def _pin_raws(self, raws: Sequence[bytes], count: bool) -> list[ReadHandle | None]:
        with self._lock:
            self._check_open()
            now = self._clock()
            self._sweep(now)
            handles = self._hold_locked(raws, now)
            if count:
                self._count_reads([self._leases[h.token] for h in handles if h is not None])
                misses = sum(1 for h in handles if h is None)
                if misses:
                    self.stats.add("misses", misses)
            return handles

    def _count_reads(self, slots: Sequence[Slot], raws: Sequence[bytes] = ()) -> None:
        """Count a read of each of ``slots`` (held under the lock; ``raws``: their keys' binary
        forms, where the caller has them): the hits and bytes read, and an access for the eviction
        policy and the tenants' order."""
        if not slots:
            return
        raws = raws or [slot.key.raw for slot in slots]
        self._policy.on_access_many(raws)
        if self._tenants.enforcing:  # without quotas the tenants keep no order to update
            tenant_access = self._tenants.on_access
            for raw, slot in zip(raws, slots):
                tenant_access(raw, slot.tenant)
        self.stats.hit(sum([slot.nbytes for slot in slots]), len(slots))  # (faster than attrgetter's)

    def _hold_locked(self, raws: Sequence[bytes], now: float) -> list[ReadHandle | None]:
        """Pin the keys whose binary forms are ``raws`` (under the lock; :meth:`pin_many` counts the
        reads when asked): one lease per object found and one heap entry for all (a ticket pins
        every object of a long prompt: 512 for 128k tokens), with the loop's lookups hoisted out
        of it. Each handle names its slot's own key object (equal to the one asked for), so that
        the checks of a later release or :meth:`lease_slots` find it by identity."""
        objects, leases, deadlines, tokens = self._objects, self._leases, self._lease_deadlines, self._tokens
        whole: memoryview | None = None
        expires_at = now + self._config.lease_ttl_s
        out: list[ReadHandle | None] = []
        first = token = 0
        for raw in raws:
            slot = objects.get(raw)
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
            reads: list[Slot] = []
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
