"""What the disk tier's read and write paths share (:class:`DiskCore`).

The open environment and its record store, the locks, the in-memory tables (leases, pins, pending
recency touches, per-tenant counters), the byte budget, the background sync thread, fork handling
and close. :class:`~tiercache.l2_disk.reads.DiskReads` and :class:`~tiercache.l2_disk.writes.DiskWrites`
build on it, and :class:`~tiercache.l2_disk.tier.DiskTier` on both: one object, so every path sees
the same state under the same two locks.

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
from collections.abc import Callable
from dataclasses import dataclass

import lmdb

from tiercache.config.parts import DiskConfig
from tiercache.config.units import MiB
from tiercache.errors import DiskTierError
from tiercache.keys.object_key import ObjectKey
from tiercache.l2_disk.environment import file_system_room, open_environment
from tiercache.l2_disk.store import RecordStore
from tiercache.tier.contract import EvictionListener, Tier
from tiercache.tier.quotas import TenantQuotas
from tiercache.tier.staging import StagedWrites
from tiercache.tier.stats import EvictionReason

log = logging.getLogger(__name__)

#: The share of the file system's room (free space plus this tier's file) a budget may take at
#: start: LMDB's file holds more than the stored bytes (pages, the B-tree, the free list).
_FS_SHARE = 0.8
_SWEEP_EVERY_S = 0.05


@dataclass(slots=True)
class Lease:
    """A pin's hold on ``key_bytes`` until :meth:`~tiercache.l2_disk.reads.DiskReads.release` or
    ``expires_at`` (clock time)."""

    key_bytes: bytes
    txn: lmdb.Transaction | None  # None when the payload was decompressed into our own memory
    expires_at: float


class DiskCore(Tier):
    """The state, lifecycle and shared helpers of :class:`~tiercache.l2_disk.tier.DiskTier`."""

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
        self._leases: dict[int, Lease] = {}
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
        expired: list[Lease] = []
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
