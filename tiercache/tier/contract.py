"""The tier contract: what L1, L2 and L3 each implement, and all the engine knows of them.

Two-phase moves on every tier:

* **write**: :meth:`Tier.reserve` returns a :class:`WriteHandle` whose ``buffer`` the caller fills,
  then :meth:`Tier.commit` makes the object visible (or :meth:`Tier.abort` drops it). An object is
  never visible before its commit, and a reservation that is never finished expires.
* **read**: :meth:`Tier.pin` returns a :class:`ReadHandle` whose ``buffer`` holds the *verified*
  payload and stays valid until :meth:`Tier.release`. A pinned object is never evicted (until its
  lease expires). A corrupt object is a miss (``None``), deleted and counted — never a hit.

Nine methods are abstract: the write pair (``reserve``, ``commit``, ``abort``), the read pair
(``pin``, ``release``), and ``contains``, ``delete``, ``usage`` and ``iter_keys``. Everything else
has a default written in terms of them, which a tier overrides only to be faster (L2's :meth:`put`
writes straight from the caller's buffer, L3's :meth:`lookup_prefix` searches instead of asking once
per chunk) or to add a capability (manifests on the persistent tiers, eviction hand-over on L2).

:class:`FrontTier` is the engine's first tier (L1): the one tier that may hold the only copy of an
object a lower tier is still owed. Batched calls, slot offsets and the arena are L1's own interface
(:class:`~tiercache.l1.tier.L1Tier`), not part of any contract.

Tiers are synchronous and thread-safe. They may block on I/O (LMDB, S3); the engine calls L2/L3 only
from its own bounded executors, never from a request loop. Only L1 promises that its calls do not
block on I/O.

:class:`tiercache.testing.tier_suite.TierSuite` checks all of this against any tier from one fixture.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tiercache.errors import ReservationError, TierError
from tiercache.keys.digest import digest as digest_of
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.tier.copying import copy_into
from tiercache.tier.frames import check_copy
from tiercache.tier.stats import TierStats

#: ``listener(key, payload)``: handed each object a tier evicts for capacity (write-back uses it).
EvictionListener = Callable[[ObjectKey, memoryview], None]


class WriteHandle(NamedTuple):
    """A reservation: fill ``buffer`` (exactly ``nbytes``), then commit or abort it.

    Handles are immutable tuples: one is made per chunk on the hottest path, and a tuple is built in
    a third of the time of a frozen dataclass.
    """

    key: ObjectKey
    nbytes: int
    buffer: memoryview
    token: int
    expires_at: float


class ReadHandle(NamedTuple):
    """A pinned, verified object: ``buffer`` is valid until the handle is released.

    ``digest`` is the payload's digest (:mod:`tiercache.keys.digest`) where the tier knows it
    without hashing (L1: the writer's; an uncompressed frame: its checksum), else ``None``. L1's
    ``buffer`` is shared memory other processes map: a copy from it counts only if it matches
    ``digest`` once done."""

    key: ObjectKey
    buffer: memoryview
    token: int
    expires_at: float
    digest: int | None = None


@dataclass(frozen=True, slots=True)
class HeldSet:
    """Objects a front tier holds as one pin (:meth:`FrontTier.pin_all`): ``count`` objects under
    one ``token``, until :meth:`FrontTier.release_all` or ``expires_at`` (monotonic), whichever
    comes first. A promotion ticket of a long prompt pins hundreds of objects that are released
    together: one hold costs the tier one record instead of one per object."""

    token: int
    expires_at: float
    count: int


def payload_digest(known: int | None, data: bytes | bytearray | memoryview) -> int:
    """``known``, or the digest of ``data`` where the tier did not know it."""
    return digest_of(data) if known is None else known


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes and objects a tier holds against its budget (payload bytes, not file sizes)."""

    bytes_used: int
    bytes_budget: int
    objects: int


class Tier(ABC):
    """One storage tier. See the module docstring for the contract."""

    #: Short name used in stats, logs and the CLI ("l1", "disk", "s3").
    name: str = "tier"
    #: True when every lookup costs a network round trip (S3): the engine then asks
    #: :meth:`lookup_prefix` for whole runs of keys instead of :meth:`contains` per key.
    remote: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()

    # -- writes --------------------------------------------------------------------------------
    @abstractmethod
    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        """Reserve room for ``nbytes`` under ``key``; evicts if needed.

        Raises :class:`~tiercache.errors.TierFullError` if no room can be made. Reserving a key that is
        already committed is allowed; the new object replaces the old one at commit. A reservation
        neither committed nor aborted expires after the tier's reservation TTL (counted in
        ``stats.expired_reservations``).
        """

    @abstractmethod
    def commit(self, handle: WriteHandle) -> None:
        """Make the reserved object visible.

        Raises :class:`~tiercache.errors.ReservationError` if the reservation is unknown, finished
        or expired.
        """

    @abstractmethod
    def abort(self, handle: WriteHandle) -> None:
        """Drop a reservation; a no-op if it already expired or finished."""

    # -- reads ---------------------------------------------------------------------------------
    @abstractmethod
    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` is (believed) committed here. Cheap; does not verify the bytes."""

    @abstractmethod
    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        """Verified payload of ``key``, held until :meth:`release`; ``None`` on a miss.

        A failed verification deletes the object, counts ``verify_failures`` and returns ``None``.
        A lease not released within the tier's lease TTL expires (``stats.expired_leases``) and no
        longer protects the object from eviction. ``count=False`` is for the engine's own reads that
        serve no reader (the source of a write to a lower tier): neither a hit nor a miss, and no
        recency touch.
        """

    @abstractmethod
    def release(self, handle: ReadHandle) -> None:
        """End a pin. Releasing twice or after expiry is harmless."""

    # -- management ----------------------------------------------------------------------------
    @abstractmethod
    def delete(self, key: ObjectKey) -> bool:
        """Remove ``key``; ``True`` if it was there. Pinned objects go once released."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes and objects held against the budget."""

    @abstractmethod
    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every committed key (order unspecified)."""

    # -- defaults ------------------------------------------------------------------------------
    def tenants(self) -> dict[str, dict[str, int]]:
        """Per tenant (by :func:`~tiercache.keys.tenant.tenant_label`), what it holds here: at least
        ``bytes`` and ``objects``. Default: nothing, a tier that does not account tenants."""
        return {}

    def iter_keys_by_use(self) -> Iterator[ObjectKey]:
        """Every committed key, most recently used first where the tier keeps a use order (the
        disk tier's LRU records, the S3 tier's index); :meth:`iter_keys` order otherwise. What
        ``tiercache warm`` promotes first under a byte budget."""
        return self.iter_keys()

    def put(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        *,
        tenant: bytes = DEFAULT_TENANT,
        digest: int | None = None,
    ) -> None:
        """Store ``data`` under ``key`` in one call (reserve, copy, commit), as an object of
        ``tenant`` (a :mod:`tiercache.keys.tenant` id) where the tier keeps tenant quotas; a tier
        that does not ignores it.

        ``digest``: what ``data`` must hash to (its writer's digest), for ``data`` that others may
        write meanwhile (an L1 slot). The tier checks the copy it keeps, once made, and raises
        :class:`~tiercache.errors.IntegrityError` (storing nothing) if it differs: what a tier
        stores is then exactly what the writer committed. ``None``: ``data`` is the caller's own.
        """
        self.commit(self._filled(key, data, digest=digest))

    def _filled(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        handle: WriteHandle | None = None,
        *,
        digest: int | None = None,
    ) -> WriteHandle:
        """A reservation for ``key`` (``handle``, or a new one) holding a copy of ``data``, ready to
        commit (aborted if the copy fails, or if the copy does not match ``digest``)."""
        view = memoryview(data).cast("B")
        handle = handle or self.reserve(key, view.nbytes)
        try:
            copy_into(handle.buffer, view)
            check_copy(handle.buffer, digest, key, "write")
        except BaseException:
            self.abort(handle)
            raise
        return handle

    def get(self, key: ObjectKey) -> bytes | None:
        """A verified copy of the payload of ``key``, or ``None`` on a miss."""
        handle = self.pin(key)
        if handle is None:
            return None
        try:
            return bytes(handle.buffer)
        finally:
            self.release(handle)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> int | None:
        """Copy the verified payload of ``key`` into ``alloc(payload length)`` and return its
        digest (:mod:`tiercache.keys.digest`); ``None`` on a miss.

        For moving an object into a buffer the caller owns (promotion into an L1 reservation). A
        tier may copy first and verify the destination; so after a ``None`` for which ``alloc``
        was called the destination holds unverified bytes and must be discarded. Default: pin,
        copy, release.
        """
        handle = self.pin(key)
        if handle is None:
            return None
        try:
            copy_into(alloc(handle.buffer.nbytes), handle.buffer)
            return payload_digest(handle.digest, handle.buffer)
        finally:
            self.release(handle)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """:meth:`contains` for each key; tiers override it to answer in one lock or transaction."""
        return [self.contains(key) for key in keys]

    def pin_many(self, keys: Sequence[ObjectKey], *, count: bool = True) -> list[ReadHandle | None]:
        """:meth:`pin` for each key; tiers override it to pin in one lock or transaction."""
        return [self.pin(key, count=count) for key in keys]

    def release_many(self, handles: Sequence[ReadHandle], *, read: bool = False) -> list[bool]:
        """:meth:`release` each handle; tiers override it to release in one lock. Says, per handle,
        whether its pin was still held (``True`` where the tier cannot tell). ``read``: the handles
        are uncounted holds (``pin(count=False)``) that a client read through after all; a tier that
        counts hits counts them now (this default counts nothing)."""
        for handle in handles:
            self.release(handle)
        return [True] * len(handles)

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` are present. Tiers with costly lookups override this."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def put_manifest(self, fingerprint: Fingerprint, data: bytes) -> None:
        """Keep a layout manifest (canonical JSON) beside the data. No-op on tiers that do not persist."""

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        """The manifest stored for ``fingerprint``, or ``None``."""
        return None

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest JSON)``."""
        return iter(())

    def put_state(self, name: str, data: bytes) -> bool:
        """Keep the engine's ``name`` state (an opaque blob, replacing the last one) beside the
        data, for the next process on this tier. Returns whether it was kept: tiers that do not
        persist, or are shared with other nodes, keep nothing."""
        return False

    def get_state(self, name: str) -> bytes | None:
        """The state last kept under ``name``, or ``None``."""
        return None

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """Have ``listener(key, payload)`` called before each capacity eviction (write-back uses it).

        The payload view is only valid during the call. Default: refuse, so that write-back to a
        tier that cannot hand over its evictions fails at start-up instead of silently never writing.
        """
        raise TierError(
            f"the {self.name} tier cannot hand evicted objects to a listener, so nothing would be "
            "written back from it; use --l3-write-policy through, or write back from the disk tier"
        )

    def flush(self, timeout: float | None = None) -> None:
        """Make committed objects durable (LMDB sync). No-op where commit already is durable."""

    def close(self) -> None:
        """Release files, sockets and memory. Idempotent."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FrontTier(Tier):
    """The engine's first tier (L1): it may hold the only copy of an object while a lower tier is
    still owed it, and must not evict such an object until the engine settles the debt."""

    @abstractmethod
    def commit(self, handle: WriteHandle, *, owed: bool = False, digest: int | None = None) -> None:
        """Make the reserved object visible; ``owed=True``: keep it from eviction until
        :meth:`settle`. ``digest``: the payload's digest as its writer computed it over its own
        bytes (what every reader checks its copy against); ``None``: the writer is this process
        and nobody else can have written the buffer, so the tier hashes it. Raises
        :class:`~tiercache.errors.ReservationError` as :meth:`Tier.commit`."""

    @abstractmethod
    def settle(self, key: ObjectKey) -> None:
        """A lower tier now holds ``key`` (or will never get it): it may be evicted again."""

    @abstractmethod
    def reserve(self, key: ObjectKey, nbytes: int, *, tenant: bytes = DEFAULT_TENANT) -> WriteHandle:
        """As :meth:`Tier.reserve`, for an object of ``tenant`` (a :mod:`tiercache.keys.tenant` id),
        whose quota decides what may be evicted to make room."""

    def commit_many(
        self,
        handles: Sequence[WriteHandle],
        *,
        owed: bool = False,
        digests: Sequence[int | None] | None = None,
    ) -> None:
        """:meth:`commit` of each reservation in order, with its digest (``digests`` in order;
        ``None``: as in :meth:`commit`). Raises :class:`~tiercache.errors.ReservationError` at
        the first that is not open, those before it committed (its ``committed`` says how many).
        Default: one :meth:`commit` after another; L1 commits under one lock."""
        for done, handle in enumerate(handles):
            try:
                self.commit(handle, owed=owed, digest=None if digests is None else digests[done])
            except ReservationError as exc:
                exc.committed = done
                raise

    def pin_all(self, raws: Sequence[bytes]) -> HeldSet | None:
        """Hold every object of ``raws`` (keys in their binary form, :attr:`ObjectKey.raw
        <tiercache.keys.ObjectKey.raw>`, each once) as one pin, or none of them (``None``) when one
        is not committed here. Uncounted, as ``pin(count=False)``: the caller hands the objects to
        a reader and says at :meth:`release_all` whether it read them. Non-blocking. Default:
        ``None`` (no such hold here: the caller pins object by object, :meth:`pin_many`)."""
        return None

    def release_all(self, held: HeldSet, *, read: bool = False) -> int:
        """End a :meth:`pin_all` hold. Returns how many of its objects it no longer held (all of
        them when it expired first: a reader must not trust what it copied), else 0. ``read``: a
        reader copied the objects meanwhile; each counts as a hit, as a pin's read would. Safe
        to call twice (the second returns ``held.count``)."""
        return held.count  # (the default pin_all holds nothing)

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        """Reserve each ``(key, nbytes)``, of ``tenants[i]`` (empty: all the default tenant), all or
        nothing: if one cannot be reserved, those made are given back and the error is raised
        (:class:`~tiercache.errors.TierFullError` when it does not fit). A store request of many
        chunks. Default: one :meth:`reserve` after another; tiers override it to reserve under one
        lock (L1)."""
        if tenants and len(tenants) != len(items):
            raise ValueError(f"{len(items)} items but {len(tenants)} tenants")
        handles: list[WriteHandle] = []
        try:
            for i, (key, nbytes) in enumerate(items):
                handles.append(self.reserve(key, nbytes, tenant=tenants[i] if tenants else DEFAULT_TENANT))
        except BaseException:
            for handle in handles:
                self.abort(handle)
            raise
        return handles

    def put(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        *,
        owed: bool = False,
        tenant: bytes = DEFAULT_TENANT,
        digest: int | None = None,
    ) -> None:
        """Store ``data`` under ``key`` in one call (reserve, copy, commit), owed if asked, as an
        object of ``tenant``. ``digest`` as in :meth:`Tier.put`; ``None``: ``data`` is the caller's
        own and its digest is taken from it."""
        handle = self.reserve(key, memoryview(data).nbytes, tenant=tenant)
        filled = self._filled(key, data, handle, digest=digest)
        self.commit(filled, owed=owed, digest=payload_digest(digest, data))

    def tenant_of(self, key: ObjectKey) -> bytes:
        """The tenant whose object ``key`` is (what the engine passes on to the lower tiers it writes
        ``key`` to); the default tenant when unknown. Default: always the default tenant."""
        return DEFAULT_TENANT

    def recheck(self, key: ObjectKey, offset: int | None = None) -> bool | None:
        """A copy of ``key``'s bytes out of this tier (at ``offset``, where the tier places objects;
        ``None``: wherever it is now) did not match the object's digest. Check the object itself:
        ``True`` if it is corrupt (it is dropped, counted as an eviction for ``corrupt``),
        ``False`` if it is intact now (the copy was torn by a write that has since ended), ``None``
        if it is no longer there. Default: ``None``, for a tier whose buffers no other process
        writes (nothing else can change them). Blocking: hashes the object."""
        return None

    def committed_keys(self, raws: Sequence[bytes]) -> list[ObjectKey | None]:
        """The key of each committed object among the binary keys ``raws`` (:attr:`ObjectKey.raw
        <tiercache.keys.object_key.ObjectKey.raw>`), ``None`` where none is: presence without
        building the keys first. Default: parse them and ask :meth:`contains_many`."""
        keys = [ObjectKey.from_bytes(raw) for raw in raws]
        return [k if hit else None for k, hit in zip(keys, self.contains_many(keys), strict=True)]

    def writing_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether each key has an open reservation: its bytes are being written and not yet
        committed (another engine's store, or a promotion). A lookup may wait for such keys instead
        of reporting a miss. Default: a tier that cannot tell says none."""
        return [False] * len(keys)

    def wait_written(self, keys: Sequence[ObjectKey], timeout: float) -> bool:
        """Block until no key of ``keys`` has an open reservation, or ``timeout`` passes; ``True``
        if none has. Default: none has (see :meth:`writing_many`)."""
        return True
