"""The one Python client of the tiercache server: used by the vLLM connector, the CLI and the tests.

Runs in the caller's process (a vLLM scheduler or worker, a tool), over its
:class:`~tiercache.client.transport.Transport` (one socket, the handshake, signing, replies matched
to requests, reconnects, heartbeats). Three ways to talk:

* **sync** methods per op (:meth:`Client.lookup`, :meth:`Client.reserve`, ...) that wait up to a
  timeout and raise :class:`~tiercache.errors.ServerError` (``.code`` tells which refusal),
  :class:`~tiercache.errors.ProtocolError`, :class:`~tiercache.errors.AuthenticationError` or
  :class:`~tiercache.errors.ServerUnavailableError`;
* **non-blocking** for the scheduler: :meth:`Client.lookup_async` / :meth:`Client.poll_ticket_async`
  return a request id at once, :meth:`Client.poll` returns the result or ``None`` without waiting;
* **data path** helpers that move bytes through the shared arena, never through the socket:
  :meth:`Client.store_chunks` (reserve → copy in → commit) and :meth:`Client.load_chunks` /
  :meth:`Client.read_ticket` (pin or lookup → copy out → release). The arena is attached lazily.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tiercache.client.transfer import Load, Store
from tiercache.client.transport import ServerInfo, Transport
from tiercache.errors import ServerError
from tiercache.keys.digest import digest
from tiercache.keys.fingerprint import Fingerprint, LayoutManifest
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.arena import SharedArena
from tiercache.wire import protocol as p

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")

#: A lookup's answer: restorable ``chunks``, objects per tier, and the promotion ticket's state and
#: (when ``ready``) its pinned slots. See :class:`~tiercache.wire.protocol.LookupReply`.
LookupResult = p.LookupReply


# Reply → result converters (for ``Client._call``) whose result type is the protocol's.
def _count(reply: p.Done) -> int:
    return reply.count


def _data(reply: p.DataReply) -> bytes | None:
    return reply.data


def _events(since: int, fingerprints: Sequence[Fingerprint], limit: int) -> p.Events:
    return p.Events(since=since, fingerprints=[f.raw for f in fingerprints], limit=limit)


def _release(tokens: Sequence[int]) -> p.Release:
    """A release naming each of ``tokens`` once (the slots of one pin may share one)."""
    return p.Release(tokens=list(dict.fromkeys(tokens)))


def _lookup(
    hashes: Sequence[bytes],
    groups: Sequence[p.GroupRef],
    prefetch: bool,
    max_chunks: int,
    inflight_wait_s: float,
    tenant: bytes,
    kind: p.LookupKind = p.LookupKind.CHUNKS,
) -> p.Lookup:
    return p.Lookup(
        hashes=list(hashes),
        groups=list(groups),
        prefetch=prefetch,
        max_chunks=max_chunks,
        inflight_wait_s=inflight_wait_s,
        tenant=tenant,
        kind=kind,
    )


class Client(Transport):
    """Connect to a tiercache server at ``endpoint`` (default: the server's default socket).

    ``timeout`` bounds every sync call unless the call passes its own. ``auth_secret`` answers a
    shared-secret server; ``curve_server_key`` (the server's public key, z85 bytes) plus
    ``curve_client_key_file`` (this client's ``zmq.auth`` secret key file, whose public half the
    server admits) talk to a CURVE server. Connecting and saying hello happen in the constructor
    (one round trip, or two with a shared secret). ``io_cpus`` are the CPUs libzmq's background
    threads (its I/O thread moves every request and reply) run on; by default they inherit the
    binding of the thread that creates the client.
    """

    _arena: SharedArena | None = None  # guarded by _lock; mapped on first use

    def _said_hello(self, info: ServerInfo) -> None:
        if self._arena is not None and self._arena.name != info.arena_name:
            self._arena.close()  # the server restarted with a new arena
            self._arena = None

    def _closing(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    # -- registration ----------------------------------------------------------------------------
    def register(
        self, groups: Sequence[tuple[int, LayoutManifest]], timeout: float | None = None
    ) -> list[p.GroupRef]:
        """Register an engine's object groups ``(group id, manifest)``; returns their refs
        (fingerprint + group) for lookups. Round trip; the server stores manifests on L2/L3."""
        msg = p.RegisterEngine(
            groups=[p.RegisterGroup(g, p.ManifestFields(**m.to_dict())) for g, m in groups]
        )
        return self._call(msg, lambda r: r.groups, timeout)

    def manifest(self, fingerprint: Fingerprint, timeout: float | None = None) -> LayoutManifest | None:
        """The manifest stored for ``fingerprint``, or ``None``."""
        d = self._call(p.GetManifest(fingerprint=fingerprint.raw), lambda r: r.manifest, timeout)
        return None if d is None else LayoutManifest.from_dict(d)

    # -- lookup ----------------------------------------------------------------------------------
    def lookup(
        self,
        hashes: Sequence[bytes],
        groups: Sequence[p.GroupRef],
        *,
        prefetch: bool = True,
        max_chunks: int = 0,
        inflight_wait_s: float = 0.0,
        tenant: bytes = b"",
        timeout: float | None = None,
        kind: p.LookupKind = p.LookupKind.CHUNKS,
    ) -> LookupResult:
        """Longest restorable prefix; with ``prefetch`` also a promotion ticket (waiting up to
        ``inflight_wait_s`` for objects still being stored: :class:`~tiercache.wire.protocol.Lookup`),
        asked for ``tenant``. ``kind``: what the hashes are (chunks, or a chunk's tail blocks) and
        what the reply counts (:class:`~tiercache.wire.protocol.LookupKind`). One round trip."""
        msg = _lookup(hashes, groups, prefetch, max_chunks, inflight_wait_s, tenant, kind)
        return self._call(msg, timeout=timeout)

    def lookup_async(
        self,
        hashes: Sequence[bytes],
        groups: Sequence[p.GroupRef],
        *,
        prefetch: bool = True,
        max_chunks: int = 0,
        inflight_wait_s: float = 0.0,
        tenant: bytes = b"",
        kind: p.LookupKind = p.LookupKind.CHUNKS,
    ) -> int:
        """Send a lookup (as :meth:`lookup`) and return its request id at once; collect it with
        :meth:`poll`."""
        msg = _lookup(hashes, groups, prefetch, max_chunks, inflight_wait_s, tenant, kind)
        return self._submit(msg, lambda r: r)

    def events(
        self,
        since: int = -1,
        fingerprints: Sequence[Fingerprint] = (),
        limit: int = 10_000,
        timeout: float | None = None,
    ) -> p.EventsReply:
        """The residency changes after ``since`` (``-1``: none, just the current position) of objects
        with one of ``fingerprints`` (empty: all); see :class:`~tiercache.wire.protocol.Events`.
        One round trip."""
        return self._call(_events(since, fingerprints, limit), timeout=timeout)

    def events_async(
        self, since: int = -1, fingerprints: Sequence[Fingerprint] = (), limit: int = 10_000
    ) -> int:
        """Send :meth:`events` and return its request id at once; collect it with :meth:`poll`."""
        return self._submit(_events(since, fingerprints, limit), lambda r: r)

    def poll_ticket_async(self, ticket: int) -> int:
        """Ask where a promotion ticket stands without waiting; collect with :meth:`poll`."""
        return self._submit(p.PollTicket(ticket=ticket), lambda r: r)

    def poll_ticket(self, ticket: int, timeout: float | None = None) -> LookupResult:
        """Where a promotion ticket stands. One round trip."""
        return self._call(p.PollTicket(ticket=ticket), timeout=timeout)

    def wait_ticket(self, ticket: int, timeout: float | None = None) -> LookupResult:
        """Poll ``ticket`` until it is no longer pending (tools and tests; a scheduler polls)."""
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        pause = 0.0005
        while True:
            result = self.poll_ticket(ticket)
            if not result.pending:
                return result
            if time.monotonic() > end:
                return result
            time.sleep(pause)  # promotions take ms: back off instead of spinning on the server
            pause = min(pause * 2, 0.01)

    def release_ticket(self, ticket: int, timeout: float | None = None, *, read: bool = False) -> None:
        """Unpin everything a ticket holds. ``read``: this client copied the objects from the
        ticket's slots (the server counts them as L1 reads: :class:`~tiercache.wire.protocol.ReleaseTicket`)."""
        self._call(p.ReleaseTicket(ticket=ticket, read=read), timeout=timeout)

    def release_ticket_unconfirmed(self, ticket: int, *, read: bool = False) -> None:
        """:meth:`release_ticket` without waiting for the reply (a round trip less). For a reader
        that learns nothing from the reply: whether its copy was inside the ticket's leases it
        decides by time (:class:`~tiercache.client.transfer.Window`). A ticket whose release is lost ends with its
        leases' TTL or its session."""
        with self._lock:
            self._release_late_ticket(ticket, read)

    def release_ticket_later(self, ticket: int, *, read: bool = False) -> None:
        """:meth:`release_ticket_unconfirmed`, held back to ride this client's next lookup
        (``Lookup.releases``): a message fewer per lookup for the server to read. Until then the
        ticket's objects stay pinned, so a caller that may not look up again soon calls
        :meth:`flush_releases`; the heartbeat sends what is left at the latest."""
        with self._lock:
            self._hold_release(ticket, read)

    def flush_releases(self) -> None:
        """Send the releases :meth:`release_ticket_later` and :meth:`release_leases_later` held
        back now (a message for the tickets', one for the leases')."""
        with self._lock:
            self._flush_riders()

    # -- two-phase store / pin -------------------------------------------------------------------
    def reserve(
        self,
        items: Sequence[tuple[ObjectKey, int]],
        timeout: float | None = None,
        *,
        tenants: Sequence[bytes] = (),
        holds: Sequence[tuple[bytes, Sequence[bytes]]] = (),
    ) -> list[p.Slot]:
        """Reserve arena slots for ``(key, nbytes)``, all or nothing (``ServerError`` code
        ``tier_full`` when L1 has no room). ``tenants``: each item's tenant id, or empty for the
        default tenant's. ``holds``: ``(prefix hash, block hashes)`` of the tails and chunks being
        stored, for the server's block index (:class:`~tiercache.wire.protocol.Reserve`)."""
        if tenants and len(tenants) != len(items):
            raise ValueError(f"{len(items)} items but {len(tenants)} tenants")
        # All the default tenant's: say nothing (an older server accepts the message too).
        named = list(tenants) if any(tenants) else []
        msg = p.Reserve(
            items=[(k.to_bytes(), n) for k, n in items],
            tenants=named,
            holds=[(target, list(blocks)) for target, blocks in holds],
        )
        return self._call(msg, lambda r: r.slots, timeout)

    def commit(
        self,
        tokens: Sequence[int],
        digests: Sequence[int],
        timeout: float | None = None,
        supersedes: Sequence[ObjectKey] = (),
    ) -> int:
        """Make reservations visible, each with its payload's digest (the writer's, over its own
        bytes: :mod:`tiercache.keys.digest`); ``supersedes``: tails the committed chunks cover,
        dropped from the server's local tiers (:class:`~tiercache.wire.protocol.Commit`). Prefer
        :class:`~tiercache.client.transfer.Store`, which keeps the data path's rules."""
        msg = p.Commit(
            tokens=list(tokens), digests=list(digests), supersedes=[k.to_bytes() for k in supersedes]
        )
        return self._call(msg, _count, timeout)

    def abort(self, tokens: Sequence[int], timeout: float | None = None) -> int:
        return self._call(p.Abort(tokens=list(tokens)), _count, timeout)

    def pin(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> list[p.Slot | None]:
        """Lease the L1 copies of ``keys`` (``None`` for each not in L1). When L1 holds every one,
        they are one lease: every slot names the same token."""
        return self._call(p.Pin(keys=[k.to_bytes() for k in keys]), lambda r: r.slots, timeout)

    def release(self, tokens: Sequence[int], timeout: float | None = None) -> int:
        """End read leases; how many objects they held. Use :meth:`release_leases` to learn which
        had expired. A token named twice is released once (the slots of one pin may share one)."""
        return self._call(_release(tokens), _count, timeout)

    def release_leases(self, tokens: Sequence[int], timeout: float | None = None) -> set[int]:
        """End read leases and return the tokens whose lease had expired before the release: the
        bytes copied under them may be another object's (the server reused the slot), so a copy
        made under one must be thrown away. Raises like every call; then no lease is confirmed.
        A token named twice is released once (the slots of one pin may share one)."""
        return self._call(_release(tokens), lambda r: set(r.lost), timeout)

    def release_leases_later(self, tokens: Sequence[int]) -> None:
        """End read leases without a reply, held back to ride this client's next pin
        (``Pin.releases``): for a reader whose copy time alone vouches for
        (:class:`~tiercache.client.transfer.Window`), a load is then one message for the server to
        read instead of two. Until then the objects stay pinned; :meth:`flush_releases` sends what
        is held now, the heartbeat thread within about a second. Unsent, the leases end with their
        TTL or the session."""
        if tokens:
            with self._lock:
                self._hold_lease_releases(tokens)

    def report_corrupt(self, slots: Sequence[p.Slot]) -> None:
        """Tell the server these slots' copies did not match their digests (it re-checks them,
        drops corrupt objects and counts them); not waited for."""
        msg = p.Corrupt(objects=[(s.key, s.offset, s.nbytes) for s in slots])
        with self._lock:
            self._send_unanswered(msg)

    # -- the arena data path ---------------------------------------------------------------------
    def arena(self) -> SharedArena:
        """The server's L1 arena mapped into this process (attached on first use)."""
        with self._lock:
            info = self.server
            if self._arena is None:
                self._arena = SharedArena.attach(info.arena_name)
                # Off the copies: each page's first access through a fresh mapping is a fault.
                self._arena.populate_in_background()
            return self._arena

    def in_session(self, call: Callable[[], T]) -> tuple[T, SharedArena]:
        """``call()`` (calls on this client, e.g. a :meth:`pin` or :meth:`reserve`) and the arena
        of the server session that answered it: the one its slots' offsets are in.

        Mapping the arena after the call returns is not enough: another thread may say hello to a
        restarted server in between, and the client then maps that server's arena, where the same
        offsets hold other objects. The client's lock, held across both, keeps every other
        thread's hello out; a hello the call itself needed happens before its reply.
        """
        with self._lock:
            result = call()
            return result, self.arena()

    def store_chunks(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[Buffer],
        timeout: float | None = None,
        *,
        tenant: bytes = b"",
    ) -> int:
        """Store each buffer under its key (as objects of ``tenant``): reserve → copy into the arena
        → commit with each buffer's digest (:class:`~tiercache.client.transfer.Store`). Two round
        trips plus the copies; aborts the reservations if a copy fails, and stores nothing (0) if
        the copies could not start within the reservations' window."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [memoryview(b).cast("B") for b in buffers]
        items = [(k, v.nbytes) for k, v in zip(keys, views)]
        store = Store.reserve(self, items, tenants=[tenant] * len(items) if tenant else (), timeout=timeout)

        def write(i: int, target: memoryview) -> int:
            target[:] = views[i]
            return digest(views[i])  # the caller's own bytes, never the slot's

        digests = store.fill(write)
        return 0 if digests is None else store.commit(digests, timeout=timeout)

    def load_chunks(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> list[bytes | None]:
        """Copies of the L1 objects of ``keys`` (``None`` where not in L1, or where the copy did not
        match the object's digest or outlived its lease): pin → copy → check → release
        (:class:`~tiercache.client.transfer.Load`). Use :meth:`lookup` + :meth:`read_ticket` to
        restore from lower tiers too."""
        load = Load.pin(self, keys, timeout)
        return _copies(load)

    def read_ticket(self, result: LookupResult, *, release: bool = True) -> dict[ObjectKey, bytes]:
        """Copy out every slot of a READY lookup, each checked against its digest (then release its
        ticket unless told not to); nothing (all misses) when the lookup's slots are in an arena
        this client no longer maps, and no copy that failed its check or outlived the leases."""
        if result.state is not p.TicketStateName.READY:
            raise ServerError(
                f"ticket {result.ticket} is {result.state.value}, not ready; wait_ticket() first, or read only READY "
                "lookups",
                "invalid",
            )
        # The lookup's time is not known here: its leases are judged from now (the ticket holding
        # them is released only after the copies), and each copy is checked against its digest.
        slots = result.slots
        load = Load.adopt(self, self.arena(), result.arena, list(slots), self.clock())
        if load is None:
            return {}  # a server restarted since the lookup (and forgot its ticket): other objects here
        try:
            copies = _copies(load)
            return {ObjectKey.from_bytes(s.key): c for s, c in zip(slots, copies) if c is not None}
        finally:
            if release:
                self.release_ticket(result.ticket)

    # -- bytes over the socket (tools, remote clients) ------------------------------------------
    def put(self, key: ObjectKey, data: Buffer, timeout: float | None = None) -> bool:
        """Store ``data`` through the socket; ``False`` if L1 had no room. Bounded by the
        server's max_message_bytes."""
        return bool(self._call(p.Put(key=key.to_bytes(), data=bytes(data)), _count, timeout))

    def get(self, key: ObjectKey, timeout: float | None = None) -> bytes | None:
        """A verified copy of ``key`` from the fastest tier (promoting it), through the socket."""
        return self._call(p.Get(key=key.to_bytes()), _data, timeout)

    def delete(self, key: ObjectKey, timeout: float | None = None) -> int:
        """Remove ``key`` from every tier; how many held it."""
        return self._call(p.Delete(key=key.to_bytes()), _count, timeout)

    # -- observation and management --------------------------------------------------------------
    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._call(p.Stats(), lambda r: r.stats, timeout)

    def list_keys(
        self,
        *,
        tier: str = "",
        fingerprint: Fingerprint | None = None,
        object_group: int = -1,
        cursor: bytes = b"",
        limit: int = 1000,
        order: str = "key",
        timeout: float | None = None,
    ) -> tuple[list[p.ListedKey], bytes]:
        """One page of keys after ``cursor`` and the cursor of the next page (``b""``: last page);
        ``order="use"`` lists one ``tier`` most recently used first (see :class:`protocol.ListKeys`)."""
        msg = p.ListKeys(
            tier=tier,
            fingerprint=b"" if fingerprint is None else fingerprint.raw,
            object_group=object_group,
            cursor=cursor,
            limit=limit,
            order=order,
        )
        return self._call(msg, lambda r: (r.keys, r.next_cursor), timeout)

    def explain(
        self, hashes: Sequence[bytes], groups: Sequence[p.GroupRef], timeout: float | None = None
    ) -> list[p.ExplainEntry]:
        """Per chunk and group: which tier holds it, or why not."""
        return self._call(p.Explain(hashes=list(hashes), groups=list(groups)), lambda r: r.entries, timeout)

    def clear(self, fingerprint: Fingerprint | None = None, timeout: float | None = None) -> int:
        """Delete everything (or one fingerprint's objects) from every tier; how many keys went."""
        msg = p.Clear(fingerprint=b"" if fingerprint is None else fingerprint.raw)
        return self._call(msg, _count, timeout)

    def clear_batch(
        self,
        limit: int,
        *,
        tier: str = "",
        fingerprint: Fingerprint | None = None,
        timeout: float | None = None,
    ) -> int:
        """Delete at most ``limit`` keys (one fingerprint's, or any) from every tier or only ``tier``;
        how many went. Call again until it returns 0 (``tiercache clear`` does, to show progress).

        ``ServerError`` code ``invalid`` for an unknown tier; ``ProtocolError`` code ``unknown_op``
        from a server older than this op.
        """
        msg = p.ClearBatch(
            limit=limit, tier=tier, fingerprint=b"" if fingerprint is None else fingerprint.raw
        )
        return self._call(msg, _count, timeout)

    def warm(
        self, keys: Sequence[ObjectKey], *, max_bytes: int = 0, timeout: float | None = None
    ) -> p.WarmReply:
        """Promote ``keys`` (at most 10 000) into L1 from lower tiers, until ``max_bytes`` (0: no
        limit) are promoted. A server older than this op answers ``ProtocolError`` code ``unknown_op``."""
        msg = p.Warm(keys=[k.to_bytes() for k in keys], max_bytes=max_bytes)
        return self._call(msg, timeout=timeout)


def _copies(load: Load) -> list[bytes | None]:
    """A checked copy of each of ``load``'s objects (``None`` where there is none, or where the copy
    did not match the object's digest or outlived its hold); finishes the load."""
    copies: list[bytes | None] = []
    corrupt: list[int] = []
    for i, slot in enumerate(load.slots):
        if slot is None:
            copies.append(None)
            continue
        out = bytearray(slot.nbytes)
        if load.copy_into(i, out):
            copies.append(bytes(out))
        else:
            corrupt.append(i)
            copies.append(None)
    lost = load.finish(corrupt)
    return [None if i in lost else c for i, c in enumerate(copies)]
