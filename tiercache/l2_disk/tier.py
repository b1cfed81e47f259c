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

The class is built in layers, one object with one set of locks (described in
:mod:`tiercache.l2_disk.core`): :class:`~tiercache.l2_disk.core.DiskCore` (the environment, locks,
in-memory tables, sync thread, fork and close), :class:`~tiercache.l2_disk.reads.DiskReads` and
:class:`~tiercache.l2_disk.writes.DiskWrites` on it, and here the rest of the contract: deletes,
usage and tenants, iteration, manifests and engine state. Records are read and written through
:class:`~tiercache.l2_disk.store.RecordStore`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import lmdb

from tiercache.keys.fingerprint import Fingerprint
from tiercache.keys.object_key import ObjectKey
from tiercache.keys.tenant import DEFAULT_TENANT, tenant_label
from tiercache.l2_disk.reads import DiskReads
from tiercache.l2_disk.records import DISK_FORMAT_VERSION, scan_by_use, scan_records, state_key
from tiercache.l2_disk.writes import DiskWrites
from tiercache.tier.contract import EvictionListener, TierUsage
from tiercache.tier.stats import EvictionReason

log = logging.getLogger(__name__)


class DiskTier(DiskReads, DiskWrites):
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
