"""What every L1 operation shares (:class:`L1Core`): the records, the metadata and its one lock.

The index of committed objects, the open reservations and read leases with their expiry heaps, the
quarantine of abandoned reservations, the allocator, the eviction policy and the tenants' ledger,
and the internals that keep them consistent (sweeping what expired, hiding and freeing slots), all
called with ``_lock`` held. :class:`~tiercache.l1.slots.L1Slots` builds the batch operations the
server uses on it, and :class:`~tiercache.l1.tier.L1Tier` the tier contract on those: one object,
so every path sees the same state under the same lock. Lifetimes, versions and the quarantine are
described in :mod:`tiercache.l1.tier`.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.config.parts import L1Config
from tiercache.config.units import format_bytes
from tiercache.errors import ArenaError, ConfigError, TierError
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT, tenant_label
from tiercache.l1.allocator import SlotAllocator
from tiercache.l1.arena import SharedArena, reclaim_stale_arenas
from tiercache.l1.policy import EvictionPolicy, make_policy
from tiercache.l1.tenants import TenantLedger
from tiercache.tier.contract import FrontTier, WriteHandle
from tiercache.tier.stats import TierStats

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Slot:
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
class Ticket:
    """An open reservation on a slot (a read lease is its slot alone: its deadline is in the heap)."""

    slot: Slot
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


class L1Core(FrontTier):
    """L1's state and the internals every operation calls under ``_lock`` (module docstring);
    abstract: :class:`~tiercache.l1.tier.L1Tier` is the tier to build."""

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
        self._open_arena(arena)
        # All fields below are guarded by _lock: the index, the open reservations and leases and
        # their expiry heaps, the allocator, the policy and the byte count. Never held across I/O.
        self._lock = threading.Lock()
        # Visible (committed) objects by their key's binary form (ObjectKey.raw): bytes hash and
        # compare in C, where an ObjectKey would call its Python __hash__ and __eq__ on every probe.
        self._objects: dict[bytes, Slot] = {}
        self._reservations: dict[int, Ticket] = {}  # token -> open reservation
        self._writing: dict[bytes, int] = {}  # key's binary form -> how many of its reservations are open
        # Notified whenever a reservation ends (committed, aborted, expired): wait_written waits on it.
        self._written = threading.Condition(self._lock)
        # token -> the slot of an open read lease (its deadline is in _lease_deadlines)
        self._leases: dict[int, Slot] = {}
        # token -> the slots of an open pin_all hold, each pinned once, and their keys' binary
        # forms (its deadline is in _lease_deadlines as (expires_at, token, token))
        self._held: dict[int, tuple[list[Slot], Sequence[bytes]]] = {}
        # Heaps of (expires_at, first token, last token): the reservations or the leases of one
        # batch (tokens drawn in a row under the lock, one deadline) share an entry.
        self._reservation_deadlines: list[tuple[float, int, int]] = []
        self._lease_deadlines: list[tuple[float, int, int]] = []
        # Keyed by ObjectKey.raw, as the index: bytes hash in C (an ObjectKey calls its Python
        # __hash__ on every reordering, and a ticket's release reorders every object it read).
        self._policy: EvictionPolicy[bytes] = make_policy(config.eviction_policy)
        self._tenants = TenantLedger(config)  # bytes per tenant; quotas choose victims
        self._bytes_held = 0  # payload bytes of every live slot (reserved, visible, hidden-but-pinned)
        # Slots of abandoned reservations kept out of use: token -> (slot, until); oldest first.
        self._quarantine: OrderedDict[int, tuple[Slot, float]] = OrderedDict()
        self._quarantine_limit = int(self._allocator.capacity * QUARANTINE_SHARE)
        self._abandoned: deque[Abandoned] = deque(maxlen=_ABANDONED_KEPT)
        self._tokens = itertools.count(1)
        self._closed = False

    def _open_arena(self, arena: SharedArena | None) -> None:
        """Create this tier's arena (sweeping the arenas of dead servers first when its name is
        the default), or check that ``arena``, which the caller keeps, is large enough."""
        config = self._config
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

    def _populated(self, done: bool, seconds: float) -> None:
        size = format_bytes(self._arena.size)
        if done:
            log.info(
                "L1 arena %s: all %s mapped ahead of the copies in %.1f s", self._arena.name, size, seconds
            )
        else:
            log.info("L1 arena %s: not mapped ahead (closed, or a kernel before 5.14)", self._arena.name)

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
            _, first, last = heapq.heappop(heap)
            for token in range(first, last + 1):  # one batch's (those committed or aborted are gone)
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
            held = self._held.pop(first, None) if first == last else None
            if held is not None:
                self.stats.add("expired_leases", len(held[0]))
                self._unpin_all(held[0])
                continue
            for token in range(first, last + 1):  # one batch's leases (those released are gone)
                slot = self._leases.pop(token, None)
                if slot is not None:
                    self.stats.add("expired_leases")
                    self._unpin(slot)

    def _quarantine_slot(self, slot: Slot, token: int, now: float, reason: str) -> None:
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

    def _end_reservation(self, token: int) -> Ticket | None:
        """Close reservation ``token`` (the caller frees or publishes its slot) and wake the waiters
        of :meth:`wait_written`."""
        ticket = self._close_reservation(token)
        if ticket is not None:
            self._written.notify_all()
        return ticket

    def _close_reservation(self, token: int) -> Ticket | None:
        """:meth:`_end_reservation` without the wake-up: for a batch, whose caller wakes the
        waiters once."""
        ticket = self._reservations.pop(token, None)
        if ticket is None:
            return None
        raw = ticket.slot.key.raw
        left = self._writing[raw] - 1
        if left:
            self._writing[raw] = left
        else:
            del self._writing[raw]
        return ticket

    def _can_evict(self, raw: bytes) -> bool:
        slot = self._objects.get(raw)
        return slot is not None and slot.pins == 0 and not slot.owed

    def _tenant_of(self, raw: bytes) -> bytes:
        return self._objects[raw].tenant

    def _evict(self, raw: bytes) -> ObjectKey:
        """Drop the object keyed ``raw`` for capacity and return its key; the caller tells the
        stats (once per batch)."""
        slot = self._objects.pop(raw)
        slot.visible = False
        self._tenants.evicted(slot.tenant)
        self._free(slot)
        return slot.key

    def _unlist(self, key: ObjectKey, slot: Slot) -> None:
        """Take committed object ``key`` (its ``slot``) out of the index, the policy and its
        tenant's account; its bytes go once no reader holds them."""
        del self._objects[key.raw]
        self._policy.on_remove(key.raw)
        self._tenants.on_remove(key.raw, slot.tenant)
        self._hide(slot)

    def _hide(self, slot: Slot) -> None:
        """Take a version out of the index's view; free it unless a reader still holds it."""
        slot.visible = False
        if slot.pins == 0:
            self._free(slot)

    def _unpin(self, slot: Slot) -> None:
        slot.pins -= 1
        if slot.pins == 0 and not slot.visible:
            self._free(slot)

    def _unpin_all(self, slots: Sequence[Slot]) -> None:
        """:meth:`_unpin` each of ``slots`` (a hold's: one may repeat), its rule batched: the
        counts in one loop, then the hidden ones (rare) looked at, each once."""
        for slot in slots:
            slot.pins -= 1
        # (A comprehension's attribute reads are specialized for slots: faster than attrgetter's.)
        hidden = [slot for slot in slots if not slot.visible]
        for slot in dict.fromkeys(hidden):  # (slots hash by identity)
            if slot.pins == 0:
                self._free(slot)

    def _free(self, slot: Slot) -> None:
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
