"""The data path's requests: registration, lookup and promotion tickets, the arena's two-phase
stores and loads, and bytes over the socket for tools.

Stores and pins touch only L1, which never blocks: they are answered on the request loop. Anything
that may touch L2/L3 (registration, lookups, gets, deletes) is offloaded to the I/O executor, save a
lookup that L1 answers alone (every object of every chunk asked for is there: no other tier could
lengthen the hit), answered on the loop too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from operator import itemgetter

from tiercache.config.connector import MAX_INFLIGHT_WAIT_S
from tiercache.config.parts import ServerOptions
from tiercache.engine import (
    GroupSpec,
    LookupResult,
    PrefetchTicket,
    TailLookup,
    TicketState,
    TieredEngine,
)
from tiercache.engine.counters import Throttle
from tiercache.errors import ReservationError
from tiercache.keys.fingerprint import Fingerprint, GroupKind, LayoutManifest
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.front import ArenaFront
from tiercache.server.layouts import Layouts, check_hashes
from tiercache.server.replies import (
    Complete,
    Handler,
    Offload,
    Refused,
    check_keys,
    parse_key,
    parse_keys,
    parse_tenant_id,
)
from tiercache.server.sessions import Session, Sessions, leased_objects
from tiercache.server.tenants import TenantLookups
from tiercache.tier.latency import LatencySet
from tiercache.wire import protocol as p

log = logging.getLogger(__name__)

#: A ticket's state as the wire names it (an enum's call by value costs a lookup's microseconds).
_STATE_NAMES = {state: p.TicketStateName(state.value) for state in TicketState}
_FIRST, _SECOND = itemgetter(0), itemgetter(1)  # a store's (key, nbytes) items

#: Outcomes a lookup's latency is recorded under (``tiercache_lookup_duration_seconds{outcome}``).
LOOKUP_OUTCOMES = ("hit", "miss", "error")


@dataclasses.dataclass(frozen=True)
class _Asked:
    """A lookup being answered: the request, and what the loop knew of it on arrival."""

    msg: p.Lookup
    tenant: bytes  # its tenant id (parsed)
    wait: float  # seconds its ticket may wait for objects in flight (0 without a prefetch)
    identity: bytes
    received: float  # perf_counter() at its arrival


@dataclasses.dataclass(frozen=True)
class _Answer:
    """A lookup's reply before its ticket is settled; ``polled``: what the ticket's polls say
    (``chunks``, ``blocks``)."""

    reply: p.LookupReply
    ticket: PrefetchTicket | None = None
    polled: tuple[int, int] = (0, 0)


class DataOps:
    """Handlers of the data path's requests. Every method runs on the request loop."""

    def __init__(
        self,
        engine: TieredEngine,
        l1: ArenaFront,
        options: ServerOptions,
        sessions: Sessions,
        layouts: Layouts,
        offload: Offload,
        arrival: Callable[[], float],
        tenants: TenantLookups,
        complete: Complete,
    ) -> None:
        self._engine = engine
        self._l1 = l1
        self._options = options
        self._sessions = sessions
        self._layouts = layouts
        self._offload = offload
        self._arrival = arrival  # perf_counter() when the request being handled arrived
        self._tenants = tenants
        self._complete = complete  # answers computed on the loop go out as the executor's do
        self._late_commits = Throttle()
        #: Seconds from a lookup's arrival to its reply's send, by outcome (observed on the loop).
        self.lookup_latency = LatencySet(LOOKUP_OUTCOMES)

    def handlers(self) -> dict[type, Handler]:
        return {
            p.RegisterEngine: self.register,
            p.Lookup: self.lookup,
            p.PollTicket: self.poll_ticket,
            p.ReleaseTicket: self.release_ticket,
            p.ReleaseTickets: self.release_tickets,
            p.Reserve: self.reserve,
            p.Commit: self.commit,
            p.Abort: self.abort,
            p.Pin: self.pin,
            p.Release: self.release,
            p.Corrupt: self.corrupt,
            p.Put: self.put,
            p.Get: self.get,
            p.Delete: self.delete,
        }

    # -- registration ----------------------------------------------------------------------------
    def register(self, session: Session, msg: p.RegisterEngine) -> None:
        parsed = self._layouts.check(msg)

        def job() -> list[tuple[int, Fingerprint, LayoutManifest]]:
            return [(group, self._engine.register_manifest(m), m) for group, m in parsed]

        def finish(done: list[tuple[int, Fingerprint, LayoutManifest]]) -> p.Message:
            return p.RegisterReply(groups=[self._layouts.record(fp, group, m) for group, fp, m in done])

        self._offload(session, msg.req_id, job, finish)

    # -- lookup and promotion --------------------------------------------------------------------
    def lookup(self, session: Session, msg: p.Lookup) -> None:
        if msg.releases:  # the client's earlier tickets first: their objects may go, its room grows
            self._sessions.release_tickets(session, msg.releases)
        check_hashes(msg.hashes)
        if not msg.groups:
            raise Refused(p.ErrorCode.INVALID, "lookup needs at least one group")
        if not 0 <= msg.inflight_wait_s <= MAX_INFLIGHT_WAIT_S:
            raise Refused(
                p.ErrorCode.INVALID,
                f"inflight_wait_s={msg.inflight_wait_s} is outside 0..{MAX_INFLIGHT_WAIT_S} seconds",
            )
        if msg.prefetch:
            self._sessions.room_for_ticket(session, time.monotonic())
        asked = _Asked(
            msg,
            tenant=parse_tenant_id(msg.tenant),
            wait=msg.inflight_wait_s if msg.prefetch else 0.0,
            identity=session.identity,
            received=self._arrival(),
        )
        if msg.kind is p.LookupKind.TAIL:
            self._lookup_tail(session, asked)
        else:
            self._lookup_chunks(session, asked)

    def _lookup_chunks(self, session: Session, asked: _Asked) -> None:
        """The longest restorable prefix of the chunks asked; with a prefetch, a ticket pinning it.
        Answered on the loop when L1 holds every object asked (no other tier could lengthen it)."""
        engine, msg = self._engine, asked.msg

        def answer(specs: list[GroupSpec], found: LookupResult) -> _Answer:
            reply = p.LookupReply(chunks=found.chunks, per_tier=found.per_tier)
            if not (msg.prefetch and found.chunks > 0):
                return _Answer(reply)
            target = found.chunks if msg.max_chunks <= 0 else min(found.chunks, msg.max_chunks)
            keys = found.keys if target == found.chunks else None  # the lookup built them
            ticket = engine.prefetch(
                msg.hashes,
                specs,
                target,
                inflight_wait_s=asked.wait,
                tenant=asked.tenant,
                keys=keys,
                local_reads=False,  # clients read the slots; the server reads nothing
            )
            return _Answer(reply, ticket, polled=(ticket.target, 0))  # its polls say what it pins

        def job() -> _Answer:
            specs = self._layouts.resolve(msg.groups)
            return answer(specs, engine.lookup(msg.hashes, specs, inflight=asked.wait > 0))

        known = self._layouts.resolve_known(msg.groups)
        if known is not None and msg.prefetch and not 0 < msg.max_chunks < len(msg.hashes):
            both = engine.hold_front(msg.hashes, known, tenant=asked.tenant)  # the usual case
            if both is not None:
                hit, ticket = both
                reply = p.LookupReply(chunks=hit.chunks, per_tier=hit.per_tier)
                held = _Answer(reply, ticket, polled=(ticket.target, 0))
                self._complete(session, msg.req_id, held, self._answered(asked), self._observed(asked))
                return
        found = None if known is None else engine.lookup_front(msg.hashes, known)
        if known is not None and found is not None:
            self._complete(
                session, msg.req_id, answer(known, found), self._answered(asked), self._observed(asked)
            )
        else:
            self._offload(session, msg.req_id, job, self._answered(asked), self._observed(asked))

    def _lookup_tail(self, session: Session, asked: _Asked) -> None:
        """The one object, every group's, holding the most of the tail blocks asked (a tail's
        blocks are the newest of a sliding window too: every group is asked as full attention);
        with a prefetch, a ticket pinning it alone. Answered on the loop when the best candidate
        is in L1, or there is none."""
        engine, msg = self._engine, asked.msg

        def answer(specs: list[GroupSpec], tail: TailLookup) -> _Answer:
            found = 1 if tail.blocks else 0
            reply = p.LookupReply(chunks=found, blocks=tail.blocks, per_tier=tail.found.per_tier)
            if not (msg.prefetch and tail.blocks):
                return _Answer(reply)
            ticket = engine.prefetch(
                [tail.target],
                specs,
                1,
                inflight_wait_s=asked.wait,
                tenant=asked.tenant,
                keys=tail.found.keys,
                local_reads=False,
            )
            return _Answer(reply, ticket, polled=(found, tail.blocks))

        def as_tail(specs: list[GroupSpec]) -> list[GroupSpec]:
            return [dataclasses.replace(s, kind=GroupKind.FULL_ATTENTION) for s in specs]

        def job() -> _Answer:
            specs = as_tail(self._layouts.resolve(msg.groups))
            return answer(specs, engine.lookup_tail(msg.hashes, specs, inflight=asked.wait > 0))

        known = self._layouts.resolve_known(msg.groups)
        specs = None if known is None else as_tail(known)
        tail = None if specs is None else engine.lookup_tail_front(msg.hashes, specs)
        if specs is not None and tail is not None:
            self._complete(
                session, msg.req_id, answer(specs, tail), self._answered(asked), self._observed(asked)
            )
        else:
            self._offload(session, msg.req_id, job, self._answered(asked), self._observed(asked))

    def _answered(self, asked: _Asked) -> Callable[[_Answer], p.Message | None]:
        """The reply to a lookup once its answer is known (on the loop): counted for its tenant, its
        ticket held for the session that asked, or released if that session went away meanwhile."""

        def finish(answer: _Answer) -> p.Message | None:
            if asked.msg.kind is p.LookupKind.CHUNKS:  # (a tail lookup goes with a chunk lookup)
                self._tenants.record(asked.tenant, len(asked.msg.hashes), answer.reply.chunks)
            if answer.ticket is None:
                return answer.reply
            owner = self._sessions.get(asked.identity)
            if owner is None:
                self._engine.release_ticket(answer.ticket)
                return None
            self._sessions.hold_ticket(owner, answer.ticket, answer.polled)
            return self._ticket_reply(answer.ticket, answer.reply)

        return finish

    def _observed(self, asked: _Asked) -> Callable[[p.Message | None], None]:
        """Times a lookup from its arrival to its reply's send, by outcome."""

        def sent(reply: p.Message | None) -> None:
            if reply is None:  # the client went away: nothing was answered
                return
            outcome = "error"
            if isinstance(reply, p.LookupReply):
                outcome = "hit" if reply.chunks > 0 else "miss"
            self.lookup_latency.observe(outcome, time.perf_counter() - asked.received)

        return sent

    def _ticket_reply(self, ticket: PrefetchTicket, reply: p.LookupReply) -> p.LookupReply:
        state = self._engine.poll(ticket)
        reply.ticket = ticket.ticket_id
        reply.state = _STATE_NAMES[state]
        if state is TicketState.PENDING:
            reply.awaiting = ticket.awaiting
        if state is TicketState.READY:
            reply.ready_chunks = ticket.chunks
            # Once settled, the ticket pins the objects of its ready chunks and nothing else.
            if ticket.held is not None:
                keys, offsets, sizes, digests = self._l1.held_columns(ticket.held)
                reply.held = p.SlotColumns(keys, offsets, sizes, [ticket.held.token] * len(keys), digests)
            else:
                reply.held = p.SlotColumns.of(self._l1.lease_slots(list(ticket.handles.values()), p.Slot))
            reply.arena = self._l1.arena_name
        return reply

    def poll_ticket(self, session: Session, msg: p.PollTicket) -> p.Message:
        ticket = self._sessions.ticket(session, msg.ticket)
        chunks, blocks = session.found.get(msg.ticket, (ticket.target, 0))
        return self._ticket_reply(ticket, p.LookupReply(chunks=chunks, blocks=blocks, per_tier={}))

    def release_tickets(self, session: Session, msg: p.ReleaseTickets) -> None:
        self._sessions.release_tickets(session, msg.releases)

    def release_ticket(self, session: Session, msg: p.ReleaseTicket) -> p.Message | None:
        self._sessions.end_ticket(session, msg.ticket, read=msg.read)
        return None if msg.quiet else p.Done(count=1)

    # -- store path (L1 only: never blocks) -----------------------------------------------------
    def reserve(self, session: Session, msg: p.Reserve) -> p.Message:
        tenants = [parse_tenant_id(raw) for raw in msg.tenants]
        sizes = list(map(_SECOND, msg.items))  # (the loops over a store's items in C)
        arena = self._l1.arena.size
        if sizes and not (min(sizes) >= 0 and max(sizes) <= arena):
            bad = next(nbytes for nbytes in sizes if not 0 <= nbytes <= arena)
            raise Refused(p.ErrorCode.INVALID, f"cannot reserve {bad} bytes in an arena of {arena}")
        self._sessions.room_for_reserve(session, len(sizes), sum(sizes), time.monotonic())
        keys = parse_keys(list(map(_FIRST, msg.items)))
        items = list(zip(keys, sizes))
        for target, blocks in msg.holds:
            check_hashes([target, *blocks])
        handles = self._engine.reserve_many(items, tenants=tenants)  # counts a batch L1 has no room for
        for target, blocks in msg.holds:
            self._engine.index_blocks(target, blocks)
        self._sessions.hold_reservations(session, handles)
        slots: list[p.Slot | None] = list(self._l1.reservation_slots(handles, p.Slot))  # one lock
        return p.SlotsReply(slots=slots)

    def commit(self, session: Session, msg: p.Commit) -> p.Message | None:
        if len(msg.digests) != len(msg.tokens):
            raise Refused(
                p.ErrorCode.INVALID,
                f"a commit names {len(msg.tokens)} reservations but {len(msg.digests)} digests: give each "
                "object's payload digest (xxh3-64 of the bytes written, computed over the writer's own "
                "memory); install the same tiercache version on the client",
            )
        covered = [parse_key(raw) for raw in msg.supersedes]
        handles = self._sessions.claim_reservations(session, msg.tokens)
        try:
            self._engine.commit_many(handles, msg.digests)  # one call into L1 for the whole store
        except ReservationError as exc:
            # Those before it are committed; it expired before its commit: whatever the client
            # wrote landed in a quarantined slot. Those after it stay the client's, as they were.
            self._sessions.forget_reservations(session, handles[: exc.committed + 1])
            late = handles[exc.committed]
            held = self._late_commits.allow()
            if held is not None:
                log.warning(
                    "client %r committed reservation %d of %s after it expired (--l1-reservation-ttl-s "
                    "%.0f s): refused, and its slot had been kept out of use, so its late bytes "
                    "touched no other object%s",
                    session.name,
                    late.token,
                    late.key,
                    self._l1.config.reservation_ttl_s,
                    f" ({held} more since the last such warning)" if held else "",
                )
            raise
        self._sessions.forget_reservations(session, handles)
        done = p.Done(count=len(handles))
        if not covered:
            return done
        # Only now, once the chunk that covers them is visible; off the loop (the disk's deletes
        # are write transactions). A busy executor leaves the tails to eviction: still correct.
        try:
            self._offload(session, msg.req_id, lambda: self._engine.supersede(covered), lambda _: done)
        except Refused:
            return done
        return None

    def abort(self, session: Session, msg: p.Abort) -> p.Message:
        handles = self._sessions.claim_reservations(session, msg.tokens)
        self._sessions.forget_reservations(session, handles)
        for handle in handles:
            self._engine.abort(handle)
        return p.Done(count=len(handles))

    def pin(self, session: Session, msg: p.Pin) -> p.Message:
        sessions = self._sessions
        if msg.releases:  # the client's earlier leases first: their objects may go, its room grows
            sessions.end_leases(sessions.own_leases(session, msg.releases))
        check_keys(msg.keys)
        sessions.room_for_holds(session, len(msg.keys), time.monotonic())
        t0 = time.perf_counter()
        # Every object in L1 (a load's usual case): one hold for all, one token, as a lookup's.
        whole = self._l1.pin_all(msg.keys) if msg.keys else None
        if whole is not None:
            slots: list[p.Slot | None] = list(self._l1.held_slots(whole, p.Slot, count=True))
            reads = len(slots)
            self._engine.note_reads(map(ObjectKey.from_bytes, msg.keys))  # S3 admission ``read``
            sessions.hold_leases(session, [whole])
        else:  # a miss among them (rare: loads pin what they found): a lease per object found
            handles = self._l1.pin_many_raw(msg.keys)
            held = [h for h in handles if h is not None]
            reads = len(held)
            self._engine.note_reads(h.key for h in held)
            sessions.hold_leases(session, held)
            found = iter(self._l1.lease_slots(held, p.Slot))  # one lock round trip for every slot
            slots = [None if h is None else next(found) for h in handles]
        if reads:  # one lock round trip for all: each hit gets its share, as a "read" of L1
            self._l1.stats.latency.observe("read", (time.perf_counter() - t0) / reads, reads)
        return p.SlotsReply(slots=slots)

    def release(self, session: Session, msg: p.Release) -> p.Message | None:
        sessions = self._sessions
        if msg.quiet:
            sessions.end_leases(sessions.own_leases(session, msg.tokens))
            return None
        handles = sessions.claim_leases(session, msg.tokens)
        sessions.forget_leases(session, handles)
        return p.Released(count=leased_objects(handles), lost=sessions.end_leases(handles))

    def corrupt(self, session: Session, msg: p.Corrupt) -> None:
        """A client's copies out of these slots did not match their digests: re-check each (off
        the loop: it hashes the slot), drop the corrupt, count and log with the suspects."""
        objects = [(parse_key(raw), offset, nbytes) for raw, offset, nbytes in msg.objects]
        suspects = [
            self._sessions.suspects(self._l1.abandoned_over(offset, nbytes)) for _, offset, nbytes in objects
        ]

        def job() -> int:
            found = [
                self._engine.integrity_failure("l1_read", key, offset, who)
                for (key, offset, _), who in zip(objects, suspects)
            ]
            return sum(1 for f in found if f)

        self._offload(session, msg.req_id, job, lambda n: p.Done(count=n))

    # -- bytes over the socket (tools, remote clients) ------------------------------------------
    def put(self, session: Session, msg: p.Put) -> p.Message:
        return p.Done(count=int(self._engine.put(parse_key(msg.key), msg.data)))

    def get(self, session: Session, msg: p.Get) -> None:
        key = parse_key(msg.key)
        limit = self._options.max_message_bytes

        def finish(data: bytes | None) -> p.Message:
            if data is not None and len(data) > limit - 1024:
                raise Refused(
                    p.ErrorCode.TOO_LARGE,
                    f"{key} has {len(data)} bytes, over max_message_bytes {limit}; load it through the arena",
                )
            return p.DataReply(data=data)

        self._offload(session, msg.req_id, lambda: self._engine.get(key), finish)

    def delete(self, session: Session, msg: p.Delete) -> None:
        key = parse_key(msg.key)
        self._offload(session, msg.req_id, lambda: self._engine.delete(key), lambda n: p.Done(count=n))


__all__ = ["LOOKUP_OUTCOMES", "DataOps"]
