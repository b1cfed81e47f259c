"""The client side of the data path: an object's bytes moved through the shared L1 arena.

Every rule of that path lives here, once; the engine adapters (the vLLM connector, the SGLang
backend) and the client's own helpers call it and know nothing of each other:

* **One session.** Slots, and the arena they are offsets in, come from one server session
  (:meth:`Client.in_session <tiercache.client.client.Client.in_session>`): a restarted server's
  arena holds other objects at the same offsets.
* **The window.** A server vouches for a hold (a reservation, a lease) for
  :attr:`Window.span_s` after the request that made it was *sent* (the shorter of its TTL and the
  heartbeat timeout: a TTL starts once the request arrived, and a silent session is dropped no
  sooner). A read's copy may start only within the first quarter of it (:attr:`Window.START`),
  and counts without the server's word only if it ended within half (:attr:`Window.END`); a later
  read waits for the release's reply, which names the leases that had expired. A write's copy may
  start only within the window; the commit's reply says whether the reservation still held (a
  copy that outlasts it writes, at worst, into its slot kept in quarantine).
* **Digests.** A store commits with each object the digest of the bytes its writer meant to store
  (:mod:`tiercache.keys.digest`), computed over the writer's own memory, never over the slot
  (:class:`Store`). Every read checks its copy against the digest the slot names once the copy is
  done (:class:`SlotCheck`): the arena is shared memory that any other client could have written
  into (late, outside its slots, torn), so a copy that differs is a miss, and the server is told
  (:meth:`Load.finish`), which re-checks the slot and drops a corrupt object.

Costs: a check hashes the slot's bytes right after they were copied (still in cache): a fraction of
the copy (docs/benchmarks.md, ``worker_path``). A store's digest is the writer's hash of its own
bytes, likewise right after each part was copied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tiercache.errors import TierCacheError
from tiercache.keys.digest import Digest, digest
from tiercache.keys.object_key import ObjectKey
from tiercache.l1.arena import SharedArena
from tiercache.wire import protocol as p

__all__ = ["DataPathClient", "Digest", "Load", "SlotCheck", "Store", "Window", "digest", "lease_window"]

T = TypeVar("T")


class DataPathClient(Protocol):
    """What the data path needs of a client: :class:`~tiercache.client.client.Client` is one."""

    @property
    def lease_window_s(self) -> float: ...

    @property
    def reservation_window_s(self) -> float: ...

    def clock(self) -> float:
        """What holds are timed by: ``time.monotonic()`` (one clock for every process of a host)."""
        ...

    def in_session(self, call: Callable[[], T]) -> tuple[T, SharedArena]: ...

    def reserve(
        self,
        items: Sequence[tuple[ObjectKey, int]],
        timeout: float | None = None,
        *,
        tenants: Sequence[bytes] = (),
        holds: Sequence[tuple[bytes, Sequence[bytes]]] = (),
    ) -> list[p.Slot]: ...

    def commit(
        self,
        tokens: Sequence[int],
        digests: Sequence[int],
        timeout: float | None = None,
        supersedes: Sequence[ObjectKey] = (),
    ) -> int: ...

    def abort(self, tokens: Sequence[int], timeout: float | None = None) -> int: ...

    def pin(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> list[p.Slot | None]: ...

    def release_leases(self, tokens: Sequence[int], timeout: float | None = None) -> set[int]: ...

    def release_leases_later(self, tokens: Sequence[int]) -> None: ...

    def report_corrupt(self, slots: Sequence[p.Slot]) -> None: ...


@dataclass(frozen=True, slots=True)
class Window:
    """How long a server vouches for a hold after the request that made it was sent (see the
    module docstring). ``span_s`` 0: a server that says nothing (nothing is vouched for)."""

    span_s: float
    since: float  # clock() just before the request was sent (time.monotonic: any process of this host)
    clock: Callable[[], float] = time.monotonic

    #: Share of the span within which a read's copy may start (it must end within :attr:`END`).
    START = 0.25
    #: Share of the span within which a read's copy must have ended to count without a reply.
    END = 0.5

    def may_start(self, now: float | None = None) -> bool:
        """Whether a read's copy may start now."""
        return self._within(self.START, now)

    def may_start_write(self, now: float | None = None) -> bool:
        """Whether a write's copy may start now: while the reservation surely holds, so that no
        copy starts into a slot that may no longer be its own. A copy that ends past the window
        writes, at worst, into its slot in quarantine, and its commit is refused."""
        return self._within(1.0, now)

    def held(self, now: float | None = None) -> bool:
        """Whether a copy that ended now was inside the hold, by time alone."""
        return self._within(self.END, now)

    def _within(self, share: float, now: float | None) -> bool:
        return (self.clock() if now is None else now) - self.since < share * self.span_s


