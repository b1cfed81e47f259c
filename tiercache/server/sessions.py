"""Who holds what: one session per connected client (ROUTER identity), and the handshake.

On a server with a shared secret a session is also its :class:`~tiercache.wire.auth.SessionSeal`:
the key proved at hello signs every later request and reply, so a connection that copies a client's
routing id, or replays its recorded requests, gets nothing of its session (:meth:`Sessions.verify`).

A session owns the client's open reservations, read leases and promotion tickets; the tokens of all
sessions are indexed so that a client naming another's token is told ``not_owner`` rather than
``unknown_token``. A client silent for the heartbeat timeout loses its session and everything it
held, so a crashed worker cannot leak the arena. Everything here runs on the server's request loop
only: no locks.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any

from tiercache import __version__ as SERVER_VERSION
from tiercache.config.parts import ServerOptions
from tiercache.engine import PrefetchTicket, TieredEngine
from tiercache.l1.core import Abandoned
from tiercache.l1.front import ArenaFront
from tiercache.server.replies import Refused
from tiercache.tier.contract import HeldSet, ReadHandle, WriteHandle
from tiercache.wire import protocol as p
from tiercache.wire.auth import SessionSeal, check_proof, session_key

log = logging.getLogger(__name__)
_TOKEN = attrgetter("token")
_NBYTES = attrgetter("nbytes")

#: Challenges handed out but not yet used (a stranger cannot grow this without bound).
_MAX_PENDING_NONCES = 4096
#: Reservations of dropped sessions remembered for their writer's late commit (see _abandoned).
_MAX_ABANDONED = 4096


@dataclass(slots=True, eq=False)
class Session:
    """What one connected client (ROUTER identity) holds."""

    identity: bytes
    name: str
    last_seen: float
    reservations: dict[int, WriteHandle] = field(default_factory=dict)
    #: Read leases by token: a lease per object, or one hold for every object of a pin that L1
    #: answered whole.
    leases: dict[int, ReadHandle | HeldSet] = field(default_factory=dict)
    #: Objects its leases hold (a hold counts each of its objects): what its bound counts.
    leased_objects: int = 0
    tickets: dict[int, PrefetchTicket] = field(default_factory=dict)
    #: What each ticket's polls say it found: (``chunks``, ``blocks``) of a :class:`LookupReply`.
    found: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: The session key's seal (shared-secret servers only): requests must carry its tag.
    seal: SessionSeal | None = None
    #: Bytes of its open reservations (expired ones included until committed, aborted or dropped).
    reserved_bytes: int = 0
    #: When each ticket was handed out (monotonic): a ticket ends with its leases.
    ticket_at: dict[int, float] = field(default_factory=dict)


def leased_objects(handles: Sequence[ReadHandle | HeldSet]) -> int:
    """Objects ``handles`` hold: a lease one, a hold each of its objects."""
    return len(handles) + sum(h.count - 1 for h in handles if isinstance(h, HeldSet))


class Sessions:
    """Every session, the owner of every open token, and the handshake that opens a session."""

    def __init__(self, engine: TieredEngine, l1: ArenaFront, options: ServerOptions) -> None:
        self._engine = engine
        self._l1 = l1
        self._options = options
        self.by_identity: dict[bytes, Session] = {}
        self._owner: dict[int, bytes] = {}  # reservation/lease token -> client identity
        self._ticket_owner: dict[int, bytes] = {}
        self._nonces: OrderedDict[bytes, bytes] = OrderedDict()
        #: Reservations abandoned when their session was dropped: token -> (client identity, name).
        #: Their writer may still write; its late commit or abort frees the quarantined slot.
        self._abandoned: OrderedDict[int, tuple[bytes, str]] = OrderedDict()
        self.expired = 0  # sessions dropped for missed heartbeats
        self.disconnected = 0  # sessions dropped as their connection closed (unix://)
        self.refused_unsigned = 0  # requests naming a session without its valid, fresh tag
        self.lost_leases = 0  # leases that expired before their release (or their ticket's end)
        # Requests refused because their client was at one of its bounds (--max-*-per-client).
        self.refused_holds = 0
        self.refused_tickets = 0
        self.refused_reserved_bytes = 0
        self.tickets_expired = 0  # tickets whose client let every lease of theirs expire
        # Tickets or leases the session did not hold, named by a rider or a quiet release: skipped.
        self.releases_skipped = 0

    def get(self, identity: bytes) -> Session | None:
        return self.by_identity.get(identity)

    # -- the handshake -------------------------------------------------------------------------
    def challenge(self, identity: bytes) -> p.ChallengeReply:
        """A fresh single-use nonce for ``identity`` to prove the shared secret with."""
        nonce = secrets.token_bytes(32)
        self._nonces[identity] = nonce
        self._nonces.move_to_end(identity)
        while len(self._nonces) > _MAX_PENDING_NONCES:
            self._nonces.popitem(last=False)
        return p.ChallengeReply(nonce=nonce)

    def hello(self, identity: bytes, msg: p.Hello, now: float) -> p.HelloReply:
        """Check the version and the secret's proof, then open (or refresh) the session."""
        if msg.protocol_version != p.PROTOCOL_VERSION:
            raise Refused(
                p.ErrorCode.VERSION_MISMATCH,
                f"client speaks protocol {msg.protocol_version}, this server {p.PROTOCOL_VERSION} "
                f"(tiercache {SERVER_VERSION}); install matching tiercache versions",
            )
        secret = self._options.auth_secret
        seal = None
        if secret:
            nonce = self._nonces.pop(identity, None)
            if nonce is None or not check_proof(secret, nonce, msg.auth):
                raise Refused(
                    p.ErrorCode.AUTH_FAILED,
                    "this server requires the shared secret: give the client the same auth secret "
                    "as the server (--auth-secret / TIERCACHE_AUTH_SECRET)",
                )
            if len(msg.client_nonce) < 16:
                raise Refused(
                    p.ErrorCode.AUTH_FAILED,
                    "a hello to a shared-secret server needs a client nonce of at least 16 bytes; "
                    "install the same tiercache version on the client",
                )
            seal = SessionSeal(session_key(secret, nonce, msg.client_nonce), to_server=False)
        session = self.by_identity.get(identity)
        if session is None:
            session = self.by_identity[identity] = Session(identity, msg.client_name[:128], now)
        else:
            session.last_seen = now
        # A new proof is a new key: what the old key signed (or a copy of it) is not taken again.
        session.seal = seal
        opts = self._options
        return p.HelloReply(
            protocol_version=p.PROTOCOL_VERSION,
            server_version=SERVER_VERSION,
            chunk_size=opts.chunk_size,
            separate_object_groups=opts.separate_object_groups,
            arena_name=self._l1.arena_name,
            arena_size=self._l1.arena.size,
            heartbeat_timeout_s=opts.heartbeat_timeout_s,
            max_message_bytes=opts.max_message_bytes,
            lease_ttl_s=self._l1.config.lease_ttl_s,
            reservation_ttl_s=self._l1.config.reservation_ttl_s,
        )

    def verify(self, session: Session, frame: bytes, tag: bytes | None) -> bool:
        """Whether a request may use ``session``: on a shared-secret server only with the session
        key's tag, fresh (a replay or a copied routing id fails here and is counted)."""
        if session.seal is None:
            return tag is None
        if tag is not None and session.seal.open(frame, tag):
            return True
        self.refused_unsigned += 1
        return False

    # -- per-client bounds --------------------------------------------------------------------
    def room_for_holds(self, session: Session, more: int, now: float) -> None:
        """Refuse (``busy``) a pin or reserve that would take ``session`` past
        ``max_holds_per_client`` leased objects and reservations; leases it let expire long ago
        are dropped first."""
        bound = self._options.max_holds_per_client
        if session.leased_objects + len(session.reservations) + more <= bound:
            return
        self._drop_stale_leases(session, now)
        held = session.leased_objects + len(session.reservations)
        if held + more > bound:
            self.refused_holds += 1
            raise Refused(
                p.ErrorCode.BUSY,
                f"this client holds {held} objects under read leases and reservations, and {more} more "
                f"would pass the server's --max-holds-per-client {bound}: release (or commit) what it "
                "holds first",
            )

    def room_for_reserve(self, session: Session, more: int, nbytes: int, now: float) -> None:
        """:meth:`room_for_holds`, and refuse a reserve that would take ``session``'s open
        reservations past ``max_reserved_share_per_client`` of the arena."""
        self.room_for_holds(session, more, now)
        bound = int(self._options.max_reserved_share_per_client * self._l1.arena.size)
        if session.reserved_bytes + nbytes <= bound:
            return
        live = sum(h.nbytes for h in session.reservations.values() if h.expires_at > now)
        if live + nbytes > bound:
            self.refused_reserved_bytes += 1
            raise Refused(
                p.ErrorCode.BUSY,
                f"this client's open reservations cover {live} bytes, and {nbytes} more would pass the "
                f"server's --max-reserved-share-per-client "
                f"{self._options.max_reserved_share_per_client:g} of the {self._l1.arena.size}-byte arena: "
                "commit or abort them first",
            )

    def room_for_ticket(self, session: Session, now: float) -> None:
        """Refuse (``busy``) a lookup with prefetch while ``session`` holds
        ``max_tickets_per_client`` tickets (those whose leases all expired end first)."""
        bound = self._options.max_tickets_per_client
        if len(session.tickets) < bound:
            return
        self._expire_tickets(session, now)
        if len(session.tickets) >= bound:
            self.refused_tickets += 1
            raise Refused(
                p.ErrorCode.BUSY,
                f"this client holds {len(session.tickets)} promotion tickets, the server's "
                f"--max-tickets-per-client: release the tickets of lookups it is done with",
            )

    def _drop_stale_leases(self, session: Session, now: float) -> None:
        """Forget leases that expired over a heartbeat timeout ago: L1 took them back long since,
        and a client that has not released them by now is not going to (a late release of one
        is ``unknown_token``)."""
        limit = now - self._options.heartbeat_timeout_s
        stale = [h for h in session.leases.values() if h.expires_at < limit]
        if stale:
            self.forget_leases(session, stale)
            self._end(stale)

    def _expire_tickets(self, session: Session, now: float) -> None:
        """End ``session``'s tickets whose leases all expired over a heartbeat timeout ago (and that
        are older than that): what they pinned is no longer held for the client, so they hold
        nothing but memory. Their leases count as lost, as they would at the client's late release:
        the client may have copied from their slots after they expired."""
        grace = self._options.heartbeat_timeout_s
        oldest = now - self._l1.config.lease_ttl_s - grace
        ended = [
            t
            for tid, t in session.tickets.items()
            if session.ticket_at.get(tid, now) < oldest and t.held_until() < now - grace
        ]
        for ticket in ended:
            self.end_ticket(session, ticket.ticket_id)
        self.tickets_expired += len(ended)

    # -- what sessions hold --------------------------------------------------------------------
    def hold_reservations(self, session: Session, handles: Sequence[WriteHandle]) -> None:
        """``session`` holds the reservations ``handles`` (a store's: the loops run in C)."""
        self._hold(session.reservations, handles, session.identity)
        session.reserved_bytes += sum(map(_NBYTES, handles))

    def hold_leases(self, session: Session, handles: Sequence[ReadHandle | HeldSet]) -> None:
        """``session`` holds the read leases ``handles`` (a pin's: the loops run in C)."""
        self._hold(session.leases, handles, session.identity)
        session.leased_objects += leased_objects(handles)

    def end_leases(self, handles: Sequence[ReadHandle | HeldSet]) -> list[int]:
        """End leases and holds the session no longer files (L1 unpins their objects); the tokens
        of those that had expired first, whose every object counts as a lost lease."""
        lost, objects = self._end(handles)
        self.lost_leases += objects
        return lost

    def _end(self, handles: Sequence[ReadHandle | HeldSet]) -> tuple[list[int], int]:
        """:meth:`end_leases` uncounted: the tokens that had expired first, and their objects."""
        leases = [h for h in handles if not isinstance(h, HeldSet)]
        lost = [h.token for h, ok in zip(leases, self._l1.release_many(leases)) if not ok]
        objects = len(lost)
        for held in handles:
            if isinstance(held, HeldSet) and self._l1.release_all(held):
                lost.append(held.token)
                objects += held.count
        return lost, objects

    def hold_ticket(self, session: Session, ticket: PrefetchTicket, found: tuple[int, int]) -> None:
        """``session`` holds ``ticket``, whose lookup reported ``found`` (chunks, blocks: its polls
        say them again)."""
        session.tickets[ticket.ticket_id] = ticket
        session.found[ticket.ticket_id] = found
        session.ticket_at[ticket.ticket_id] = time.monotonic()
        self._ticket_owner[ticket.ticket_id] = session.identity

    def claim_reservations(self, session: Session, tokens: list[int]) -> list[WriteHandle]:
        """The reservations behind ``tokens``, if all are this client's (checked before any is used).
        Tokens of reservations abandoned when this client's earlier session was dropped free their
        quarantined slots (it is done writing them) and are refused."""
        handles: list[WriteHandle] = self._claim(
            session.reservations, tokens, "reservation", session.identity
        )
        return handles

    def _late_writer(self, identity: bytes, tokens: list[int]) -> int:
        """Free the quarantined slots of those of ``tokens`` that ``identity`` held when its session
        was dropped; how many."""
        mine = [t for t in tokens if self._abandoned.get(t, (b"", ""))[0] == identity]
        for token in mine:
            del self._abandoned[token]
        if mine:
            self._l1.release_quarantined(mine)
            log.warning(
                "client %r wrote %d reservation(s) after its session was dropped for missed heartbeats; "
                "the slots were quarantined, so no other object was touched",
                self.by_identity[identity].name if identity in self.by_identity else "?",
                len(mine),
            )
        return len(mine)

    def suspects(self, abandoned: list[Abandoned]) -> str:
        """Who may have written late into a slot, from the abandoned reservations over it: the
        client names and how long ago, for a log line ("" when none is known)."""
        names = []
        for a in abandoned[:3]:
            owner = self._owner.get(a.token)
            if owner is not None and owner in self.by_identity:
                who = self.by_identity[owner].name or owner.hex()
            else:
                who = self._abandoned.get(a.token, (b"", ""))[1] or "a client gone since"
            names.append(f"client {who!r} (reservation {a.token} {a.reason})")
        return ", ".join(names)

    def claim_leases(self, session: Session, tokens: list[int]) -> list[ReadHandle | HeldSet]:
        """The leases behind ``tokens``, if all are this client's (checked before any is used)."""
        handles: list[ReadHandle | HeldSet] = self._claim(session.leases, tokens, "lease")
        return handles

    def forget_reservations(self, session: Session, handles: Sequence[WriteHandle]) -> None:
        """The client is done with ``handles`` (committed or aborted), its own (:meth:`claim_reservations`)."""
        self._forget(session.reservations, handles)
        session.reserved_bytes -= sum(map(_NBYTES, handles))

    def forget_leases(self, session: Session, handles: Sequence[ReadHandle | HeldSet]) -> None:
        """The client released ``handles``, its own (:meth:`claim_leases`)."""
        self._forget(session.leases, handles)
        session.leased_objects -= leased_objects(handles)

    def own_leases(self, session: Session, tokens: Sequence[int]) -> list[ReadHandle | HeldSet]:
        """The leases among ``tokens`` that ``session`` holds, each once, taken from it (a quiet
        release's or a pin's riders); the rest (expired and dropped, another client's, named
        twice) are skipped and counted, never refused: nobody reads a quiet release's refusal."""
        leases = session.leases
        held = [leases[token] for token in dict.fromkeys(tokens) if token in leases]
        self.forget_leases(session, held)
        self.releases_skipped += len(tokens) - len(held)
        return held

    def _hold(self, own: dict[int, Any], handles: Sequence[Any], identity: bytes) -> None:
        """File ``handles`` (reservations or leases) by token in ``own``, a session's, owned by
        ``identity`` (the loops in C: a store or a pin holds one per chunk)."""
        tokens = list(map(_TOKEN, handles))
        own.update(zip(tokens, handles))
        self._owner.update(dict.fromkeys(tokens, identity))

    def _forget(self, own: dict[int, Any], handles: Sequence[Any]) -> None:
        """Take ``handles``, all filed in ``own`` (:meth:`_claim` found them there), out of it and
        out of the owners' map."""
        tokens = list(map(_TOKEN, handles))
        deque(map(own.__delitem__, tokens), maxlen=0)
        deque(map(self._owner.pop, tokens, repeat(None)), maxlen=0)

    def ticket(self, session: Session, ticket_id: int) -> PrefetchTicket:
        """The client's open ticket ``ticket_id``."""
        ticket = session.tickets.get(ticket_id)
        if ticket is None:
            if ticket_id in self._ticket_owner:
                raise Refused(p.ErrorCode.NOT_OWNER, f"ticket {ticket_id} belongs to another client")
            raise Refused(p.ErrorCode.UNKNOWN_TOKEN, f"no open ticket {ticket_id}; look up again")
        return ticket

    def drop_ticket(self, session: Session, ticket_id: int) -> PrefetchTicket:
        """Remove and return the client's open ticket ``ticket_id``."""
        ticket = self.ticket(session, ticket_id)
        del session.tickets[ticket_id]
        session.found.pop(ticket_id, None)
        session.ticket_at.pop(ticket_id, None)
        self._ticket_owner.pop(ticket_id, None)
        return ticket

    def release_tickets(self, session: Session, releases: Sequence[p.TicketRelease]) -> None:
        """End the session's tickets named by ``releases`` (a lookup's riders, or a batch), each
        as a quiet release would; one it does not hold is skipped and counted, never refused:
        the request that carries them is answered all the same."""
        for release in releases:
            if release.ticket not in session.tickets:
                self.releases_skipped += 1
                continue
            self.end_ticket(session, release.ticket, read=release.read)

    def end_ticket(self, session: Session, ticket_id: int, *, read: bool = False) -> None:
        """Drop the client's open ticket ``ticket_id`` and unpin what it holds (``read``: as
        :class:`~tiercache.wire.protocol.ReleaseTicket` says). Its leases that had expired first
        count as lost: a connector worker may have copied from its slots."""
        self.lost_leases += self._engine.release_ticket(self.drop_ticket(session, ticket_id), read=read)

    def _claim(self, own: dict[int, Any], tokens: list[int], kind: str, identity: bytes = b"") -> list[Any]:
        """The handles behind ``tokens`` if all are this client's and each is named once (checked
        before acting on any: a commit, abort or release naming one twice would act on it twice)."""
        if len(set(tokens)) != len(tokens):
            twice = next(token for i, token in enumerate(tokens) if token in tokens[:i])
            action = "a commit or abort" if kind == "reservation" else "a release"
            raise Refused(p.ErrorCode.INVALID, f"{action} names {kind} {twice} twice; name each once")
        handles = []
        for token in tokens:
            handle = own.get(token)
            if handle is None:
                if token in self._owner:
                    raise Refused(p.ErrorCode.NOT_OWNER, f"{kind} {token} belongs to another client")
                late = self._late_writer(identity, tokens) if kind == "reservation" else 0
                if late:
                    raise Refused(
                        p.ErrorCode.UNKNOWN_TOKEN,
                        f"{late} reservation(s) of this client were released when it missed its "
                        "heartbeats: what it wrote since was discarded (its slots were kept out of use). "
                        "Keep the client's process from stalling longer than --heartbeat-timeout-s",
                    )
                raise Refused(
                    p.ErrorCode.UNKNOWN_TOKEN,
                    f"no open {kind} {token}: never issued, already finished, or released when this "
                    "client missed its heartbeats",
                )
            handles.append(handle)
        return handles

    # -- ending sessions -----------------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Drop every session silent for longer than the heartbeat timeout, releasing what it held."""
        limit = self._options.heartbeat_timeout_s
        for session in self.by_identity.values():
            if session.tickets:
                self._expire_tickets(session, now)
        for session in [s for s in self.by_identity.values() if now - s.last_seen > limit]:
            log.info(
                "client %r silent for %.1f s; releasing its reservations and leases",
                session.name,
                now - session.last_seen,
            )
            # Leases it let expire count as lost, as at a late release: it may have copied under them.
            self.lost_leases += self._release(session)
            del self.by_identity[session.identity]
            self.expired += 1

    def drop(self, identity: bytes) -> None:
        """Drop the session of a connection that closed (on ``unix://`` the server sees it go),
        releasing what it held at once, as a heartbeat timeout would later. No session: nothing."""
        session = self.by_identity.pop(identity, None)
        if session is None:
            return
        if session.reservations or session.leases or session.tickets:
            log.info("client %r disconnected; releasing its reservations and leases", session.name)
        self.lost_leases += self._release(session)
        self.disconnected += 1

    def close_all(self) -> None:
        """Release what every session holds (the server is stopping)."""
        for session in list(self.by_identity.values()):
            self._release(session)
        self.by_identity.clear()

    def _release(self, session: Session) -> int:
        """Release everything ``session`` holds; returns how many of its leases (its tickets'
        included) had expired first."""
        lost = 0
        for token in session.reservations:
            self._owner.pop(token, None)
            self._abandoned[token] = (session.identity, session.name)
        while len(self._abandoned) > _MAX_ABANDONED:
            self._abandoned.popitem(last=False)
        if session.reservations:
            # Its writer may still be writing (stalled, not dead): quarantine, never reuse at once.
            self._l1.abandon_many(list(session.reservations.values()))
        if session.leases:
            for token in session.leases:
                self._owner.pop(token, None)
            lost += self._end(list(session.leases.values()))[1]
        for ticket_id, ticket in session.tickets.items():
            self._ticket_owner.pop(ticket_id, None)
            lost += self._engine.release_ticket(ticket)
        session.reservations.clear()
        session.leases.clear()
        session.leased_objects = 0
        session.tickets.clear()
        session.found.clear()
        session.ticket_at.clear()
        session.reserved_bytes = 0
        return lost

    # -- observation ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Clients, and what they hold, for the server's stats."""
        sessions = self.by_identity.values()
        return {
            "clients": len(self.by_identity),
            "reservations": sum(len(s.reservations) for s in sessions),
            "leases": sum(s.leased_objects for s in sessions),  # leased objects
            "tickets": len(self._ticket_owner),
            "refused_holds": self.refused_holds,
            "refused_tickets": self.refused_tickets,
            "refused_reserved_bytes": self.refused_reserved_bytes,
            "tickets_expired": self.tickets_expired,
            "releases_skipped": self.releases_skipped,
        }
