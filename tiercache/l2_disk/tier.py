"""The LMDB-backed disk tier (:class:`DiskTier`).

One LMDB environment at ``DiskConfig.path`` in the format of :mod:`tiercache.l2_disk.records`.
``data`` and ``meta`` of one object are always written and deleted in the same write transaction, so
a crash leaves either the old object or the new one. ``bytes_used`` is kept in the same
transactions, so a restart knows its usage and its LRU order without scanning.

Recency is approximate, by at most ``sync_interval_s``: a read or an overwrite writes no recency
record itself but queues a *touch*, and the background thread moves every queued key to the young
end in one write transaction per interval (eviction, :meth:`DiskTier.flush` and
:meth:`DiskTier.close` apply them at once, and a put does when more than ``_TOUCH_BACKLOG`` keys are
queued). Reads therefore never open a write transaction, and an overwrite writes one leaf page fewer.
A crash forgets at most the last interval's touches: those objects keep their older place in the LRU
order. A new object gets its place in its own put's transaction, as before.

LMDB facts this tier is built around (each measured on this code; see docs/storage.md):

* pages freed by a write transaction can be reused only by a *later* one (in practice two later), so
  eviction commits in its own transaction, followed by a tiny "nudge" commit, before the insert;
* after ``MDB_MAP_FULL`` the transaction is dead: it is aborted, more is evicted, and the insert is
  retried; if that cannot succeed the caller gets :class:`~tiercache.errors.TierFullError`;
* a long-lived read transaction pins pages and grows the file, so read leases expire and no
  iterator keeps a transaction open between yields;
* ``sync=False`` plus a background ``env.sync()`` every ``sync_interval_s`` is the practical
  setting: LMDB stays consistent after a crash and only the last interval's writes may be lost.

Records are read and written through :class:`~tiercache.l2_disk.store.RecordStore`.

Locks (all per instance, none module-level):

* ``_write_lock`` serialises this process's write transactions (LMDB would too, but the eviction
  decision and the insert must see each other's effects, and a write transaction must end on the
  thread that began it, which ``with`` blocks under one lock guarantee). Never held while waiting on
  anything but LMDB and the ``on_evict`` callback.
* ``_state_lock`` guards the in-memory tables: reservations, leases, pin counts and pending recency
  touches. Held only for dictionary operations, never across LMDB calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb

from tiercache.config.parts import DiskConfig
from tiercache.config.units import MiB
from tiercache.errors import DiskTierError, FrameError, IntegrityError, TierFullError
from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT, tenant_label
from tiercache.l2_disk.environment import file_system_room, free_bytes, open_environment
from tiercache.l2_disk.eviction import EvictionWalk
from tiercache.l2_disk.records import (
    DISK_FORMAT_VERSION,
    INFO_SEQ,
    META_BYTES,
    b64,
    meta_header,
    recency_key,
    scan_by_use,
    scan_records,
    state_key,
)
from tiercache.l2_disk.store import KEPT_SEQ, OVER_LIMIT, RecordStore
from tiercache.tier.contract import EvictionListener, ReadHandle, Tier, TierUsage, WriteHandle
from tiercache.tier.frames import (
    ZSTD_FLAG,
    FrameHeader,
    check_copy,
    checksum,
    encode_header,
    pack_payload,
    plain_header_fields,
    verify_payload,
)
from tiercache.tier.quotas import TenantQuotas, count_tenant
from tiercache.tier.staging import StagedWrites
from tiercache.tier.stats import EvictionReason

log = logging.getLogger(__name__)

#: The share of the file system's room (free space plus this tier's file) a budget may take at
#: start: LMDB's file holds more than the stored bytes (pages, the B-tree, the free list).
_FS_SHARE = 0.8


_SWEEP_EVERY_S = 0.05


#: A write finds at least this many times its size free on the file system, plus the slack, or
#: the budget shrinks (:meth:`DiskTier._keep_file_system_room`).
_FS_RESERVE_WRITES = 4


_FS_SLACK = 1 << 20


#: When the file system runs low, the budget shrinks to this share of what the tier holds.
_SHRINK = 0.8


#: Pending recency touches (reads, overwrites) are applied by the background thread every
#: ``sync_interval_s``; past this many distinct keys the next put applies them in its own txn, so
#: the table stays bounded however fast reads come.
_TOUCH_BACKLOG = 4096


_MAP_FULL_RETRIES = 2


#: An open read: (txn, header, stored bytes, meta record seen, stored size, problem found).
_Found = tuple[lmdb.Transaction, FrameHeader | None, Any, bytes | None, int, str | None]


def _scribbled(key: ObjectKey) -> IntegrityError:
    return IntegrityError(
        f"the copy of {key} into its L1 reservation changed while it was made (the disk's own copy is "
        "intact): another process wrote into that slot",
        "promotion",
    )


@dataclass(slots=True)
class _Lease:
    key_bytes: bytes
    txn: lmdb.Transaction | None  # None when the payload was decompressed into our own memory
    expires_at: float


class DiskTier(Tier):
    """L2: verified, persistent, LRU-evicted objects in one LMDB environment.

    Every method is thread-safe and may block on disk I/O; the engine calls it from its bounded L2
    executor, never from a request loop. Reads run concurrently; writes are serialised.

    ``on_evict(key, payload)`` is called for each object evicted for capacity *before* it is
    deleted, inside the eviction write transaction: ``payload`` is a verified view that is valid
    only during the call, so copy it (the engine hands it to the S3 write-back queue). It must be
    quick and must not call back into this tier. If it raises, that object is kept and the next
    one is tried.
    """

    name = "disk"

    def __init__(
        self,
        config: DiskConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: EvictionListener | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self._clock = clock
        self._on_evict = on_evict
        self._budget = config.budget_bytes
        self._high = int(config.high_watermark * config.budget_bytes)
        self._map_size = int(config.map_headroom * config.budget_bytes) + 64 * MiB
        self._write_lock = threading.Lock()  # guards: this process's write transactions
        self._state_lock = threading.Lock()  # guards: the three tables below and _next_token
        self._staged = StagedWrites(config.reservation_ttl_s, clock, self.stats)
        self._quotas = TenantQuotas(config.budget_bytes, config.tenant_share, config.tenant_overrides())
        # Per tenant, counters of this process (what each holds is persisted: RecordStore.tenant_totals).
        self._tenant_puts: Counter[bytes] = Counter()  # guarded by _state_lock
        self._tenant_evictions: Counter[bytes] = Counter()  # guarded by _state_lock
        self._leases: dict[int, _Lease] = {}
        self._pins: Counter[bytes] = Counter()
        self._touched: dict[bytes, None] = {}
        self._next_token = 1
        self._sweep_after = 0.0  # clock time of the next expiry sweep (a stale read is harmless)
        self._syncs = 0  # written only by the sync thread and flush(); read without a lock
        self._closed = False
        self._stop = threading.Event()
        self._sync_thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._held_at_shrink: int | None = None  # stored bytes when the file system ran low
        self._unchecked = 0  # bytes to write before the file system's free space is asked again
        self._open()
        room = file_system_room(config.path)
        if room is not None and self._budget > int(_FS_SHARE * room):
            self._set_budget(
                int(_FS_SHARE * room),
                f"--disk-size-gb ({config.budget_bytes} bytes) is more than the file system at "
                f"{config.path} can hold ({room} bytes: its free space and this tier's file)",
            )
        self._start_sync_thread()

    # -- lifecycle -----------------------------------------------------------------------------
    def _open(self) -> None:
        """Open the environment (:func:`~tiercache.l2_disk.environment.open_environment`) and the
        handles every path uses."""
        self._env, self._dbs = open_environment(self.config.path, self._map_size)
        self._data_db, self._meta_db = self._dbs["data"], self._dbs["meta"]  # hot-path lookups
        self._records = RecordStore(self._dbs)

    def _start_sync_thread(self) -> None:
        self._stop = threading.Event()
        thread = threading.Thread(
            target=self._background,
            args=(self._stop,),
            name=f"tiercache-disk-sync:{self.config.path.name}",
            daemon=True,
        )
        self._sync_thread = thread
        thread.start()

    def _background(self, stop: threading.Event) -> None:
        """Every ``sync_interval_s``: expire leases, apply recency touches, ``env.sync()``."""
        pid = os.getpid()
        while not stop.wait(self.config.sync_interval_s):
            if os.getpid() != pid or self._closed:
                return
            try:
                self._sweep()
                if self._touched:
                    with self._write_lock, self._env.begin(write=True, buffers=True) as txn:
                        self._apply_touches(txn)
                self._env.sync(True)
                self._syncs += 1
            except Exception:  # the thread must survive a bad interval; the next one retries
                self.stats.add("errors")
                log.exception("disk tier background sync at %s failed", self.config.path)

    def _env_here(self) -> lmdb.Environment:
        """The environment, reopened first if this process is a fork of the one that opened it."""
        if self._closed:
            raise DiskTierError(
                f"the disk tier at {self.config.path} is closed; create a new DiskTier to use it"
            )
        if os.getpid() != self._pid:
            self._after_fork()
        return self._env

    def _after_fork(self) -> None:
        # Locks may have been held by parent threads that do not exist here: start fresh.
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        # Drop (never abort) the parent's read transactions: aborting would clear *its* reader slots
        # in the shared lock file, letting its pinned pages be reused under it. py-lmdb skips the
        # abort for objects finalised in another process, so close() below then leaves them alone.
        self._leases.clear()
        self._pins.clear()
        self._touched.clear()
        try:
            self._env.close()
        except lmdb.Error:
            log.debug("closing the inherited LMDB handle failed", exc_info=True)
        self._pid = os.getpid()
        self._open()
        self._start_sync_thread()

    def flush(self, timeout: float | None = None) -> None:
        """Apply pending recency touches and ``env.sync()`` now. Blocks on an fsync."""
        env = self._env_here()
        try:
            if self._touched:
                with self._write_lock, env.begin(write=True, buffers=True) as txn:
                    self._apply_touches(txn)
            env.sync(True)
            self._syncs += 1
        except lmdb.Error as exc:
            raise self._translate(exc, "sync") from exc

    @property
    def syncs(self) -> int:
        """How many times the environment has been synced to disk (background thread and flush)."""
        return self._syncs

    def close(self) -> None:
        """Stop the sync thread, end every lease, sync and close. Idempotent; cannot hang.

        Buffers of handles still pinned become invalid: release them first.
        """
        if self._closed:
            return
        forked = os.getpid() != self._pid
        self._stop.set()
        thread = self._sync_thread
        if thread is not None and thread.is_alive() and not forked:
            thread.join(timeout=max(5.0, 2 * self.config.sync_interval_s))
            if thread.is_alive():
                # Stuck in an fsync on a sick disk: closing the env under it could crash us.
                log.error(
                    "disk tier sync thread at %s did not stop; leaving the LMDB handle open",
                    self.config.path,
                )
                self._closed = True
                return
        with self._state_lock:
            leases = list(self._leases.values())
            self._leases.clear()
            self._pins.clear()
            self._closed = True
        if forked:
            return  # the parent's handle: never touch it from here (see _after_fork)
        with self._write_lock:
            try:
                if self._touched:
                    with self._env.begin(write=True, buffers=True) as txn:
                        self._apply_touches(txn)
                for lease in leases:
                    if lease.txn is not None:
                        lease.txn.abort()
                self._env.sync(True)
            except lmdb.Error:
                log.warning("final sync of the disk tier at %s failed", self.config.path, exc_info=True)
            finally:
                self._env.close()

    # -- the budget ----------------------------------------------------------------------------
    def _set_budget(self, budget: int, why: str) -> None:
        """Keep at most ``budget`` bytes from now on (eviction brings the tier under it), saying
        ``why`` in a warning."""
        log.warning(
            "%s: the disk tier now keeps at most %d bytes (was %d); free space there or lower --disk-size-gb",
            why,
            budget,
            self._budget,
        )
        self._budget = budget
        self._high = int(self.config.high_watermark * budget)
        self._quotas = TenantQuotas(budget, self.config.tenant_share, self.config.tenant_overrides())

    # -- helpers -------------------------------------------------------------------------------
    def _translate(self, exc: lmdb.Error, what: str) -> DiskTierError:
        self.stats.add("errors")
        return DiskTierError(
            f"LMDB {what} failed at {self.config.path}: {exc}; check the disk (space, I/O errors) "
            "or delete the directory, which only holds cached data"
        )

    def _token(self) -> int:
        # caller holds _state_lock
        token = self._next_token
        self._next_token += 1
        return token

    def _sweep(self) -> None:
        """Expire reservations and leases whose time is up (aborting the leases' read txns).

        Runs at most every ``_SWEEP_EVERY_S`` of clock time: it scans every open lease, and reads
        call it on every object.
        """
        now = self._clock()
        if now < self._sweep_after:
            return
        self._sweep_after = now + _SWEEP_EVERY_S
        self._staged.expire()
        expired: list[_Lease] = []
        with self._state_lock:
            for token in [t for t, lease in self._leases.items() if lease.expires_at <= now]:
                lease = self._leases.pop(token)
                self._unpin(lease.key_bytes)
                expired.append(lease)
        for lease in expired:
            self.stats.add("expired_leases")
            if lease.txn is not None:
                lease.txn.abort()

    def _unpin(self, kb: bytes) -> None:
        # caller holds _state_lock
        self._pins[kb] -= 1
        if self._pins[kb] <= 0:
            del self._pins[kb]

    def _apply_touches(self, txn: lmdb.Transaction) -> bool:
        """Move every key touched (read or overwritten) since the last call to the young end of the
        LRU order, in ``txn``; ``False`` if there was none."""
        with self._state_lock:
            touched, self._touched = self._touched, {}
        if not touched:
            return False
        self._records.touch(txn, touched)
        return True

    def _drop_corrupt(
        self, key: ObjectKey, kb: bytes, seen_meta: bytes | None, size: int, why: str, *, counted: bool = True
    ) -> None:
        """Delete ``kb`` if its meta record is still ``seen_meta``; ``counted``: it failed a read's
        verification (a verify failure and a miss), not a write's read-back."""
        if counted:
            log.warning("disk tier object %s failed verification (%s); deleting it", key, why)
            self.stats.add("verify_failures")
            self.stats.add("misses")
        try:
            with self._write_lock, self._env.begin(write=True, buffers=True) as txn:
                current = txn.get(kb, db=self._meta_db)
                if (None if current is None else bytes(current)) != seen_meta:
                    return  # replaced by a new write since we looked: not ours to delete
                records = self._records
                records.set_used(txn, records.used(txn) - records.delete(txn, kb, size))
        except lmdb.Error as exc:
            raise self._translate(exc, "delete of a corrupt object") from exc
        self.stats.evicted(EvictionReason.CORRUPT, keys=(key,))

    # -- writes ------------------------------------------------------------------------------------
    def reserve(self, key: ObjectKey, nbytes: int) -> WriteHandle:
        """A writable ``nbytes`` buffer in process memory; nothing touches LMDB until commit.

        Cheap (one allocation). Raises :class:`TierFullError` if ``nbytes`` exceeds the budget.
        """
        self._env_here()
        if nbytes > self._budget:
            self.stats.add("skipped")
            raise TierFullError(
                f"an object of {nbytes} bytes exceeds the disk tier budget of {self._budget} "
                "bytes; raise --disk-size-gb or use smaller chunks"
            )
        self._sweep()
        return self._staged.reserve(key, nbytes)

    def commit(self, handle: WriteHandle) -> None:
        """Write the reserved buffer as one atomic LMDB transaction (evicting first if needed).

        Blocks on LMDB (a memory copy into the page cache; ``sync=False``). Raises
        :class:`ReservationError` for an unknown, finished or expired reservation, and
        :class:`TierFullError` if no room can be made.
        """
        self._env_here()
        self._sweep()
        self.put(handle.key, self._staged.take(handle))

    def abort(self, handle: WriteHandle) -> None:
        """Drop a reservation; a no-op if it is already gone. Cheap."""
        self._staged.drop(handle)

    def put(
        self,
        key: ObjectKey,
        data: bytes | bytearray | memoryview,
        *,
        tenant: bytes = DEFAULT_TENANT,
        digest: int | None = None,
    ) -> None:
        """Store ``data`` straight from the caller's buffer (one copy: LMDB's, into the map), as an
        object of ``tenant`` (whose quota decides what is evicted for it: :meth:`_evict_in`).

        With ``digest`` (the writer's, for ``data`` in shared memory) the frame carries it as its
        checksum, and the copy LMDB keeps is checked against it once written: one that differs
        (the source changed under the copy) is deleted again and :class:`IntegrityError` raised. A
        reader never gets it meanwhile: its checksum is the writer's, so it fails verification.

        One object per transaction on purpose: LMDB commits one large value per transaction fastest
        (measured here: 6.3 GB/s for 256 KiB values, 1.7 GB/s with two per transaction). Blocks on
        LMDB; raises :class:`TierFullError` if no room can be made.
        """
        self._env_here()
        view = memoryview(data).cast("B")
        kb = key.to_bytes()
        if self.config.compress:
            if digest is not None:  # compress a private copy that is known to be the writer's
                view = memoryview(bytes(view))
                check_copy(view, digest, key, "write_through")
            header, stored = pack_payload(key, view, compress=True)
            head = header.encode()
            digest = None  # checked above; the stored bytes are this process's own
        else:  # the common case, without building a FrameHeader: same bytes, ~2 us less per put
            stored = view
            head = encode_header(kb, 0, len(view), len(view), checksum(view) if digest is None else digest)
        if len(stored) > self._budget:
            self.stats.add("skipped")
            raise TierFullError(
                f"an object of {len(stored)} stored bytes exceeds the disk tier budget of "
                f"{self._budget} bytes; raise --disk-size-gb or use smaller chunks"
            )
        self._sweep()
        self._store(key, kb, head, stored, tenant)
        if digest is not None:
            self._check_stored(key, kb, head, digest)

    def _check_stored(self, key: ObjectKey, kb: bytes, head: bytes, digest: int) -> None:
        """Raise :class:`IntegrityError` (after deleting it) if the payload just stored under
        ``kb`` with header ``head`` does not hash to ``digest``. Reads it back from the map."""
        try:
            with self._env.begin(buffers=True) as txn:
                meta = txn.get(kb, db=self._meta_db)
                data = txn.get(kb, db=self._data_db)
                if meta is None or bytes(meta_header(meta)) != head:
                    return  # replaced by another write since: not ours to judge
                if data is not None and checksum(data) == digest:
                    return
                seen, size = bytes(meta), 0 if data is None else len(data)
        except lmdb.Error as exc:
            raise self._translate(exc, "read-back of a write") from exc
        self._drop_corrupt(key, kb, seen, size, "the source changed while it was copied", counted=False)
        raise IntegrityError(
            f"the L1 bytes of {key} changed while the disk tier copied them (they differ from the digest "
            "their writer committed); the copy was deleted",
            "write_through",
        )

    def _store(
        self, key: ObjectKey, kb: bytes, head: bytes, stored: Any, tenant: bytes = DEFAULT_TENANT
    ) -> None:
        """:meth:`_store_in_map`, keeping the file system under the tier from filling up: LMDB
        needs free pages even to evict (a full file system fails every write transaction, the
        evicting ones too). When its free space runs low while the tier still means to grow (a
        budget larger than the file system allows), the budget shrinks below what the tier holds,
        so eviction frees pages inside its file for the writes that follow."""
        self._keep_file_system_room(len(stored))
        self._store_in_map(key, kb, head, stored, tenant)

    def _keep_file_system_room(self, nbytes: int) -> None:
        # The file system is asked again once this process has written half of what was free
        # at the last answer (a statvfs per small write would cost a few percent of it).
        self._unchecked -= nbytes
        if self._unchecked > 0:
            return
        free = free_bytes(self.config.path)
        if free is None:
            return
        reserve = _FS_RESERVE_WRITES * nbytes + _FS_SLACK
        self._unchecked = (free - reserve) // 2
        if free >= reserve:
            return
        used = self.usage().bytes_used
        if self._held_at_shrink is not None and used + nbytes <= self._held_at_shrink:
            return  # within what its file held when the budget last shrank: freed pages do
        self._held_at_shrink = used
        if self._budget > int(_SHRINK * used):
            self._set_budget(
                max(nbytes, int(_SHRINK * used)),
                f"the file system at {self.config.path} is almost full "
                f"({free} bytes free, {used} bytes held by this tier)",
            )

    def _store_in_map(
        self, key: ObjectKey, kb: bytes, head: bytes, stored: Any, tenant: bytes = DEFAULT_TENANT
    ) -> None:
        nbytes = len(stored)
        extra = 0
        try:
            with self._write_lock:
                for attempt in range(_MAP_FULL_RETRIES + 1):
                    try:
                        # Most puts fit below the high watermark: one transaction, no eviction.
                        if extra or not self._insert(kb, head, stored, tenant, limit=self._high):
                            self._make_room(kb, nbytes, extra, tenant)
                            self._insert(kb, head, stored, tenant, limit=None)
                    except lmdb.MapFullError:
                        # The txn is dead and already aborted. Free another 10% of the budget in
                        # its own committed txn (pages are reusable only after that).
                        log.warning(
                            "LMDB map full at %s (attempt %d); evicting more",
                            self.config.path,
                            attempt + 1,
                        )
                        extra += self._budget // 10
                        continue
                    self.stats.put(nbytes, keys=(key,))
                    with self._state_lock:
                        count_tenant(self._tenant_puts, tenant)
                    return
        except lmdb.MapFullError as exc:
            # Even the eviction txn found no page to copy-on-write into.
            self.stats.add("skipped")
            raise TierFullError(
                f"the LMDB map at {self.config.path} is full and eviction could not make room; "
                "raise the disk map headroom or the budget"
            ) from exc
        except lmdb.Error as exc:
            raise self._translate(exc, "write") from exc
        self.stats.add("skipped")
        raise TierFullError(
            f"the LMDB map at {self.config.path} stayed full after evicting "
            f"{extra} extra bytes; raise the disk map headroom (fragmentation of mixed value sizes)"
        )

    def _insert(self, kb: bytes, head: bytes, stored: Any, tenant: bytes, *, limit: int | None) -> bool:
        """Write ``kb``'s records in one transaction (:meth:`RecordStore.insert
        <tiercache.l2_disk.store.RecordStore.insert>`) and queue its touch if it kept its place.

        With ``limit`` set, writes nothing and returns ``False`` if usage afterwards would exceed
        it (the caller then evicts first). Caller holds ``_write_lock``.
        """
        if len(self._touched) >= _TOUCH_BACKLOG:
            # Before reading the old meta: applying touches moves seqs.
            with self._env.begin(write=True, buffers=True) as ttxn:
                self._apply_touches(ttxn)
        txn = self._env.begin(write=True)  # small gets as bytes: cheaper than tracked buffers
        try:
            placed = self._records.insert(txn, kb, head, stored, tenant, limit)
            if placed == OVER_LIMIT:
                txn.abort()
                return False
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        if placed == KEPT_SEQ:
            with self._state_lock:
                self._touched[kb] = None
        return True

    def _make_room(self, kb: bytes, nbytes: int, extra: int, tenant: bytes = DEFAULT_TENANT) -> None:
        """Evict oldest-first in its own committed txn so that ``kb`` (``nbytes``) fits.

        Eviction starts when the insert would pass the high watermark (or when ``extra`` bytes more
        are asked for after ``MDB_MAP_FULL``) and stops at the low watermark. Caller holds
        ``_write_lock``. Raises :class:`TierFullError` (evicting nothing) if even evicting every
        evictable object would not fit the budget.
        """
        high = int(self.config.high_watermark * self._budget)
        low = int(self.config.low_watermark * self._budget)
        records = self._records
        evicted = 0
        with self._env.begin(write=True, buffers=True) as txn:
            self._apply_touches(txn)  # so the LRU order below is current
            used = records.used(txn)
            after = used - records.stored_len(txn, kb) + nbytes
            if after <= high and extra == 0:
                return  # commits the touches, if any
            freed, evicted, over_quota = self._evict_in(txn, kb, after, max(0, low - extra), tenant, nbytes)
            if after - freed > self._budget:
                self.stats.add("skipped")
                if over_quota:
                    raise TierFullError(  # the `with` aborts: nothing was evicted
                        f"no room for {nbytes} bytes of tenant {tenant_label(tenant)} in the disk tier "
                        f"at {self.config.path}: it is over its quota of {self._quotas.quota(tenant)} "
                        "bytes and the other tenants are within theirs; raise its share "
                        "(--disk-tenant-quotas) or --disk-size-gb"
                    )
                raise TierFullError(  # the `with` aborts: nothing was evicted
                    f"no room for {nbytes} bytes in the disk tier at {self.config.path}: "
                    f"{after - freed - nbytes} bytes are pinned (budget {self._budget}); release "
                    "pins or raise --disk-size-gb"
                )
            records.set_used(txn, used - freed)
        if evicted:
            self._nudge()

    def _evict_in(
        self,
        txn: lmdb.Transaction,
        keep: bytes,
        after: int,
        target: int,
        requester: bytes = DEFAULT_TENANT,
        nbytes: int = 0,
    ) -> tuple[int, int, bool]:
        """Delete LRU objects in ``txn`` until ``after`` (usage once the insert is done) is at most
        ``target``; return (stored bytes freed, objects deleted, whether ``requester`` was over its
        quota). ``keep`` is never evicted.

        With tenant quotas (some share below 1) the walk goes in two passes, as L1's
        (:mod:`tiercache.l1.tenants`): first only objects of tenants over their quota (each down to
        it) and, when the requester (the tenant of the object being put, ``nbytes``) would be over
        its own, every object of the requester; then, only for a requester within its quota, the
        plain LRU order. A requester over its quota never evicts a tenant within its quota. Each
        pass is one walk of the recency records, oldest first: a batch evicts down to the low
        watermark, so the walk is paid once per batch, not per put.
        """
        with self._state_lock:
            pinned = set(self._pins)
        walk = EvictionWalk(
            txn,
            self._dbs,
            keep,
            pinned,
            after,
            target,
            self._records.tenant_of,
            self._records.stored_len,
            self._on_evict,
            lambda: self.stats.add("errors"),
        )
        over_quota = False
        if self._quotas.enforcing:
            held = {t: n for t, (n, _) in self._records.tenant_totals(txn).items()}
            quota = self._quotas.quota
            over_quota = held.get(requester, 0) + nbytes > quota(requester)
            over = {t for t, n in held.items() if n > quota(t)}
            if over_quota or over:

                def may_go(tenant: bytes, size: int) -> bool:
                    if not (tenant == requester and over_quota) and held.get(tenant, 0) <= quota(tenant):
                        return False
                    held[tenant] = held.get(tenant, 0) - size
                    return True

                walk.run(may_go)
        if not over_quota and walk.after > target:
            walk.run()
        self._delete_chosen(txn, walk)
        return after - walk.after, len(walk.victims) + len(walk.corrupt), over_quota

    def _delete_chosen(self, txn: lmdb.Transaction, walk: EvictionWalk) -> None:
        """Delete in ``txn`` what ``walk`` chose (its stale recency records too) and count it."""
        for seqb in walk.stale:
            txn.delete(recency_key(seqb), db=self._meta_db)
        evicted_of: Counter[bytes] = Counter()
        for kb, size, tenant in walk.victims:
            evicted_of[tenant] += 1
            self._records.delete(txn, kb, size)
        for kb in walk.corrupt:
            self._records.delete(txn, kb)
        if walk.victims:
            self.stats.evicted(
                EvictionReason.CAPACITY,
                len(walk.victims),
                keys=[ObjectKey.from_bytes(kb) for kb, _, _ in walk.victims] if self.stats.listener else (),
            )
            with self._state_lock:
                for tenant, n in evicted_of.items():
                    count_tenant(self._tenant_evictions, tenant, n)
        if walk.corrupt:
            self.stats.add("verify_failures", len(walk.corrupt))
            self.stats.evicted(
                EvictionReason.CORRUPT,
                len(walk.corrupt),
                keys=[ObjectKey.from_bytes(kb) for kb in walk.corrupt],
            )

    def _nudge(self) -> None:
        """Commit one tiny write so that pages freed by the previous txn become reusable."""
        with self._env.begin(write=True) as txn:
            txn.put(INFO_SEQ, txn.get(INFO_SEQ, db=self._meta_db) or b64(0), db=self._meta_db)

    # -- reads -------------------------------------------------------------------------------------
    def contains(self, key: ObjectKey) -> bool:
        """Whether ``key`` has a meta record. One short read txn; does not verify the payload."""
        env = self._env_here()
        try:
            with env.begin(db=self._dbs["meta"]) as txn:
                return txn.get(key.to_bytes(), db=self._dbs["meta"]) is not None
        except lmdb.Error as exc:
            raise self._translate(exc, "lookup") from exc

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Presence of each key, in one read txn (no verification)."""
        env = self._env_here()
        meta_db = self._dbs["meta"]
        try:
            with env.begin(db=meta_db) as txn:
                return [txn.get(key.to_bytes(), db=meta_db) is not None for key in keys]
        except lmdb.Error as exc:
            raise self._translate(exc, "lookup") from exc

    def lookup_prefix(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading ``keys`` are present, in one read txn (no verification)."""
        env = self._env_here()
        meta_db = self._dbs["meta"]
        try:
            with env.begin(db=meta_db) as txn:
                for i, key in enumerate(keys):
                    if txn.get(key.to_bytes(), db=meta_db) is None:
                        return i
        except lmdb.Error as exc:
            raise self._translate(exc, "lookup") from exc
        return len(keys)

    def _read(self, key: ObjectKey, kb: bytes, count: bool = True) -> _Found | None:
        """Open a read txn and fetch ``kb``'s header and stored bytes; ``None`` (txn closed, a
        miss counted if ``count``) if absent. Returns ``(txn, header, data, meta seen, data size,
        problem)``; the caller verifies the payload and ends the txn."""
        try:
            txn = self._env.begin(buffers=True)
        except lmdb.Error as exc:
            raise self._translate(exc, "read") from exc
        dbs = self._dbs
        try:
            meta = txn.get(kb, db=dbs["meta"])
            data = txn.get(kb, db=dbs["data"])
        except lmdb.Error as exc:
            txn.abort()
            raise self._translate(exc, "read") from exc
        if meta is None and data is None:
            txn.abort()
            if count:
                self.stats.add("misses")
            return None
        seen_meta = None if meta is None else bytes(meta)
        size = 0 if data is None else len(data)
        header: FrameHeader | None = None
        problem: str | None = None
        if meta is None:
            problem = "payload without a meta record"
        elif data is None:
            problem = "meta record without a payload"
        elif len(meta) != META_BYTES:
            problem = f"meta record of {len(meta)} bytes"
        else:
            try:
                header = FrameHeader.decode(meta_header(meta), key)
            except FrameError as exc:
                problem = str(exc)
        return txn, header, data, seen_meta, size, problem

    def _hit(self, kb: bytes, nbytes: int) -> None:
        with self._state_lock:
            self._touched[kb] = None
        self.stats.hit(nbytes)

    def pin(self, key: ObjectKey, *, count: bool = True) -> ReadHandle | None:
        """Verify ``key`` and return a zero-copy view into the map, valid until :meth:`release`.

        Opens a read txn that stays open until release or lease expiry (``lease_ttl_s``): copy the
        bytes out and release at once, since an open read txn stops LMDB from reusing pages.
        Verification reads every stored byte (xxh3, several GB/s). A compressed object is
        decompressed into process memory and holds no txn. A corrupt object is deleted, counted and
        reported as a miss. To copy into a buffer of your own, :meth:`read_into` is faster.
        ``count=False``: neither a hit nor a miss, and no recency touch (see :meth:`Tier.pin`).
        """
        self._env_here()
        self._sweep()
        kb = key.to_bytes()
        found = self._read(key, kb, count)
        if found is None:
            return None
        txn, header, data, seen_meta, size, problem = found
        payload: bytes | memoryview | None = None
        if header is not None:
            try:
                payload = verify_payload(header, data)
            except FrameError as exc:
                problem = str(exc)
        if problem is not None or payload is None or header is None:
            txn.abort()
            self._drop_corrupt(key, kb, seen_meta, size, problem or "unreadable")
            return None
        if isinstance(payload, bytes):  # decompressed: ours, no need to hold the snapshot
            txn.abort()
            view, lease_txn = memoryview(payload), None
        else:
            view, lease_txn = payload, txn
        expires_at = self._clock() + self.config.lease_ttl_s
        with self._state_lock:
            token = self._token()
            self._leases[token] = _Lease(kb, lease_txn, expires_at)
            self._pins[kb] += 1
        if count:
            self._hit(kb, view.nbytes)
        # An uncompressed frame's checksum is the payload's digest (a decompressed one: unknown).
        return ReadHandle(key, view, token, expires_at, None if header.flags else header.checksum)

    def read_into(self, key: ObjectKey, alloc: Callable[[int], memoryview]) -> int | None:
        """Copy the verified payload of ``key`` into ``alloc(payload length)`` and return its
        digest; ``None`` on a miss.

        An uncompressed payload is copied first and verified *in the destination*, while it is still
        in the CPU cache (measured ~10-20% faster than verifying the map and then copying). So after
        a ``None`` for which ``alloc`` was called, the destination holds unverified bytes: callers
        pass an invisible reservation (an L1 slot) and abort it. A destination that fails while the
        stored payload is intact was written by someone else during the copy (an L1 slot is shared
        memory): :class:`IntegrityError`, and the object stays. The read txn ends before returning.
        No write txn: the recency touch is queued (see :meth:`flush`).
        """
        self._env_here()
        self._sweep()
        kb = key.to_bytes()
        try:
            txn = self._env.begin(buffers=True)
        except lmdb.Error as exc:
            raise self._translate(exc, "read") from exc
        # The common case inline (uncompressed, intact header of this key): one header parse, no
        # FrameHeader, no result tuple; measured ~3 us of a ~25 us 256 KiB read. Anything else takes
        # the general path below, which re-reads in a fresh txn and names the problem.
        corrupt: tuple[bytes, int, str] | None = None
        try:
            try:
                meta = txn.get(kb, db=self._meta_db)
                data = txn.get(kb, db=self._data_db)
            except lmdb.Error as exc:
                raise self._translate(exc, "read") from exc
            fields = (
                plain_header_fields(meta, kb)
                if meta is not None and data is not None and len(meta) == META_BYTES
                else None
            )
            if fields is not None and meta is not None and data is not None and len(data) == fields[0]:
                dst = alloc(fields[0])
                dst[:] = data
                if checksum(dst) != fields[1]:
                    if checksum(data) == fields[1]:  # ours is intact: the destination was written
                        raise _scribbled(key)
                    corrupt = (bytes(meta), len(data), "payload checksum mismatch")
        finally:
            txn.abort()
        if fields is None or data is None or len(data) != fields[0]:
            if meta is None and data is None:
                self.stats.add("misses")
                return None
            return self._read_into_general(key, kb, alloc)
        if corrupt is not None:
            self._drop_corrupt(key, kb, *corrupt)
            return None
        self._hit(kb, fields[0])
        return fields[1]

    def _read_into_general(self, key: ObjectKey, kb: bytes, alloc: Callable[[int], memoryview]) -> int | None:
        """:meth:`read_into` for every case: compressed frames, misses and damaged records."""
        found = self._read(key, kb)
        if found is None:
            return None
        txn, header, data, seen_meta, size, problem = found
        digest: int | None = None
        try:
            if header is not None and problem is None:
                if header.flags & ZSTD_FLAG:
                    payload = verify_payload(header, data)
                    digest = checksum(payload)  # of the decompressed bytes: this process's own
                    alloc(len(payload))[:] = payload
                elif len(data) != header.stored_len or header.payload_len != header.stored_len:
                    problem = f"payload truncated: {len(data)} of {header.stored_len} bytes"
                else:
                    dst = alloc(header.payload_len)
                    dst[:] = data
                    digest = header.checksum
                    if checksum(dst) != header.checksum:
                        if checksum(data) == header.checksum:
                            raise _scribbled(key)
                        problem = "payload checksum mismatch"
        except FrameError as exc:
            problem = str(exc)
        finally:
            txn.abort()
        if problem is not None or header is None:
            self._drop_corrupt(key, kb, seen_meta, size, problem or "unreadable")
            return None
        self._hit(kb, header.payload_len)
        return digest

    def release(self, handle: ReadHandle) -> None:
        """End a pin and its read txn. Harmless twice or after expiry. Cheap."""
        with self._state_lock:
            lease = self._leases.pop(handle.token, None)
            if lease is not None:
                self._unpin(lease.key_bytes)
        if lease is not None and lease.txn is not None:
            lease.txn.abort()

    # -- management ----------------------------------------------------------------------------
    def delete(self, key: ObjectKey) -> bool:
        """Remove ``key`` in one write txn. A pinned reader keeps its (MVCC) view until release."""
        self._env_here()
        kb = key.to_bytes()
        try:
            with self._write_lock, self._env.begin(write=True, buffers=True) as txn:
                present = txn.get(kb, db=self._meta_db) is not None
                if present or txn.get(kb, db=self._data_db) is not None:
                    records = self._records
                    records.set_used(txn, records.used(txn) - records.delete(txn, kb))
        except lmdb.Error as exc:
            raise self._translate(exc, "delete") from exc
        if present:
            self.stats.evicted(EvictionReason.DELETED, keys=(key,))
        return present

    def usage(self) -> TierUsage:
        """Persisted stored-byte total, budget and object count. One short read txn."""
        env = self._env_here()
        try:
            with env.begin() as txn:
                used = self._records.used(txn)
                # The data sub-database holds exactly one record per object (meta also holds the
                # recency and info records).
                objects = txn.stat(self._dbs["data"])["entries"]
        except lmdb.Error as exc:
            raise self._translate(exc, "stat") from exc
        return TierUsage(used, self._budget, objects)

    def tenants(self) -> dict[str, dict[str, int]]:
        """Per tenant: stored bytes and objects (persisted, so they survive restarts), its quota,
        and this process's evictions for room and puts. One short read txn, O(named tenants)."""
        env = self._env_here()
        try:
            with env.begin() as txn:
                totals = self._records.tenant_totals(txn)
        except lmdb.Error as exc:
            raise self._translate(exc, "stat") from exc
        with self._state_lock:
            puts, evictions = dict(self._tenant_puts), dict(self._tenant_evictions)
        out: dict[str, dict[str, int]] = {}
        for tenant in {*totals, *puts, *evictions}:
            held, count = totals.get(tenant, (0, 0))
            if tenant == DEFAULT_TENANT and not (held or count or tenant in puts or tenant in evictions):
                continue
            out[tenant_label(tenant)] = {
                "bytes": held,
                "objects": count,
                "quota_bytes": self._quotas.quota(tenant),
                "evictions": evictions.get(tenant, 0),
                "puts": puts.get(tenant, 0),
            }
        return out

    def _scan(self, db_name: str) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs of one sub-database; see :func:`scan_records`."""
        try:
            yield from scan_records(self._env_here(), self._dbs[db_name], objects_only=db_name == "meta")
        except lmdb.Error as exc:
            raise self._translate(exc, "scan") from exc

    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every committed key, in key order (so one fingerprint's objects come together)."""
        for kb, _meta in self._scan("meta"):
            yield ObjectKey.from_bytes(kb)

    def iter_keys_by_use(self) -> Iterator[ObjectKey]:
        """Every committed key, most recently used first: the LRU records walked from the young end,
        in batches of short read txns like :meth:`iter_keys`. Touches not yet applied (at most one
        ``sync_interval_s`` old) still count at their older place; records a touch left stale are
        skipped, so each key comes once."""
        try:
            for kb in scan_by_use(self._env_here(), self._meta_db):
                yield ObjectKey.from_bytes(kb)
        except lmdb.Error as exc:
            raise self._translate(exc, "scan") from exc

    # -- manifests -----------------------------------------------------------------------------
    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        """Replace ``on_evict`` (see the class docstring); waits for a running eviction."""
        self._env_here()
        with self._write_lock:  # never swap the callback in the middle of an eviction
            self._on_evict = listener

    def put_manifest(self, fingerprint: Fingerprint, data: bytes) -> None:
        """Store the manifest (``LayoutManifest.canonical()``) of ``fingerprint``. One write txn.

        Manifests do not count against the byte budget and are never evicted (they are tiny).
        """
        self._env_here()
        try:
            with self._write_lock, self._env.begin(write=True) as txn:
                txn.put(fingerprint.raw, bytes(data), db=self._dbs["manifests"])
        except lmdb.Error as exc:
            raise self._translate(exc, "manifest write") from exc

    def get_manifest(self, fingerprint: Fingerprint) -> bytes | None:
        """The stored manifest for ``fingerprint``, or ``None``. One short read txn."""
        env = self._env_here()
        try:
            with env.begin() as txn:
                return txn.get(fingerprint.raw, db=self._dbs["manifests"])
        except lmdb.Error as exc:
            raise self._translate(exc, "manifest read") from exc

    def iter_manifests(self) -> Iterator[tuple[Fingerprint, bytes]]:
        """Every stored ``(fingerprint, manifest bytes)``, in fingerprint order."""
        for raw, data in self._scan("manifests"):
            yield Fingerprint(raw), data

    def put_state(self, name: str, data: bytes) -> bool:
        """Keep the engine's ``name`` state in one write txn; it counts against neither the byte
        budget nor the objects, and replaces the last one. ``False`` (logged) when LMDB refuses it
        (the map is full): the state is a hint the next process can do without."""
        self._env_here()
        try:
            with self._write_lock, self._env.begin(write=True) as txn:
                txn.put(state_key(name), bytes(data), db=self._meta_db)
        except lmdb.Error as exc:
            log.warning(
                "disk tier at %s could not keep the %s state (%d bytes): %s",
                self.config.path,
                name,
                len(data),
                exc,
            )
            return False
        return True

    def get_state(self, name: str) -> bytes | None:
        """The ``name`` state last kept here, or ``None``. One short read txn."""
        env = self._env_here()
        try:
            with env.begin() as txn:
                return txn.get(state_key(name), db=self._meta_db)
        except lmdb.Error as exc:
            raise self._translate(exc, "state read") from exc

    def __repr__(self) -> str:
        return f"DiskTier(path={str(self.config.path)!r}, budget={self._budget})"


__all__ = ["DISK_FORMAT_VERSION", "DiskTier"]