def lease_window(client: DataPathClient, since: float) -> Window:
    """The window of leases whose pin (or lookup) was sent at ``since`` (``client.clock()``)."""
    return Window(client.lease_window_s, since, client.clock)


class SlotCheck:
    """Checks one copy out of a slot against the object's digest, once the copy is done.

    A copier that moves the slot in parts says which (:meth:`copied`, in order) right after each
    part landed: the part is hashed while it is still in cache. :meth:`ok` hashes what was not
    said in order and compares. Hashing the *source* after the copy catches every write into the
    slot that reached the copy; what it cannot catch is a byte changed during the copy and changed
    back before the check, which takes a second write of the object's very bytes (docs/caveats.md).
    """

    __slots__ = ("_at", "_digest", "_hash", "_ordered", "_view")

    def __init__(self, view: memoryview, expected: int) -> None:
        self._view = view
        self._digest = expected
        self._hash = Digest()
        self._at = 0  # bytes hashed in order so far
        self._ordered = True

    def copied(self, start: int, nbytes: int) -> None:
        """Bytes ``[start, start + nbytes)`` of the slot were just copied out."""
        if self._ordered and start == self._at:
            self._hash.update(self._view[start : start + nbytes])
            self._at += nbytes
        else:
            self._ordered = False  # parts out of order: the whole slot is hashed at the end

    def ok(self) -> bool:
        """Whether the slot's bytes, now, are the object's (call once every copy from it is done)."""
        if self._ordered and self._at == self._view.nbytes:
            return self._hash.value == self._digest
        return digest(self._view) == self._digest


@dataclass(eq=False)
class _Slots:
    """Slots of one server session and the arena they are in."""

    client: DataPathClient
    arena: SharedArena
    slots: list[p.Slot | None]
    window: Window

    def slot(self, i: int) -> p.Slot:
        """Slot ``i`` (``IndexError`` where the server held no object)."""
        slot = self.slots[i]
        if slot is None:
            raise IndexError(f"no slot {i}: the server did not hold that object")
        return slot

    def _view(self, i: int) -> memoryview:
        slot = self.slot(i)
        return self.arena.view(slot.offset, slot.nbytes)


@dataclass(eq=False)
class Store(_Slots):
    """A reservation's slots: fill each (:meth:`target`), then :meth:`commit` with each object's
    digest, or :meth:`abort`."""

    @classmethod
    def reserve(
        cls,
        client: DataPathClient,
        items: Sequence[tuple[ObjectKey, int]],
        *,
        tenants: Sequence[bytes] = (),
        holds: Sequence[tuple[bytes, Sequence[bytes]]] = (),
        timeout: float | None = None,
    ) -> Store:
        """Reserve a slot per ``(key, nbytes)`` (one round trip, all or nothing; ``ServerError``
        code ``tier_full`` when there is no room); see :meth:`Client.reserve
        <tiercache.client.client.Client.reserve>` for ``tenants`` and ``holds``."""
        since = client.clock()
        slots, arena = client.in_session(lambda: client.reserve(items, timeout, tenants=tenants, holds=holds))
        return cls(client, arena, list(slots), Window(client.reservation_window_s, since, client.clock))

    def target(self, i: int) -> memoryview:
        """Where object ``i``'s bytes go (writable)."""
        return self._view(i)

    def may_write(self, now: float | None = None) -> bool:
        """Whether a copy into the slots may start now: a copy that starts later could write into
        a slot that is no longer this reservation's (the writer's time rule; a late write lands in
        a slot the server keeps out of use, but only for a while). Checked before each object."""
        return self.window.may_start_write(now)

    @property
    def tokens(self) -> list[int]:
        return [s.token for s in self.slots if s is not None]

    def fill(self, write: Callable[[int, memoryview], int]) -> list[int] | None:
        """Fill every slot in order: ``write(i, target)`` copies object ``i`` into ``target`` and
        returns the digest of the bytes it meant to write (computed over its own memory). Returns
        the digests, or ``None`` (after aborting) when the window passed before a copy could start.
        Aborts and re-raises if a copy raises."""
        digests: list[int] = []
        try:
            for i in range(len(self.slots)):
                if not self.may_write():
                    self.abort()
                    return None
                digests.append(write(i, self.target(i)))
        except BaseException:
            self.abort()
            raise
        return digests

    def commit(
        self, digests: Sequence[int], supersedes: Sequence[ObjectKey] = (), timeout: float | None = None
    ) -> int:
        """Publish every object, with its payload's digest (in order: the writer's, over its own
        bytes); how many the server committed."""
        if len(digests) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} slots but {len(digests)} digests")
        return self.client.commit(self.tokens, digests, timeout, supersedes=supersedes)

    def abort(self, timeout: float | None = None) -> None:
        """Give the slots back (the copy failed or came too late); quiet if the server is gone."""
        try:
            self.client.abort(self.tokens, timeout)
        except TierCacheError:
            pass  # they expire by themselves


