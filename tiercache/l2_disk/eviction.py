"""What the disk tier evicts: walks of its recency records, oldest first, choosing victims.

:class:`EvictionWalk` chooses inside one write transaction and deletes nothing: the tier deletes
what it chose (:meth:`DiskWrites._evict_in <tiercache.l2_disk.writes.DiskWrites>`), so a walk that
cannot make room leaves the transaction to be aborted with nothing evicted. A walk pass may filter
the candidates (tenant quotas: only tenants over theirs first); each pass reads the recency records
once, from the oldest, and stops once usage is down to the target.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lmdb

from tiercache.errors import FrameError
from tiercache.keys.object_key import ObjectKey
from tiercache.l2_disk.records import META_BYTES, REC, meta_header, recency_seq, stale_recency
from tiercache.tier.contract import EvictionListener
from tiercache.tier.frames import FrameHeader, verify_payload

log = logging.getLogger(__name__)

#: ``may_go(tenant, stored bytes)``: whether a pass may take this candidate.
Filter = Callable[[bytes, int], bool]


@dataclass
class EvictionWalk:
    """The victims chosen in ``txn`` to bring usage from ``after`` down to ``target``.

    ``keep`` (the object being put) and ``pinned`` objects are never chosen. ``tenant_of`` and
    ``stored_len`` read a candidate's tenant and stored size (the tier's
    :class:`~tiercache.l2_disk.store.RecordStore`);
    ``on_evict`` (write-back) is handed each victim's verified payload, and a victim it fails on
    stays (``on_evict_failed`` counts it). A candidate whose records do not verify is ``corrupt``:
    it goes too, and nobody is handed its bytes.
    """

    txn: lmdb.Transaction
    dbs: dict[str, Any]
    keep: bytes
    pinned: set[bytes]
    after: int
    target: int
    tenant_of: Callable[[lmdb.Transaction, bytes, Any], bytes]
    stored_len: Callable[[lmdb.Transaction, bytes], int]
    on_evict: EvictionListener | None = None
    on_evict_failed: Callable[[], None] = lambda: None
    #: (key bytes, stored bytes, tenant) of each victim, oldest first.
    victims: list[tuple[bytes, int, bytes]] = field(default_factory=list)
    #: Recency records left behind by a touch or a lost meta record: to delete.
    stale: set[bytes] = field(default_factory=set)
    corrupt: list[bytes] = field(default_factory=list)
    _chosen: set[bytes] = field(default_factory=set)

    def run(self, may_go: Filter | None = None) -> None:
        """One pass over the recency records, oldest first, until usage is down to the target."""
        txn, dbs = self.txn, self.dbs
        with txn.cursor(db=dbs["recency"]) as cur:
            found = cur.set_range(REC)
            while found:
                rkey, kb = bytes(cur.key()), bytes(cur.value())
                found = cur.next()
                if self.after <= self.target or not rkey.startswith(REC):
                    break
                seqb = recency_seq(rkey)
                meta = txn.get(kb, db=dbs["meta"])
                if stale_recency(meta, seqb):
                    self.stale.add(bytes(seqb))
                    continue
                assert meta is not None  # a missing meta is stale
                if kb == self.keep or kb in self.pinned or kb in self._chosen or kb in self.corrupt:
                    continue
                self._consider(kb, meta, may_go)

    def _consider(self, kb: bytes, meta: Any, may_go: Filter | None) -> None:
        """Choose ``kb`` (its ``meta`` record read) if the pass's filter and the write-back let it go."""
        key = ObjectKey.from_bytes(kb)
        try:
            if len(meta) != META_BYTES:
                raise FrameError(f"meta record of {len(meta)} bytes")
            header = FrameHeader.decode(meta_header(meta), key)
            size = header.stored_len
            tenant = self.tenant_of(self.txn, kb, meta)
            if may_go is not None and not may_go(tenant, size):
                return
            if self.on_evict is not None:  # only write-back needs the bytes read back
                data = self.txn.get(kb, db=self.dbs["data"])
                if data is None:
                    raise FrameError("payload record missing")
                size = len(data)
                payload = verify_payload(header, data)
        except FrameError:
            self.corrupt.append(kb)  # never hand corrupt bytes to the write-back
            self.after -= self.stored_len(self.txn, kb)
            return
        if self.on_evict is not None:
            try:
                self.on_evict(key, memoryview(payload))
            except Exception:
                self.on_evict_failed()
                log.exception("on_evict failed for %s; keeping it on disk", key)
                return
        self.victims.append((kb, size, tenant))
        self._chosen.add(kb)
        self.after -= size
