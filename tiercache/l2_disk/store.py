"""The disk tier's records of each object, and the totals they count in, inside a caller's transaction.

:class:`RecordStore` keeps the records of :mod:`tiercache.l2_disk.records` consistent with each
other: an object's data, meta, recency and tenant records are written and deleted together, with
the usage total and its tenant's totals. It opens no transaction and takes no lock: the tier begins
and ends every transaction (a write one under its ``_write_lock``) and hands it in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import lmdb

from tiercache.keys.tenant import DEFAULT_TENANT
from tiercache.l2_disk.records import (
    INFO_SEQ,
    INFO_USED,
    b64,
    may_have_tenant,
    meta_header,
    meta_record,
    meta_seq,
    meta_stored_len,
    named_seq,
    named_tenant_totals,
    pack_totals,
    recency_key,
    tenant_key,
    totals_key,
    u64,
    unpack_totals,
    with_seq,
)

# What RecordStore.insert did. Plain ints, not an enum: on Python 3.11 an enum member costs ~50 ns a
# lookup, and a put made three (~0.15 us, ~1% of a small put).
#: Nothing written: usage afterwards would have passed the limit.
OVER_LIMIT: Final = 0
#: Written with the next recency seq (a new object, or one whose recency record was lost).
NEW_SEQ: Final = 1
#: Replaced in place, keeping its seq: its move to the young end is the caller's to queue.
KEPT_SEQ: Final = 2


class RecordStore:
    """The records of the sub-databases ``dbs`` (as :func:`~tiercache.l2_disk.environment.open_environment`
    returns them), read and written in the transaction each method is given."""

    def __init__(self, dbs: dict[str, Any]) -> None:
        # Recency, tenant and info records are prefixed records of the meta database.
        self._data, self._meta = dbs["data"], dbs["meta"]

    def used(self, txn: lmdb.Transaction) -> int:
        """The persisted total of stored bytes."""
        return u64(txn.get(INFO_USED, db=self._meta))

    def set_used(self, txn: lmdb.Transaction, used: int) -> None:
        """Persist the total of stored bytes (never below 0)."""
        txn.put(INFO_USED, b64(max(0, used)), db=self._meta)

    def stored_len(self, txn: lmdb.Transaction, kb: bytes) -> int:
        """Stored bytes of ``kb`` (0 if absent), from its header when that is intact.

        Reading the header avoids ``get()`` on the payload, which faults in every page of a value
        that may be cold on disk (measured: py-lmdb touches them all, even with buffers=True).
        """
        meta = txn.get(kb, db=self._meta)
        if meta is None:
            return 0
        size = meta_stored_len(meta)
        if size is not None:
            return size
        data = txn.get(kb, db=self._data)  # damaged header: measure the payload itself
        return 0 if data is None else len(data)

    def tenant_of(self, txn: lmdb.Transaction, kb: bytes, meta: Any) -> bytes:
        """The tenant of ``kb`` whose meta record is ``meta``: its flags say whether to look, unless
        the record is damaged (then the tenant record itself is asked)."""
        if not may_have_tenant(meta):
            return DEFAULT_TENANT
        found = txn.get(tenant_key(kb), db=self._meta)
        return DEFAULT_TENANT if found is None else bytes(found)

    def add_tenant(self, txn: lmdb.Transaction, tenant: bytes, nbytes: int, objects: int) -> None:
        """Change a named tenant's persisted totals (the default tenant's are derived)."""
        if not tenant:
            return
        rkey = totals_key(tenant)
        found = txn.get(rkey, db=self._meta)
        held, count = unpack_totals(found) if found is not None else (0, 0)
        held, count = max(0, held + nbytes), max(0, count + objects)
        if count == 0:
            txn.delete(rkey, db=self._meta)
        else:
            txn.put(rkey, pack_totals(held, count), db=self._meta)

    def tenant_totals(self, txn: lmdb.Transaction) -> dict[bytes, tuple[int, int]]:
        """Stored bytes and objects per tenant: the named tenants' persisted totals, and the default
        tenant's, what they leave of the usage total and the object count."""
        totals = named_tenant_totals(txn, self._meta)
        totals[DEFAULT_TENANT] = (
            max(0, self.used(txn) - sum(n for n, _ in totals.values())),
            max(0, txn.stat(self._data)["entries"] - sum(c for _, c in totals.values())),
        )
        return totals

    def delete(self, txn: lmdb.Transaction, kb: bytes, size: int | None = None) -> int:
        """Delete ``kb``'s records; return the stored bytes freed (``size`` if given). The usage
        total is the caller's to lower (a batch of deletes writes it once)."""
        freed = self.stored_len(txn, kb) if size is None else size
        meta = txn.get(kb, db=self._meta)
        tenant = self.tenant_of(txn, kb, meta)  # before any write: meta may be a buffers=True view
        seqb = None if meta is None else named_seq(meta)
        # A corrupt meta record may name another key's seq: only delete our own.
        if seqb is not None and txn.get(recency_key(seqb), db=self._meta) == kb:
            txn.delete(recency_key(seqb), db=self._meta)
        txn.delete(kb, db=self._data)
        txn.delete(kb, db=self._meta)
        if tenant:
            txn.delete(tenant_key(kb), db=self._meta)
            self.add_tenant(txn, tenant, -freed, -1)
        return freed

    def touch(self, txn: lmdb.Transaction, keys: Iterable[bytes]) -> None:
        """Move each of ``keys`` that still has a well-formed meta record to the young end of the
        LRU order, the last of ``keys`` youngest."""
        meta_db = self._meta
        seq = u64(txn.get(INFO_SEQ, db=meta_db))
        for kb in keys:
            found = txn.get(kb, db=meta_db)
            old_seq = meta_seq(found)
            if found is None or old_seq is None:
                continue
            meta = bytes(found)  # before the writes below: the txn may hand out views (buffers=True)
            if txn.get(recency_key(old_seq), db=meta_db) == kb:
                txn.delete(recency_key(old_seq), db=meta_db)
            txn.put(kb, with_seq(meta, b64(seq)), db=meta_db)
            txn.put(recency_key(b64(seq)), kb, db=meta_db)
            seq += 1
        txn.put(INFO_SEQ, b64(seq), db=meta_db)

    def insert(
        self, txn: lmdb.Transaction, kb: bytes, head: bytes, stored: Any, tenant: bytes, limit: int | None
    ) -> int:
        """Write ``kb``'s data (``stored``) and meta record (frame header ``head``), its recency
        record, the usage total and (for a named tenant) its tenant record and totals.

        Returns :data:`OVER_LIMIT` (``limit`` set and usage afterwards would exceed it: nothing
        written), :data:`NEW_SEQ` or :data:`KEPT_SEQ`.

        A new object takes the next recency seq. An existing one is replaced in place (LMDB frees
        the old payload's pages) and *keeps* its seq and recency record: its move to the young end
        is the caller's to queue as a touch, like a read's, instead of deleting and inserting a
        recency record here (that dirtied one more leaf page per overwrite, measured ~10% of a
        256 KiB put). A meta record whose recency record is missing or not its own gets a new seq.
        """
        meta_db, get, put = self._meta, txn.get, txn.put
        nbytes = len(stored)
        used = u64(get(INFO_USED, db=meta_db))
        found = get(kb, db=meta_db)
        old = None if found is None else bytes(found)
        old_len, old_tenant, seqb = 0, DEFAULT_TENANT, None
        if old is not None:
            old_tenant = self.tenant_of(txn, kb, old)
            # The same header again (a re-put of the same bytes) needs no re-verification.
            claimed = nbytes if meta_header(old) == head else meta_stored_len(old)
            if claimed is None:  # damaged header: measure the payload itself
                data = get(kb, db=self._data)
                claimed = 0 if data is None else len(data)
            old_len, seqb = claimed, meta_seq(old)
            if seqb is not None and get(recency_key(seqb), db=meta_db) != kb:
                seqb = None  # its recency record is missing or not its own: a new seq below
        after = used + nbytes - old_len
        if limit is not None and after > limit:
            return OVER_LIMIT
        placement = NEW_SEQ if seqb is None else KEPT_SEQ
        if seqb is None:
            seq = u64(get(INFO_SEQ, db=meta_db))
            seqb = b64(seq)
            put(recency_key(seqb), kb, db=meta_db)
            put(INFO_SEQ, b64(seq + 1), db=meta_db)
        put(kb, stored, db=self._data)
        meta = meta_record(head, seqb, tenant)
        if meta != old:  # rewriting identical index bytes would only dirty pages
            put(kb, meta, db=meta_db)
        if after != used:
            put(INFO_USED, b64(max(0, after)), db=meta_db)
        if tenant or old_tenant:  # the default tenant's totals are derived: nothing to write
            self._recount(txn, kb, tenant, nbytes, old is not None, old_tenant, old_len)
        return placement

    def _recount(
        self,
        txn: lmdb.Transaction,
        kb: bytes,
        tenant: bytes,
        nbytes: int,
        replaced: bool,
        old_tenant: bytes,
        old_len: int,
    ) -> None:
        """The tenant record and totals after a put of ``nbytes`` for ``tenant`` (replacing, if
        ``replaced``, ``old_len`` bytes of ``old_tenant``)."""
        if tenant != old_tenant or not replaced:
            if replaced:
                self.add_tenant(txn, old_tenant, -old_len, -1)
            self.add_tenant(txn, tenant, nbytes, 1)
            if tenant:
                txn.put(tenant_key(kb), tenant, db=self._meta)
            elif old_tenant:
                txn.delete(tenant_key(kb), db=self._meta)
        elif tenant and nbytes != old_len:
            self.add_tenant(txn, tenant, nbytes - old_len, 0)
