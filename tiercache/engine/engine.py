"""The tiered engine: composes L1 with the lower tiers (L2 disk, L3 S3) into one cache.

What it adds on top of the tiers, and nothing else:

* **lookup** of the longest *restorable* prefix across all tiers (:mod:`tiercache.engine.lookup`);
* **promotion** of lower-tier hits into L1, pinned for the caller, all-or-nothing
  (:mod:`tiercache.engine.promotion`);
* **write-behind** of committed chunks to the lower tiers (:mod:`tiercache.engine.writes`);
* the **block index** of tails: which stored object holds a given block of a chunk
  (:mod:`tiercache.engine.blocks`).

The engine knows tiers only through the contract (:class:`~tiercache.tier.Tier`, and
:class:`~tiercache.tier.FrontTier` for L1).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from time import perf_counter

import msgspec

from tiercache.config.parts import EngineConfig
from tiercache.engine.blocks import BlockIndex, BlockIndexFormatError
from tiercache.engine.counters import EngineCounters, Throttle, timed_pin
from tiercache.engine.groups import GroupSpec
from tiercache.engine.lookup import Locator, LookupResult
from tiercache.engine.promotion import PrefetchTicket, Promoter, TicketState
from tiercache.engine.remote import RemoteAsker
from tiercache.engine.writes import WriteBehind
from tiercache.errors import ReservationError, TierCacheError, TierError, TierFullError
from tiercache.keys.digest import digest as digest_of
from tiercache.keys.fingerprint import Fingerprint, LayoutManifest
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.tier.contract import FrontTier, Tier, WriteHandle
from tiercache.tier.copying import copy_into
from tiercache.tier.latency import HistogramSnapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TailLookup:
    """A tail lookup's answer: the object ``target`` (a prefix hash) holds the first ``blocks`` of
    the blocks asked for, at its first ``blocks`` positions; ``found`` is the lookup of ``target``
    as a one-chunk chain (where its objects are, for a :meth:`TieredEngine.prefetch` of it)."""

    blocks: int
    target: bytes
    found: LookupResult


_NO_TAIL = TailLookup(0, b"", LookupResult(0, {}))
#: The name the block index is kept under on a lower tier across restarts (:meth:`Tier.put_state`).
BLOCK_INDEX_STATE = "tail-block-index"


class TieredEngine:
    """L1 plus zero or more lower tiers, ordered fastest first (``[disk]``, ``[disk, s3]``, ``[s3]``).

    Thread-safe. Methods marked *non-blocking* do only in-memory work and are safe on a request loop;
    the rest may wait on I/O and belong on a worker thread.
    """

    def __init__(
        self,
        l1: FrontTier,
        lower: Sequence[Tier] = (),
        config: EngineConfig | None = None,
    ) -> None:
        self.l1 = l1
        self.lower = list(lower)
        self.config = config or EngineConfig()
        self.counters = EngineCounters()
        self._lock = threading.Lock()
        self._manifests: dict[Fingerprint, LayoutManifest] = {}  # guarded by _lock
        self._closed = False
        self._remote = RemoteAsker(
            self.config.remote_lookup_workers, self.config.remote_lookup_budget_s, self.counters
        )
        self._locator = Locator(self.tiers, self._remote)
        self._integrity_log = Throttle()
        self._writes = WriteBehind(l1, self.lower, self.config, self.counters, self.integrity_failure)
        self._promoter = Promoter(
            l1, self.lower, self.config.promote_workers, self.counters, self.integrity_failure
        )
        self._blocks = BlockIndex(self.config.tail_index_blocks)
        self._restore_block_index()

    # -- lifecycle -------------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes have reached their tiers, then make tiers durable.

        Returns ``False`` if ``timeout`` passed first. Blocking; call from a worker or at shutdown.
        """
        if not self._writes.flush(timeout):
            return False
        for tier in self.lower:
            tier.flush()
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Drain queues (up to ``timeout``), stop threads and close every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        self._keep_block_index()
        self._writes.close()
        self._promoter.close()
        self._remote.close()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tiers(self) -> list[Tier]:
        """All tiers, fastest first."""
        return [self.l1, *self.lower]

    # -- manifests -------------------------------------------------------------------------------
    def register_manifest(self, manifest: LayoutManifest) -> Fingerprint:
        """Remember a layout manifest and store it beside the data on the persistent tiers."""
        fp = manifest.fingerprint()
        with self._lock:
            known = fp in self._manifests
            self._manifests[fp] = manifest
        if not known:
            for tier in self.lower:
                try:
                    tier.put_manifest(fp, manifest.canonical())
                except TierCacheError as exc:
                    log.warning("could not store manifest %s on %s: %s", fp, tier.name, exc)
        return fp

    def manifest(self, fingerprint: Fingerprint) -> LayoutManifest | None:
        """The manifest of ``fingerprint``: registered in this process, or stored on a lower tier."""
        with self._lock:
            found = self._manifests.get(fingerprint)
        if found is not None:
            return found
        for tier in self.lower:
            raw = tier.get_manifest(fingerprint)
            if raw is not None:
                return LayoutManifest.from_dict(msgspec.json.decode(raw))
        return None

    # -- write path ------------------------------------------------------------------------------
    def reserve(self, key: ObjectKey, nbytes: int, *, tenant: bytes = DEFAULT_TENANT) -> WriteHandle | None:
        """Reserve an L1 slot for a new chunk of ``tenant``; ``None`` (counted) when L1 has no room.
        Non-blocking."""
        try:
            return self.l1.reserve(key, nbytes, tenant=tenant)
        except TierError as exc:
            self.counters.add("stores_dropped")
            log.debug("store of %s dropped: %s", key, exc)
            return None

    def reserve_many(
        self, items: Sequence[tuple[ObjectKey, int]], *, tenants: Sequence[bytes] = ()
    ) -> list[WriteHandle]:
        """Reserve L1 slots for a store of several chunks (of ``tenants``), all or nothing; when L1
        has no room every item is counted in ``stores_dropped`` and the
        :class:`~tiercache.errors.TierFullError` raised. Non-blocking."""
        try:
            return self.l1.reserve_many(items, tenants=tenants)
        except TierFullError:
            self.counters.add("stores_dropped", len(items))
            raise

    def commit(self, handle: WriteHandle, digest: int | None = None) -> None:
        """Publish a filled reservation in L1 (with its payload's ``digest``, as its writer computed
        it over its own bytes; ``None``: a writer in this process, see
        :meth:`FrontTier.commit <tiercache.tier.FrontTier.commit>`) and queue it for the lower
        tiers. Non-blocking."""
        self.commit_many([handle], [digest])

    def commit_many(self, handles: Sequence[WriteHandle], digests: Sequence[int | None]) -> None:
        """:meth:`commit` of each reservation, with its digest, in one call into L1 (a store of
        many chunks). Raises :class:`~tiercache.errors.ReservationError` at the first that is not
        open; those before it are committed and queued (its ``committed`` says how many).
        Non-blocking."""
        owed = self._writes.owes
        done = len(handles)
        t0 = perf_counter()
        try:
            self.l1.commit_many(handles, owed=owed, digests=digests)
        except ReservationError as exc:
            done = exc.committed
            raise
        finally:
            if done:  # each commit timed as its share of the call
                self.l1.stats.latency.observe("write", (perf_counter() - t0) / done, done)
                self.counters.add("stores", done)
                if owed:
                    for handle in handles[:done]:
                        self._writes.queue(handle.key)

    def abort(self, handle: WriteHandle) -> None:
        """Give a reservation back. Non-blocking."""
        self.l1.abort(handle)

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` under ``key`` in one call; ``False`` if it was dropped. Non-blocking."""
        view = memoryview(data).cast("B")
        handle = self.reserve(key, view.nbytes)
        if handle is None:
            return False
        copy_into(handle.buffer, view)
        self.commit(handle, digest_of(view))
        return True

    # -- read path -------------------------------------------------------------------------------
    def lookup(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], *, inflight: bool = False
    ) -> LookupResult:
        """Longest restorable prefix of ``hashes`` for all ``groups`` (all-or-nothing); with
        ``inflight``, objects still being written into L1 count (a :meth:`prefetch` with
        ``inflight_wait_s`` then waits for their commit).

        Blocking when lower tiers must be asked (LMDB lookups; a few S3 requests for a long prompt);
        run it on a worker, not on a request loop.
        """
        self.counters.add("lookups")
        found = self._locator.lookup(hashes, groups, inflight=inflight)
        if found.chunks:
            self.counters.add("lookup_chunks_hit", found.chunks)
        return found

    def lookup_front(self, hashes: Sequence[bytes], groups: Sequence[GroupSpec]) -> LookupResult | None:
        """:meth:`lookup`'s answer when L1 alone gives it (every object of every chunk of ``hashes``
        committed in L1), else ``None``: then call :meth:`lookup`. Counted as a lookup only when it
        answers. Non-blocking: a request loop may call it."""
        found = self._locator.lookup_front(hashes, groups)
        if found is not None:
            self.counters.add("lookups")
            self.counters.add("lookup_chunks_hit", found.chunks)
        return found

    def hold_front(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], *, tenant: bytes = DEFAULT_TENANT
    ) -> tuple[LookupResult, PrefetchTicket] | None:
        """:meth:`lookup_front` and a :meth:`prefetch` of its whole hit without local reads, in one
        pass over L1, when L1 holds every object of every chunk of ``hashes``: the answer and a
        READY ticket holding those objects as one pin (:attr:`PrefetchTicket.held`), else
        ``None`` (nothing held: ask :meth:`lookup_front` or :meth:`lookup`). What the server
        answers most lookups with. Non-blocking."""
        t0 = perf_counter()
        found = self._locator.hold_front(hashes, groups)
        if found is None:
            return None
        result, held, raws = found
        # Each hit timed as its share of the call, as a prefetch's pins are.
        self.l1.stats.latency.observe("read", (perf_counter() - t0) / held.count, held.count)
        self.counters.add("lookups")
        self.counters.add("lookup_chunks_hit", result.chunks)
        ticket = self._promoter.held(hashes, groups, result.chunks, held, tenant)
        if self._writes.watches_reads:  # a prefetch is what a load reads: S3 admission ``read``
            self._writes.read(ObjectKey.from_bytes_many(raws))
        return result, ticket

    def index_blocks(self, target: bytes, blocks: Sequence[bytes]) -> None:
        """The objects under prefix hash ``target`` (every group's) hold ``blocks[j]`` (tail
        hashes) at position ``j``: a tail lookup naming one of them finds ``target``
        (:mod:`tiercache.engine.blocks`). Non-blocking."""
        self._blocks.add(target, blocks)

    def lookup_tail(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], *, inflight: bool = False
    ) -> TailLookup:
        """The stored object holding the longest prefix of ``hashes``, the tail hashes of blocks
        ``0 .. m-1`` of one chunk (:func:`tiercache.keys.tail_hashes`), for every group (every
        group needs that object: a tail's blocks are the newest of a sliding window too).

        The block index names the candidates; each is checked against the tiers like a one-chunk
        lookup, and one no tier holds any more is forgotten. With ``inflight``, an object still
        being written into L1 counts (a prefetch then waits for its commit). Blocking like
        :meth:`lookup`.
        """
        self.counters.add("tail_lookups")
        for j in range(len(hashes) - 1, -1, -1):
            for target in self._blocks.targets(hashes[j]):
                found = self._locator.lookup([target], groups, inflight=True)
                if not found.chunks:
                    self._blocks.forget(hashes[j], target)  # gone from every tier (or a group's is)
                elif inflight or not found.inflight:
                    self.counters.add("tail_blocks_hit", j + 1)
                    return TailLookup(j + 1, target, found)
        return _NO_TAIL

    def _restore_block_index(self) -> None:
        """Read back the block index the last process kept on the first lower tier that has one
        (a hint: each entry is checked against the tiers when a lookup names it)."""
        for tier in self.lower:
            try:
                data = tier.get_state(BLOCK_INDEX_STATE)
            except TierCacheError as exc:
                log.warning(
                    "could not read the tail block index from %s: %s; starting without it", tier.name, exc
                )
                continue
            if data is None:
                continue
            try:
                blocks = self._blocks.restore(data)
            except BlockIndexFormatError as exc:
                log.warning(
                    "the tail block index kept on %s is unreadable (%s); starting without it", tier.name, exc
                )
                return
            log.info("tail block index: %d block hashes read back from %s", blocks, tier.name)
            return

    def _keep_block_index(self) -> None:
        """Keep the block index for the next process, on the first lower tier that keeps state."""
        if not len(self._blocks):
            return
        data = self._blocks.export()
        for tier in self.lower:
            try:
                if tier.put_state(BLOCK_INDEX_STATE, data):
                    log.info("tail block index: %d block hashes kept on %s", len(self._blocks), tier.name)
                    return
            except TierCacheError as exc:
                log.warning("could not keep the tail block index on %s: %s", tier.name, exc)

    def lookup_tail_front(self, hashes: Sequence[bytes], groups: Sequence[GroupSpec]) -> TailLookup | None:
        """:meth:`lookup_tail`'s answer when the block index and L1 alone give it, else ``None``
        (then call :meth:`lookup_tail`): no candidate at all (no tail), or the longest hit's
        candidate committed in L1 for every group (the one :meth:`lookup_tail` would find first).
        A candidate L1 does not hold needs the lower tiers (or is to be forgotten): ``None``.
        Counted only when it answers. Non-blocking: a request loop may call it."""
        for j in range(len(hashes) - 1, -1, -1):
            for target in self._blocks.targets(hashes[j]):
                found = self._locator.lookup_front([target], groups)
                if found is None:
                    return None
                self.counters.add("tail_lookups")
                self.counters.add("tail_blocks_hit", j + 1)
                return TailLookup(j + 1, target, found)
        self.counters.add("tail_lookups")
        return _NO_TAIL

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
        """Start promoting everything the first ``chunks`` chunks need into L1, pinned for the caller.

        Non-blocking: L1 hits are pinned at once; lower-tier objects are copied on the promotion
        executor (into L1 as objects of ``tenant``, the asker); objects being written into L1 are
        pinned once committed, if that happens within ``inflight_wait_s``. Poll with :meth:`poll`;
        release with :meth:`release_ticket`. ``keys``: the objects' keys when the caller has them
        (:attr:`LookupResult.keys` of a lookup whose ``chunks`` equal these ``chunks``).
        ``local_reads=False``: the caller reads nothing through the ticket's ``handles`` (the
        server hands their slots to clients), so objects all in L1 are held as one pin
        (:attr:`PrefetchTicket.held`).
        """
        ticket = self._promoter.prefetch(
            hashes,
            groups,
            chunks,
            inflight_wait_s=inflight_wait_s,
            tenant=tenant,
            keys=keys,
            local_reads=local_reads,
        )
        if self._writes.watches_reads:  # a prefetch is what a load reads: S3 admission ``read``
            self._writes.read(ticket.needed)
        return ticket

    def note_reads(self, keys: Iterable[ObjectKey]) -> None:
        """``keys`` were read by a client outside the engine's own calls (the server's pin of L1
        objects), for S3 admission ``read``. Non-blocking."""
        if self._writes.watches_reads:
            self._writes.read(keys)

    def poll(self, ticket: PrefetchTicket) -> TicketState:
        """Where ``ticket`` stands. Non-blocking."""
        return self._promoter.poll(ticket)

    def wait(self, ticket: PrefetchTicket, timeout: float | None = None) -> TicketState:
        """Block until ``ticket`` is decided or ``timeout`` passes. For tools and tests."""
        return self._promoter.wait(ticket, timeout)

    def release_ticket(self, ticket: PrefetchTicket, *, read: bool = False) -> int:
        """Unpin everything ``ticket`` holds. Safe to call in any state, and twice. ``read``: a
        client copied the objects from the ticket's slots; each one still held counts as an L1
        hit (and an access for eviction), as a pin's read would. Returns how many of its leases
        had expired first (a reader copying from its slots then may not trust the bytes)."""
        return self._promoter.release(ticket, read=read)

    def get(self, key: ObjectKey) -> bytes | None:
        """A verified copy of one object from the fastest tier, promoting it into L1. Blocking.

        The copy out of L1 (shared memory) counts only if it matches the object's digest; an L1
        object that does not is dropped (``integrity_failures_server_read``) and the lower tiers
        are asked instead."""
        for _ in range(2):  # the L1 copy, then once more after a corrupt one was dropped
            handle = timed_pin(self.l1, key)
            if handle is None:
                handle = self._promoter.promote_one(key)
            if handle is None:
                return None
            try:
                data = bytes(handle.buffer)
            finally:
                self.l1.release(handle)
            if handle.digest is None or digest_of(data) == handle.digest:
                self.note_reads((key,))
                return data
            self.integrity_failure("server_read", key)
        return None

    def integrity_failure(
        self, path: str, key: ObjectKey, offset: int | None = None, suspects: str = ""
    ) -> bool | None:
        """A copy of ``key`` out of L1 (at ``offset``) did not match its digest, caught at ``path``
        (one of :data:`~tiercache.engine.counters.INTEGRITY_PATHS`): count it, have L1 re-check the
        object, dropping it if it is corrupt (see :meth:`FrontTier.recheck
        <tiercache.tier.FrontTier.recheck>`, whose answer this returns), and warn (at most once per
        30 s), naming ``suspects`` when the caller knows who may have written there. Blocking:
        hashes the object."""
        self.counters.add(f"integrity_failures_{path}")
        found = self.l1.recheck(key, offset)
        held = self._integrity_log.allow()
        if held is not None:
            log.warning(
                "integrity: a copy of %s out of L1 (%s) did not match the digest its writer committed, so it "
                "was a miss: %s. %s%s(tiercache_engine_integrity_failures_total; see docs/caveats.md)",
                key,
                path,
                {
                    True: "the object was corrupt and is dropped",
                    False: "the object is intact now",
                    None: "it is gone",
                }[found],
                f"Who may have written into its slot late: {suspects}. " if suspects else "",
                f"{held} more since the last such warning " if held else "",
            )
        return found

    def warm(self, key: ObjectKey) -> int | None:
        """Promote ``key`` into L1 from the fastest lower tier holding it (``tiercache warm``).

        Returns the bytes promoted, ``0`` if L1 already holds it, or ``None`` if it could not be
        promoted (no lower tier holds it, it failed verification, or L1 has no room). Blocking.
        """
        if self.l1.contains(key):
            return 0
        handle = self._promoter.promote_one(key)
        if handle is None:
            return None
        try:
            return handle.buffer.nbytes
        finally:
            self.l1.release(handle)

    def delete(self, key: ObjectKey) -> int:
        """Remove ``key`` from every tier; the number of tiers that held it. Blocking."""
        return sum(1 for tier in self.tiers if tier.delete(key))

    def supersede(self, keys: Sequence[ObjectKey]) -> int:
        """Drop ``keys`` (tails a committed chunk covers) from the local tiers that hold them; how
        many objects went. Remote tiers are not asked: each check there is a round trip, and a
        tail left in S3 is still correct; it goes with the bucket's capacity eviction."""
        dropped = 0
        for tier in self.tiers:
            if tier.remote:
                continue
            for key in keys:
                if tier.contains(key) and tier.delete(key):
                    dropped += 1
        self.counters.add("tails_superseded", dropped)
        return dropped

    # -- observation -----------------------------------------------------------------------------
    def latency(self) -> dict[str, dict[str, HistogramSnapshot]]:
        """Per tier, histograms of seconds per chunk object read and written (see
        :attr:`TierStats.latency <tiercache.tier.TierStats.latency>`). Kept apart from
        :meth:`stats`, whose counters stay small enough for ``tiercache inspect`` and the wire."""
        return {tier.name: tier.stats.latency.snapshot() for tier in self.tiers}

    def stats(self) -> dict[str, object]:
        """Engine counters, queue depths, per-tier usage and counters, and per tenant what each
        tier that accounts tenants holds for it (``{"tenants": {label: {"tiers": {tier: {...}}}}}``)."""
        tiers: dict[str, object] = {}
        tenants: dict[str, dict[str, dict[str, object]]] = {}
        for tier in self.tiers:
            for label, held in tier.tenants().items():
                tenants.setdefault(label, {"tiers": {}})["tiers"][tier.name] = held
            usage = tier.usage()
            tiers[tier.name] = {
                "bytes_used": usage.bytes_used,
                "bytes_budget": usage.bytes_budget,
                "objects": usage.objects,
                **tier.stats.snapshot(),
            }
        return {
            "engine": {
                **self.counters.snapshot(),
                **self._writes.depths(),
                "tail_index_blocks": len(self._blocks),
            },
            "tiers": tiers,
            "tenants": tenants,
        }
