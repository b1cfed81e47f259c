"""Promotion: copy lower-tier hits into L1 and pin what a caller will read, all-or-nothing.

:meth:`Promoter.prefetch` pins L1 hits at once and submits the rest to a bounded executor; the
caller polls the :class:`PrefetchTicket` (the request loop never waits on L2/L3). The bytes of a
promotion land in an invisible L1 reservation and are verified there by the lower tier
(``read_into``); only a verified copy is committed. A ticket settles on the longest boundary whose
objects are all pinned.

A prefetch may also wait, up to ``inflight_wait_s``, for objects whose bytes are being written into
L1 (an open reservation: typically a prefill engine's store still in flight when its decode engine
asks). Such an object is pinned once it is committed, never before; each :meth:`Promoter.poll`
checks again, so the request loop still never blocks. One aborted, expired or still unwritten at the
deadline ends the hit before its chunk, as a failed promotion does.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from time import perf_counter

from tiercache.engine.counters import EngineCounters, IntegrityReport, hold
from tiercache.engine.groups import GroupSpec, needed_keys
from tiercache.errors import IntegrityError, TierError
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.tier.contract import FrontTier, HeldSet, ReadHandle, Tier, WriteHandle

log = logging.getLogger(__name__)


class TicketState(enum.Enum):
    """Where a :class:`PrefetchTicket` stands."""

    PENDING = "pending"  # promotions still running
    READY = "ready"  # ``chunks`` chunks are in L1 and pinned for the caller
    MISS = "miss"  # nothing restorable after all (lower-tier objects vanished or were corrupt)


@dataclass(slots=True)
class PrefetchTicket:
    """Promotion of one lookup's objects into L1; poll with :meth:`TieredEngine.poll
    <tiercache.engine.TieredEngine.poll>`.

    Once READY, ``handles`` pins every object of the first ``chunks`` chunks in L1 (keyed by object
    key) and nothing else; give them back with ``release_ticket``. A ticket asked without local
    reads whose objects were all in L1 holds them as one pin instead, ``held``
    (:meth:`FrontTier.pin_all <tiercache.tier.FrontTier.pin_all>`), and ``handles`` is empty.
    """

    ticket_id: int
    hashes: tuple[bytes, ...]
    groups: tuple[GroupSpec, ...]
    target: int
    tenant: bytes = DEFAULT_TENANT  # whose quota the promoted copies count against
    state: TicketState = TicketState.PENDING
    chunks: int = 0
    handles: dict[ObjectKey, ReadHandle] = field(default_factory=dict)
    released: bool = False
    #: The keys of the first ``target`` chunks (what :func:`needed_keys` gives, each once), built
    #: once (empty for a ticket of :meth:`TieredEngine.hold_front
    #: <tiercache.engine.TieredEngine.hold_front>`, which builds none).
    needed: list[ObjectKey] = field(default_factory=list)
    held: HeldSet | None = None
    _futures: list[Future[bool]] = field(default_factory=list)
    _writing: dict[ObjectKey, float] = field(default_factory=dict)  # key -> monotonic deadline

    def held_until(self) -> float:
        """When the last of its pins ends by itself (monotonic; ``-inf`` when it holds none)."""
        ends = [h.expires_at for h in self.handles.values()]
        if self.held is not None:
            ends.append(self.held.expires_at)
        return max(ends, default=float("-inf"))

    @property
    def awaiting(self) -> int:
        """Objects this ticket still waits for another client to commit (``inflight_wait_s``),
        as opposed to promotions from a lower tier."""
        return len(self._writing)


