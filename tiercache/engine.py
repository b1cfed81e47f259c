"""The tiered engine: composes L1 with the lower tiers (L2 disk, L3 S3) into one cache.

What it adds on top of the tiers, and nothing else:

* **Lookup** of the longest *restorable* prefix of a chain of chunk hashes across all tiers, with the
  hybrid-model rule: at a boundary of ``T`` chunks every full-attention group needs all chunks before
  ``T``, every sliding-window group the chunks of its trailing window, every recurrent group the state
  snapshot stored under chunk ``T-1``. A hit is reported only when *all* groups are satisfied.
* **Promotion**: :meth:`TieredEngine.prefetch` copies lower-tier hits into L1 on a bounded executor and
  pins everything the caller will read, all-or-nothing; the request loop polls the ticket and never
  waits on L2/L3.
* **Write-through**: a chunk committed to L1 is queued for L2 (and then L3 with the ``through``
  policy, or on L2 eviction with ``back``). Queues are bounded; a full queue drops the write and counts
  it instead of blocking. Until a lower tier holds it, the L1 copy is *owed* and L1 will not evict it.

The engine knows tiers only through :class:`~tiercache.tier.Tier`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter

from tiercache.config import EngineConfig, L3WritePolicy
from tiercache.errors import CircuitOpenError, TierCacheError, TierError
from tiercache.keys.fingerprint import Fingerprint, GroupKind, LayoutManifest
from tiercache.keys.object_key import ObjectKey
from tiercache.latency import HistogramSnapshot
from tiercache.tier import Counters, ReadHandle, Tier, WriteHandle

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One object group of a registered engine layout, as the lookup rule needs it.

    ``window_chunks`` is, for a sliding-window group, how many trailing chunks a boundary needs
    (see :meth:`sliding`); it is ignored for the other kinds.
    """

    object_group: int
    kind: GroupKind
    fingerprint: Fingerprint
    window_chunks: int = 0

    @classmethod
    def sliding(
        cls, object_group: int, fingerprint: Fingerprint, window_tokens: int, chunk_size: int
    ) -> GroupSpec:
        """A sliding-window group: the window's tokens span ``ceil(window / chunk)`` whole chunks."""
        chunks = -(-window_tokens // chunk_size)
        return cls(object_group, GroupKind.SLIDING_WINDOW, fingerprint, max(1, chunks))

    def key(self, prefix_hash: bytes) -> ObjectKey:
        """The object key of this group's object for the chunk ending in ``prefix_hash``."""
        return ObjectKey(self.fingerprint, self.object_group, prefix_hash)

    def needed(self, hashes: Sequence[bytes], boundary: int) -> list[ObjectKey]:
        """Keys this group needs to restore the first ``boundary`` chunks."""
        if boundary <= 0:
            return []
        if self.kind is GroupKind.FULL_ATTENTION:
            first = 0
        elif self.kind is GroupKind.SLIDING_WINDOW:
            first = max(0, boundary - self.window_chunks)
        else:
            first = boundary - 1
        return [self.key(h) for h in hashes[first:boundary]]


def needed_keys(
    groups: Sequence[GroupSpec], hashes: Sequence[bytes], boundary: int
) -> list[ObjectKey]:
    """Every key needed to restore ``boundary`` chunks for all ``groups``."""
    return [key for g in groups for key in g.needed(hashes, boundary)]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest restorable prefix, in chunks, and where its objects live.

    ``per_tier`` counts the needed objects by the highest tier holding each one (``"l1"``, ``"disk"``,
    ``"s3"``), so a caller can report hits per tier.
    """

    chunks: int
    per_tier: dict[str, int]


class TicketState(enum.Enum):
    """Where a :class:`PrefetchTicket` stands."""

    PENDING = "pending"  # promotions still running
    READY = "ready"  # ``chunks`` chunks are in L1 and pinned for the caller
    MISS = "miss"  # nothing restorable after all (lower-tier objects vanished or were corrupt)


@dataclass(slots=True)
class PrefetchTicket:
    """Promotion of one lookup's objects into L1; poll with :meth:`TieredEngine.poll`.

    Once READY, ``handles`` pins every object of the first ``chunks`` chunks in L1 (keyed by object
    key); give them back with :meth:`TieredEngine.release_ticket`.
    """

    ticket_id: int
    hashes: tuple[bytes, ...]
    groups: tuple[GroupSpec, ...]
    target: int
    state: TicketState = TicketState.PENDING
    chunks: int = 0
    handles: dict[ObjectKey, ReadHandle] = field(default_factory=dict)
    released: bool = False
    _futures: list[Future[bool]] = field(default_factory=list)


@dataclass(slots=True)
class EngineCounters(Counters):
    """Engine-level counters (tier counters live on each tier)."""

    lookups: int = 0
    lookup_chunks_hit: int = 0
    stores: int = 0
    stores_dropped: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    l2_queue_drops: int = 0
    l3_queue_drops: int = 0
    l2_writes: int = 0
    l3_writes: int = 0
    write_failures: int = 0


_STOP = object()


class TieredEngine:
    """L1 plus zero or more lower tiers, ordered fastest first (``[disk]``, ``[disk, s3]``, ``[s3]``).

    Thread-safe. Methods marked *non-blocking* do only in-memory work and are safe on a request loop;
    the rest may wait on I/O and belong on a worker thread.
    """

    def __init__(
        self,
        l1: Tier,
        lower: Sequence[Tier] = (),
        config: EngineConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.l1 = l1
        self.lower = list(lower)
        self.config = config or EngineConfig()
        self.counters = EngineCounters()
        self._clock = clock
        self._ticket_ids = itertools.count(1)
        self._manifests: dict[Fingerprint, LayoutManifest] = {}  # guarded by _lock
        self._lock = threading.Lock()
        self._closed = False
        # The first lower tier receives write-through from L1; the S3 tier (if it is not the first)
        # receives either write-through after it or write-back on its eviction.
        self._l2 = self.lower[0] if self.lower else None
        self._l3 = self.lower[1] if len(self.lower) > 1 else None
        depth = self.config.write_queue_depth
        self._l2_queue: queue.Queue[object] = queue.Queue(depth)
        self._l3_queue: queue.Queue[object] = queue.Queue(depth)
        self._promoter = ThreadPoolExecutor(
            self.config.promote_workers, thread_name_prefix="tiercache-promote"
        )
        self._writers: list[threading.Thread] = []
        if self._l2 is not None:
            self._start_writers(self._l2_queue, self._write_l2, "tiercache-write-l2")
        if self._l3 is not None:
            self._start_writers(self._l3_queue, self._write_l3, "tiercache-write-l3")
            if self.config.l3_write_policy is L3WritePolicy.BACK:
                assert self._l2 is not None
                self._l2.set_eviction_listener(self._on_l2_evict)

    # -- lifecycle -------------------------------------------------------------------------------
    def _start_writers(
        self, q: queue.Queue[object], work: Callable[[object], None], name: str
    ) -> None:
        for i in range(self.config.write_workers):
            t = threading.Thread(target=self._drain, args=(q, work), name=f"{name}-{i}", daemon=True)
            t.start()
            self._writers.append(t)

    def _drain(self, q: queue.Queue[object], work: Callable[[object], None]) -> None:
        while True:
            item = q.get()
            try:
                if item is _STOP:
                    return
                work(item)
            except Exception:  # a background failure is a counted result, never a dead thread
                self.counters.add("write_failures")
                log.exception("background write failed")
            finally:
                q.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes have reached their tiers, then make tiers durable.

        Returns ``False`` if ``timeout`` passed first. Blocking; call from a worker or at shutdown.
        """
        end = None if timeout is None else time.monotonic() + timeout
        for q in (self._l2_queue, self._l3_queue):
            while q.unfinished_tasks:
                if end is not None and time.monotonic() > end:
                    return False
                time.sleep(0.005)
        for tier in self.lower:
            tier.flush()
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Drain queues (up to ``timeout``), stop threads and close every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        for q in (self._l2_queue, self._l3_queue):
            for _ in range(self.config.write_workers):
                try:
                    q.put(_STOP, timeout=1.0)
                except queue.Full:
                    pass
        for t in self._writers:
            t.join(timeout=2.0)
        self._promoter.shutdown(wait=True, cancel_futures=True)
        for tier in [self.l1, *self.lower]:
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
        import msgspec

        for tier in self.lower:
            raw = tier.get_manifest(fingerprint)
            if raw is not None:
                return LayoutManifest.from_dict(msgspec.json.decode(raw))
        return None

    # -- write path ------------------------------------------------------------------------------
    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle | None:
        """Reserve an L1 slot for a new chunk; ``None`` (counted) when L1 has no room. Non-blocking."""
        try:
            return self.l1.reserve(key, nbytes)
        except TierError as exc:
            self.counters.add("stores_dropped")
            log.debug("store of %s dropped: %s", key, exc)
            return None

    def commit(self, handle: WriteHandle) -> None:
        """Publish a filled reservation in L1 and queue it for the lower tiers. Non-blocking."""
        owed = self._l2 is not None
        t0 = perf_counter()
        self.l1.commit(handle, owed=owed)
        self.l1.stats.latency.observe("write", perf_counter() - t0)
        self.counters.add("stores")
        if owed:
            try:
                self._l2_queue.put_nowait(handle.key)
            except queue.Full:
                # Dropping the write-through means L1 no longer owes it: let it be evicted normally.
                self.counters.add("l2_queue_drops")
                self.l1.settle(handle.key)

    def abort(self, handle: WriteHandle) -> None:
        """Give a reservation back. Non-blocking."""
        self.l1.abort(handle)

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` under ``key`` in one call; ``False`` if it was dropped. Non-blocking."""
        view = memoryview(data).cast("B")
        handle = self.reserve(key, view.nbytes)
        if handle is None:
            return False
        handle.buffer[:] = view
        self.commit(handle)
        return True

    def _write_l2(self, item: object) -> None:
        """Copy one owed chunk from L1 to the first lower tier, then let L1 evict it again.

        One chunk per call on purpose: LMDB commits one large value per transaction fastest
        (measured: 6.3 GB/s, but 1.7 GB/s with two 256 KiB values per transaction).
        """
        assert isinstance(item, ObjectKey) and self._l2 is not None
        key = item
        pinned = self._hold_l1(key)
        if pinned is None:  # deleted or replaced meanwhile; nothing owed any more
            return
        try:
            t0 = perf_counter()
            self._l2.put(key, pinned.buffer)
            self._l2.stats.latency.observe("write", perf_counter() - t0)
            self.counters.add("l2_writes")
        except CircuitOpenError as exc:  # tiers l1,s3: see _write_l3
            self.counters.add("write_failures")
            log.debug("write of %s to %s skipped: %s", key, self._l2.name, exc)
            return
        except TierCacheError as exc:
            self.counters.add("write_failures")
            log.warning("write of %s to %s failed: %s", key, self._l2.name, exc)
            return
        finally:
            self.l1.release(pinned)
            self.l1.settle(key)
        if self._l3 is not None and self.config.l3_write_policy is L3WritePolicy.THROUGH:
            self._enqueue_l3(key)

    def _enqueue_l3(self, item: object) -> None:
        try:
            self._l3_queue.put_nowait(item)
        except queue.Full:
            self.counters.add("l3_queue_drops")

    def _write_l3(self, item: object) -> None:
        assert self._l3 is not None
        pinned: ReadHandle | None = None
        if isinstance(item, tuple):  # write-back: (key, payload bytes) handed over on L2 eviction
            key, payload = item
        else:
            assert isinstance(item, ObjectKey) and self._l2 is not None
            key, pinned = item, self._timed_pin(self._l2, item, count=False)  # serves no reader
            if pinned is None:  # evicted from L2 before its turn: nothing left to copy
                return
            payload = pinned.buffer
        try:
            t0 = perf_counter()
            self._l3.put(key, payload)
            self._l3.stats.latency.observe("write", perf_counter() - t0)
            self.counters.add("l3_writes")
        except CircuitOpenError as exc:
            # Not attempted: the tier already failed and said so. Counted, but not one warning per
            # chunk, which during an outage would flood the log at the write rate.
            self.counters.add("write_failures")
            log.debug("write of %s to %s skipped: %s", key, self._l3.name, exc)
        except TierCacheError as exc:
            self.counters.add("write_failures")
            log.warning("write of %s to %s failed: %s", key, self._l3.name, exc)
        finally:
            if pinned is not None and self._l2 is not None:
                self._l2.release(pinned)

    def _on_l2_evict(self, key: ObjectKey, payload: memoryview) -> None:
        """Write-back: hand a chunk the disk tier is evicting to S3 (bounded queue, dropped if full).

        Copies the payload because the view dies with the eviction's transaction.
        """
        self._enqueue_l3((key, bytes(payload)))

    # -- read path -------------------------------------------------------------------------------
    def _locate(self, keys: Sequence[ObjectKey], where: dict[ObjectKey, str]) -> None:
        """Record in ``where`` the fastest *local* tier holding each key, one batched call per tier
        (one lock on L1, one read transaction on LMDB)."""
        pending = [k for k in dict.fromkeys(keys) if k not in where]
        for tier in self.tiers:
            if not pending or tier.remote:
                continue
            found = tier.contains_many(pending)
            for key, hit in zip(pending, found, strict=True):
                if hit:
                    where[key] = tier.name
            pending = [k for k, hit in zip(pending, found, strict=True) if not hit]

    def _present_prefix(self, keys: Sequence[ObjectKey], where: dict[ObjectKey, str]) -> int:
        """How many leading ``keys`` some tier holds; fills ``where`` (remote finds included)."""
        self._locate(keys, where)
        remote = [t for t in self.tiers if t.remote]
        i = 0
        while i < len(keys):
            if keys[i] in where:
                i += 1
                continue
            # A remote tier answers a whole run with a search instead of one request per chunk.
            run = 0
            for tier in remote:
                run = tier.lookup_prefix(keys[i:])
                if run:
                    for key in keys[i : i + run]:
                        where.setdefault(key, tier.name)
                    break
            if run == 0:
                break
            i += run
        return i

    def _present(self, keys: Sequence[ObjectKey], where: dict[ObjectKey, str]) -> bool:
        """Whether every key is held by some tier (asking remote tiers key by key, cached)."""
        self._locate(keys, where)
        for key in keys:
            if key in where:
                continue
            tier = next((t for t in self.tiers if t.remote and t.contains(key)), None)
            if tier is None:
                return False
            where[key] = tier.name
        return True

    def lookup(self, hashes: Sequence[bytes], groups: Sequence[GroupSpec]) -> LookupResult:
        """Longest restorable prefix of ``hashes`` for all ``groups`` (all-or-nothing).

        Blocking when lower tiers must be asked (LMDB lookups; a few S3 requests for a long prompt);
        run it on a worker, not on a request loop. Local tiers are asked in batches (one call per
        tier for all of a group's chunks), remote tiers by search.
        """
        self.counters.add("lookups")
        if not groups or not hashes:
            return LookupResult(0, {})
        where: dict[ObjectKey, str] = {}
        boundary = len(hashes)
        full: list[list[ObjectKey]] = []
        for g in groups:
            if g.kind is GroupKind.FULL_ATTENTION:
                full.append(g.needed(hashes, boundary))
                boundary = self._present_prefix(full[-1], where)
        partial = [g for g in groups if g.kind is not GroupKind.FULL_ATTENTION]
        partial_keys: list[ObjectKey] = []
        while boundary > 0 and partial:
            partial_keys = [k for g in partial for k in g.needed(hashes, boundary)]
            if self._present(partial_keys, where):
                break
            boundary -= 1
        if boundary == 0:
            return LookupResult(0, {})
        counts: dict[str, int] = {}
        for key in [k for keys in full for k in keys[:boundary]] + partial_keys:
            counts[where[key]] = counts.get(where[key], 0) + 1
        self.counters.add("lookup_chunks_hit", boundary)
        return LookupResult(boundary, counts)

    def prefetch(
        self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], chunks: int
    ) -> PrefetchTicket:
        """Start promoting everything the first ``chunks`` chunks need into L1, pinned for the caller.

        Non-blocking: L1 hits are pinned at once; lower-tier objects are copied on the promotion
        executor. Poll with :meth:`poll`; release with :meth:`release_ticket`.
        """
        ticket = PrefetchTicket(next(self._ticket_ids), tuple(hashes), tuple(groups), chunks)
        for key in needed_keys(groups, hashes, chunks):
            if key in ticket.handles:
                continue
            handle = self._hold_l1(key)
            if handle is not None:
                ticket.handles[key] = handle
            else:
                ticket._futures.append(self._promoter.submit(self._promote, ticket, key))
        if not ticket._futures:
            self._settle(ticket)
        return ticket

    def _promote(self, ticket: PrefetchTicket, key: ObjectKey) -> bool:
        """Copy ``key`` from the fastest lower tier holding it into L1, and pin it for ``ticket``.

        The bytes land in an invisible L1 reservation and are verified there by the lower tier
        (``read_into``); only a verified copy is committed.
        """
        for tier in self.lower:
            dst: list[WriteHandle] = []

            def alloc(nbytes: int, dst: list[WriteHandle] = dst) -> memoryview:
                dst.append(self.l1.reserve(key, nbytes))  # TierFullError: L1 has no room
                return dst[0].buffer

            try:
                t0 = perf_counter()
                found = tier.read_into(key, alloc)
                elapsed = perf_counter() - t0
            except TierError as exc:
                log.debug("promotion of %s from %s failed: %s", key, tier.name, exc)
                if dst:
                    self.l1.abort(dst[0])
                break  # L1 is full or the tier failed: recompute rather than wait
            if not found:  # a miss, or corrupt here (then dst held unverified bytes)
                if dst:
                    self.l1.abort(dst[0])
                continue  # a lower tier may still have it
            tier.stats.latency.observe("read", elapsed)  # hits only: a miss is not a transfer
            t0 = perf_counter()
            self.l1.commit(dst[0])
            self.l1.stats.latency.observe("write", perf_counter() - t0)
            pinned = self._hold_l1(key)
            if pinned is None:
                break
            with self._lock:
                late = ticket.released
                if not late:
                    ticket.handles[key] = pinned
            if late:  # the caller gave up on the ticket while we copied
                self.l1.release(pinned)
            self.counters.add("promotions")
            return True
        self.counters.add("promotion_failures")
        return False

    def _settle(self, ticket: PrefetchTicket) -> None:
        """Decide a finished ticket: the longest boundary whose objects are all pinned."""
        boundary = ticket.target
        while boundary > 0:
            needed = needed_keys(ticket.groups, ticket.hashes, boundary)
            if all(k in ticket.handles for k in needed):
                break
            boundary -= 1
        keep = set(needed_keys(ticket.groups, ticket.hashes, boundary))
        for key in [k for k in ticket.handles if k not in keep]:
            self.l1.release(ticket.handles.pop(key))
        ticket.chunks = boundary
        ticket.state = TicketState.READY if boundary > 0 else TicketState.MISS

    def poll(self, ticket: PrefetchTicket) -> TicketState:
        """Where ``ticket`` stands. Non-blocking."""
        if ticket.state is TicketState.PENDING and all(f.done() for f in ticket._futures):
            with self._lock:
                self._settle(ticket)
        return ticket.state

    def wait(self, ticket: PrefetchTicket, timeout: float | None = None) -> TicketState:
        """Block until ``ticket`` is decided or ``timeout`` passes. For tools and tests."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll(ticket) is TicketState.PENDING:
            if end is not None and time.monotonic() > end:
                break
            time.sleep(0.001)
        return ticket.state

    def release_ticket(self, ticket: PrefetchTicket) -> None:
        """Unpin everything ``ticket`` holds. Safe to call in any state, and twice."""
        for f in ticket._futures:
            f.cancel()
        with self._lock:
            ticket.released = True
            handles, ticket.handles = ticket.handles, {}
        for handle in handles.values():
            self.l1.release(handle)

    def get(self, key: ObjectKey) -> bytes | None:
        """A verified copy of one object from the fastest tier, promoting it into L1. Blocking."""
        ticket = PrefetchTicket(0, (), (), 0)
        handle = self._timed_pin(self.l1, key)
        if handle is None and self._promote(ticket, key):
            handle = ticket.handles.pop(key)
        if handle is None:
            return None
        try:
            return bytes(handle.buffer)
        finally:
            self.l1.release(handle)

    def warm(self, key: ObjectKey) -> int | None:
        """Promote ``key`` into L1 from the fastest lower tier holding it (``tiercache warm``).

        Returns the bytes promoted, ``0`` if L1 already holds it, or ``None`` if it could not be
        promoted (no lower tier holds it, it failed verification, or L1 has no room). Blocking.
        """
        if self.l1.contains(key):
            return 0
        ticket = PrefetchTicket(0, (), (), 0)
        if not self._promote(ticket, key):
            return None
        handle = ticket.handles.pop(key)
        try:
            return handle.buffer.nbytes
        finally:
            self.l1.release(handle)

    def delete(self, key: ObjectKey) -> int:
        """Remove ``key`` from every tier; the number of tiers that held it. Blocking."""
        return sum(1 for tier in self.tiers if tier.delete(key))

    @staticmethod
    def _timed_pin(tier: Tier, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        """``tier.pin(key, count=count)``, its duration recorded as a ``read`` when it hits."""
        t0 = perf_counter()
        handle = tier.pin(key, count=count)
        if handle is not None:
            tier.stats.latency.observe("read", perf_counter() - t0)
        return handle

    def _hold_l1(self, key: ObjectKey) -> ReadHandle | None:
        """Pin ``key`` in L1 for the engine's own use (a ticket's hold, a write-through source): not
        a hit or a miss, since it serves no reader; the reader's own pin (``get``, the server's pin
        op) counts. Timed as an L1 ``read`` like every pin."""
        return self._timed_pin(self.l1, key, count=False)

    # -- observation -----------------------------------------------------------------------------
    def latency(self) -> dict[str, dict[str, HistogramSnapshot]]:
        """Per tier, histograms of seconds per chunk object read and written (see
        :attr:`TierStats.latency <tiercache.tier.TierStats.latency>`). Kept apart from
        :meth:`stats`, whose counters stay small enough for ``tiercache inspect`` and the wire."""
        return {tier.name: tier.stats.latency.snapshot() for tier in self.tiers}

    def stats(self) -> dict[str, object]:
        """Engine counters, queue depths, and per-tier usage and counters."""
        tiers: dict[str, object] = {}
        for tier in self.tiers:
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
                "l2_queue_depth": self._l2_queue.qsize(),
                "l3_queue_depth": self._l3_queue.qsize(),
            },
            "tiers": tiers,
        }
