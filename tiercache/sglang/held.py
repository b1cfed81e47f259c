"""Lookup tickets that ``batch_exists`` keeps for the ``batch_get`` SGLang sends next.

SGLang's cache controller (0.5.23) asks ``batch_exists`` about a batch of page keys from its
prefetch thread and, once its scheduler has given the prefetch host memory, loads those pages with
``batch_get_v1`` from its IO thread: the same batches from the same first key, or fewer pages when
its TP ranks agree on a smaller hit count. A lookup that takes a ticket pins the hits (and starts
promoting disk and S3 hits into L1) in the same round trip as a bare existence check; kept until the
get, it spares the get a pin round trip of its own.

A held ticket is used only by a get of a leading part of its pages, over the same connection, and
only while the leases' window counted from the lookup's send allows
(:class:`~tiercache.client.transfer.Window`: a copy starts within its first quarter and counts if it
ended within half); otherwise the get pins by key, or reports misses. A ticket no get takes (SGLang
revoked the prefetch, or another lookup of the same first key replaced it) is released by the first
call that finds it too old for a copy to start. At most :data:`MAX_HELD` are kept, pinning at most
an eighth of the arena (:data:`ARENA_SHARE`), so that held tickets never crowd out the stores.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tiercache.client.client import Client
from tiercache.client.transfer import lease_window
from tiercache.errors import TierCacheError
from tiercache.wire import protocol as p

#: Held tickets at most (each pins up to one SGLang batch, 128 pages); the oldest goes first.
MAX_HELD = 16
#: The held tickets' pages stay under this share of the arena; the oldest go first.
ARENA_SHARE = 1 / 8


@dataclass(frozen=True, slots=True)
class HeldLookup:
    """One ``batch_exists`` lookup's ticket: the leading hits' page hashes and where they are."""

    client: Client
    hashes: tuple[bytes, ...]
    nbytes: int  # what it pins: its pages' bytes
    reply: p.LookupReply
    sent_at: float  # time.monotonic() just before the lookup was sent

    @classmethod
    def of(
        cls, client: Client, hashes: Sequence[bytes], page_bytes: int, reply: p.LookupReply, sent_at: float
    ) -> HeldLookup:
        """The ticket of ``reply``, a lookup of ``hashes`` (pages of ``page_bytes``) sent at
        ``sent_at``."""
        return cls(client, tuple(hashes[: reply.chunks]), reply.chunks * page_bytes, reply, sent_at)

    def usable(self, now: float | None = None) -> bool:
        """Whether a copy may still start from this ticket's slots."""
        return lease_window(self.client, self.sent_at).may_start(now)

    def release(self, *, read: bool = False) -> None:
        """Release the ticket without waiting for the reply (``read``: its slots were copied)."""
        try:
            self.client.release_ticket_unconfirmed(self.reply.ticket, read=read)
        except TierCacheError:
            pass  # a closed client: its session's tickets end with it


class HeldLookups:
    """The held tickets of one backend, by their first page hash; safe across SGLang's threads."""

    def __init__(self, limit: int = MAX_HELD) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._held: dict[bytes, HeldLookup] = {}  # oldest first

    def keep(self, held: HeldLookup, arena_bytes: int) -> None:
        """Hold ``held`` for a get; releases the one it replaces and the oldest over the limits
        (``held`` itself if it alone pins more than :data:`ARENA_SHARE` of ``arena_bytes``)."""
        with self._lock:
            out = [h for h in (self._held.pop(held.hashes[0], None),) if h is not None]
            self._held[held.hashes[0]] = held
            budget = arena_bytes * ARENA_SHARE
            pinned = sum(h.nbytes for h in self._held.values())
            while self._held and (len(self._held) > self._limit or pinned > budget):
                oldest = self._held.pop(next(iter(self._held)))
                pinned -= oldest.nbytes
                out.append(oldest)
        for h in out:
            h.release()

    def take(self, hashes: Sequence[bytes]) -> HeldLookup | None:
        """The held ticket whose pages start with ``hashes`` (removed: the caller releases it), or
        ``None`` when no ticket covers them."""
        if not hashes:
            return None
        with self._lock:
            held = self._held.get(hashes[0])
            if held is None or tuple(hashes) != held.hashes[: len(hashes)]:
                return None
            return self._held.pop(hashes[0])

    def sweep(self) -> None:
        """Release every held ticket that a get could no longer use."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, h in self._held.items() if not h.usable(now)]
            out = [self._held.pop(k) for k in stale]
        for h in out:
            h.release()

    def release_all(self) -> None:
        """Release every held ticket (the backend is closing)."""
        with self._lock:
            out = list(self._held.values())
            self._held.clear()
        for h in out:
            h.release()