class Promoter:
    """Moves objects from ``lower`` tiers (fastest first) into ``l1`` on ``workers`` threads."""

    def __init__(
        self,
        l1: FrontTier,
        lower: Sequence[Tier],
        workers: int,
        counters: EngineCounters,
        on_integrity: IntegrityReport,
    ) -> None:
        self._on_integrity = on_integrity
        self._l1 = l1
        self._lower = list(lower)
        self._counters = counters
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards each ticket's ``handles`` and ``released``
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tiercache-promote")

    def prefetch(
        self,
        hashes: Sequence[bytes],
        groups: Sequence[GroupSpec],
        chunks: int,
        *,
        inflight_wait_s: float = 0.0,
        tenant: bytes = DEFAULT_TENANT,
        keys: Sequence[ObjectKey] | None = None,
        local_reads: bool = True,
    ) -> PrefetchTicket:
        """Pin every object the first ``chunks`` chunks need, promoting lower-tier ones (as objects
        of ``tenant``) and waiting up to ``inflight_wait_s`` for those being written into L1.
        Non-blocking. ``keys``: those objects' keys, each once, when the caller has them already (a
        lookup's :attr:`LookupResult.keys <tiercache.engine.lookup.LookupResult.keys>` for
        ``chunks``), in any order; by default built from ``groups`` and ``hashes``.
        ``local_reads=False``: the caller reads nothing through ``handles`` (it hands the objects'
        slots to other processes), so objects all in L1 are held as one pin (``held``)."""
        needed = list(dict.fromkeys(needed_keys(groups, hashes, chunks))) if keys is None else list(keys)
        # The engine's own holds, all under one L1 lock; each hit is timed as its share of the call.
        t0 = perf_counter()
        if not local_reads and needed:
            held = self._l1.pin_all([key.raw for key in needed])
            if held is not None:  # all in L1: nothing to promote or wait for
                self._l1.stats.latency.observe("read", (perf_counter() - t0) / held.count, held.count)
                return self.held(hashes, groups, chunks, held, tenant, needed)
        ticket = PrefetchTicket(next(self._ids), tuple(hashes), tuple(groups), chunks, tenant, needed=needed)
        pinned = self._l1.pin_many(needed, count=False)
        elapsed = perf_counter() - t0
        absent: list[ObjectKey] = []
        if all(pinned):  # every object in L1 (a handle, a non-empty tuple, is always true)
            handles = ticket.handles = dict(zip(needed, pinned))  # type: ignore[arg-type]  # all() says none is None
        else:
            handles = ticket.handles
            for key, handle in zip(needed, pinned, strict=True):
                if handle is not None:
                    handles[key] = handle
                else:
                    absent.append(key)
        if handles:
            self._l1.stats.latency.observe("read", elapsed / len(handles), len(handles))
        writing = self._l1.writing_many(absent) if inflight_wait_s > 0 and absent else [False] * len(absent)
        deadline = time.monotonic() + inflight_wait_s
        for key, being_written in zip(absent, writing, strict=True):
            if being_written:
                ticket._writing[key] = deadline
                self._counters.add("inflight_waits")
            else:
                ticket._futures.append(self._executor.submit(self.promote, ticket, key))
        self.poll(ticket)
        return ticket

    def held(
        self,
        hashes: Sequence[bytes],
        groups: Sequence[GroupSpec],
        chunks: int,
        held: HeldSet,
        tenant: bytes,
        needed: list[ObjectKey] | None = None,
    ) -> PrefetchTicket:
        """A READY ticket of ``chunks`` chunks whose objects ``held`` holds in L1 already (what
        :meth:`prefetch` without local reads makes of a hit all in L1); ``needed``: those objects'
        keys where the caller built them (none: left empty)."""
        return PrefetchTicket(
            next(self._ids),
            tuple(hashes),
            tuple(groups),
            chunks,
            tenant,
            state=TicketState.READY,
            chunks=chunks,
            needed=needed or [],
            held=held,
        )

    def promote(self, ticket: PrefetchTicket, key: ObjectKey) -> bool:
        """Copy ``key`` from the fastest lower tier holding it into L1, and pin it for ``ticket``.

        Blocking (reads L2/L3). ``False`` (counted) when no lower tier could provide a verified copy
        or L1 had no room: the caller recomputes rather than waits.
        """
        l1 = self._l1
        for tier in self._lower:
            dst: list[WriteHandle] = []

            def alloc(nbytes: int, dst: list[WriteHandle] = dst) -> memoryview:
                dst.append(l1.reserve(key, nbytes, tenant=ticket.tenant))  # TierFullError: no room
                return dst[0].buffer

            try:
                t0 = perf_counter()
                found = tier.read_into(key, alloc)
                elapsed = perf_counter() - t0
            except IntegrityError:
                # The tier's own copy was intact: another process wrote into the L1 reservation.
                if dst:
                    l1.abort(dst[0])
                self._on_integrity("promotion", key, None, "")
                break
            except TierError as exc:
                log.debug("promotion of %s from %s failed: %s", key, tier.name, exc)
                if dst:
                    l1.abort(dst[0])
                break  # L1 is full or the tier failed: recompute rather than wait
            if found is None:  # a miss, or corrupt here (then dst held unverified bytes)
                if dst:
                    l1.abort(dst[0])
                continue  # a lower tier may still have it
            tier.stats.latency.observe("read", elapsed)  # hits only: a miss is not a transfer
            t0 = perf_counter()
            # The lower tier's digest of the verified payload: L1's readers check against it.
            l1.commit(dst[0], digest=found)
            l1.stats.latency.observe("write", perf_counter() - t0)
            pinned = hold(l1, key)
            if pinned is None:
                break
            with self._lock:
                late = ticket.released
                if not late:
                    ticket.handles[key] = pinned
            if late:  # the caller gave up on the ticket while we copied
                l1.release(pinned)
            self._counters.add("promotions")
            return True
        self._counters.add("promotion_failures")
        return False

    def promote_one(self, key: ObjectKey) -> ReadHandle | None:
        """Promote ``key`` now (on the caller's thread) and return its L1 pin, or ``None``."""
        ticket = PrefetchTicket(0, (), (), 0)
        return ticket.handles.pop(key) if self.promote(ticket, key) else None

    def _settle(self, ticket: PrefetchTicket) -> None:
        """Decide a finished ticket: the longest boundary whose objects are all pinned."""
        handles = ticket.handles
        boundary = ticket.target
        if len(handles) < len(ticket.needed):  # not every object of the target could be pinned
            needed: list[ObjectKey] = []
            while boundary > 0:
                needed = needed_keys(ticket.groups, ticket.hashes, boundary)
                if all(k in handles for k in needed):
                    break
                boundary -= 1
            keep = set(needed) if boundary > 0 else set()
            drop = [handles.pop(k) for k in [k for k in handles if k not in keep]]
            if drop:
                self._l1.release_many(drop)
        ticket.chunks = boundary
        ticket.state = TicketState.READY if boundary > 0 else TicketState.MISS

    def poll(self, ticket: PrefetchTicket) -> TicketState:
        """Where ``ticket`` stands. Non-blocking."""
        if ticket.state is not TicketState.PENDING:
            return ticket.state
        with self._lock:
            if ticket._writing and not ticket.released:
                self._pin_written(ticket)
            if not ticket._writing and all(f.done() for f in ticket._futures):
                self._settle(ticket)
        return ticket.state

    def _pin_written(self, ticket: PrefetchTicket) -> None:
        """Pin the awaited objects that were committed since; give up on those whose write ended
        without a commit or whose deadline passed (the ticket then settles on a shorter prefix)."""
        keys = list(ticket._writing)
        still = self._l1.writing_many(keys)
        now = time.monotonic()
        for key, writing in zip(keys, still, strict=True):
            handle = hold(self._l1, key)
            if handle is not None:
                ticket.handles[key] = handle
            elif writing and now < ticket._writing[key]:
                continue
            else:
                self._counters.add("inflight_wait_misses")
            del ticket._writing[key]

    def wait(self, ticket: PrefetchTicket, timeout: float | None = None) -> TicketState:
        """Block until ``ticket`` is decided or ``timeout`` passes (on the promotions themselves and
        on L1's commits, not by polling)."""
        end = None if timeout is None else time.monotonic() + timeout
        wait_futures(ticket._futures, timeout)
        while ticket._writing and not ticket.released:
            deadline = max(ticket._writing.values())
            if end is not None:
                deadline = min(deadline, end)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._l1.wait_written(list(ticket._writing), left)
            self.poll(ticket)
        return self.poll(ticket)

    def release(self, ticket: PrefetchTicket, *, read: bool = False) -> int:
        """Unpin everything ``ticket`` holds (``read``: counted as L1 reads, see
        :meth:`~tiercache.l1.tier.L1Tier.release_many`). Safe to call in any state, and twice.
        Returns how many of its leases had expired first (their slots may have been reused
        meanwhile)."""
        for f in ticket._futures:
            f.cancel()
        with self._lock:
            ticket.released = True
            ticket._writing.clear()
            handles, ticket.handles = ticket.handles, {}
            held, ticket.held = ticket.held, None
        lost = 0 if held is None else self._l1.release_all(held, read=read)
        if handles:
            lost += sum(not held for held in self._l1.release_many(list(handles.values()), read=read))
        return lost

    def close(self) -> None:
        """Stop the promotion threads; queued promotions are cancelled."""
        self._executor.shutdown(wait=True, cancel_futures=True)