@dataclass(eq=False)
class Load(_Slots):
    """Slots to copy objects out of: leases this client pinned (:meth:`pin`), or a lookup ticket's
    slots, pinned by the server for someone else's request (:meth:`adopt`). Copy from
    :meth:`source`, check each copy (:meth:`check`), then :meth:`finish`."""

    #: Leases of this client's own to release at :meth:`finish` (none for adopted slots).
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def pin(cls, client: DataPathClient, keys: Sequence[ObjectKey], timeout: float | None = None) -> Load:
        """Lease the L1 copies of ``keys`` (one round trip; ``None`` slots for keys not in L1)."""
        since = client.clock()
        slots, arena = client.in_session(lambda: client.pin(keys, timeout))
        # Each once: the slots of a pin that L1 answered whole share one hold's token.
        tokens = list(dict.fromkeys(s.token for s in slots if s is not None))
        return cls(client, arena, list(slots), lease_window(client, since), tokens)

    @classmethod
    def adopt(
        cls,
        client: DataPathClient,
        arena: SharedArena,
        arena_name: str,
        slots: Sequence[p.Slot | None],
        since: float,
    ) -> Load | None:
        """The slots a lookup ticket pinned, in the arena named ``arena_name`` by the reply that
        named them, for a lookup sent at ``since``; ``None`` when ``arena`` (the mapping this
        client copies from) is not that arena (a server restarted since: other objects there), or
        when a copy could no longer start in the leases' window."""
        if not arena_name or arena_name != arena.name:
            return None
        load = cls(client, arena, list(slots), lease_window(client, since))
        return load if load.window.may_start() else None

    def source(self, i: int) -> memoryview:
        """Object ``i``'s bytes in the arena (read-only): copy them, then :meth:`check` the copy."""
        return self._view(i).toreadonly()

    def check(self, i: int) -> SlotCheck:
        """The check of a copy out of slot ``i``."""
        return SlotCheck(self._view(i), self.slot(i).digest)

    def copy_into(self, i: int, dst: memoryview | bytearray) -> bool:
        """Copy object ``i`` into ``dst`` (of its size) and check it; whether the copy is the
        object's bytes."""
        check = self.check(i)
        memoryview(dst).cast("B")[:] = self.source(i)
        check.copied(0, self.slot(i).nbytes)
        return check.ok()

    def finish(self, corrupt: Iterable[int] = ()) -> set[int]:
        """Once every copy is done and checked: tell the server which copies did not match
        (``corrupt``: indexes of slots; it re-checks and drops those objects; never waited for),
        release this client's own leases, and return the indexes whose copy the holds do not vouch
        for: a lease that had expired, or every slot when the release failed or (adopted slots)
        the copy ended too late for time alone to vouch. Those copies must not be used either."""
        bad = [self.slot(i) for i in corrupt if self.slots[i] is not None]
        if bad:
            self.client.report_corrupt(bad)
        held = self.window.held()
        if not self.tokens:
            return set() if held else {i for i, s in enumerate(self.slots) if s is not None}
        try:
            if held:
                self.client.release_leases_later(self.tokens)
                return set()
            lost = self.client.release_leases(self.tokens)
        except TierCacheError:
            lost = set(self.tokens)  # the leases end by themselves; nothing vouches for the copies
        return {i for i, s in enumerate(self.slots) if s is not None and s.token in lost}
