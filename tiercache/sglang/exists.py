"""The existence checks of :class:`~tiercache.sglang.storage.TierCacheStorage`: ``batch_exists``
(one lookup; its ticket kept for the ``batch_get_v1`` that follows, :mod:`tiercache.sglang.held`)
and ``batch_exists_v2`` (SGLang's hit policies over per-pool lookups).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from tiercache.client.client import Client
from tiercache.sglang.backend import StorageBase
from tiercache.sglang.held import HeldLookup
from tiercache.sglang.keys import KV_POOL, page_hash
from tiercache.sglang.pools import UnsupportedPoolError
from tiercache.wire import protocol as p


class ExistsPath(StorageBase):
    """SGLang's existence checks (``batch_exists``, ``batch_exists_v2``, ``exists``)."""

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, the server holds (any tier); one round trip. Its
        lookup pins those pages (promoting any from disk or S3) and the ticket is kept for the
        ``batch_get_v1`` SGLang sends next for them (:mod:`tiercache.sglang.held`)."""
        self._count(exists_calls=1)
        self._held.sweep()

        def exists(client: Client) -> int:
            hashes = [page_hash(k) for k in keys]
            hold = client.lease_window_s > 0  # a server that says no lease TTL: nothing to time a copy by
            sent_at = client.clock()
            found = client.lookup(hashes, [self._refs[KV_POOL]], prefetch=hold)
            if found.ticket and found.chunks:
                page_bytes = self._pools[KV_POOL].geometry.page_bytes
                held = HeldLookup.of(client, hashes, page_bytes, found, sent_at)
                self._held.keep(held, client.arena().size)
            elif found.ticket:
                client.release_ticket_unconfirmed(found.ticket)
            return found.chunks

        hits = self._call("asking which SGLang pages exist", exists) if keys else 0
        if hits is None:
            self._count(unavailable=1)
            return 0
        return hits

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The usable prefix of ``keys`` over the KV pool and each transfer's pool, by the rules of
        SGLang's own ``HiCacheFile.batch_exists_v2`` (sglang 0.5.23):

        * the KV pool's leading run of hits, ``kv``; every prefix ``1..kv`` is a candidate;
        * ``ALL_PAGES``: a prefix ``n`` needs the pool's pages ``0..n-1`` (one lookup: its leading run);
        * ``TRAILING_PAGES`` (``w = len(transfer.keys)``, at least 1): a prefix ``n`` needs only the
          pool's pages ``n-w .. n-1`` (one single-page lookup per page below ``kv``, all in flight at
          once);

        ``kv_hit_pages`` is the longest prefix every pool allows, ``restorable_prefix_pages`` all of
        them (SGLang intersects them across TP ranks), ``extra_pool_hit_pages`` each pool's own
        longest. Any other hit policy raises :class:`UnsupportedPoolError`.
        """
        self._count(exists_calls=1)
        transfers = list(pool_transfers or [])
        for transfer in transfers:
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise UnsupportedPoolError(
                    f"tiercache: SGLang asked for pool {transfer.name} with hit policy {transfer.hit_policy}; "
                    "the tiercache backend applies all_pages and trailing_pages only"
                )

        def exists(client: Client) -> PoolTransferResult:
            hashes = [page_hash(k) for k in keys]
            refs = self._refs
            kv_pages = client.lookup(hashes, [refs[KV_POOL]], prefetch=False).chunks
            hit_count: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for transfer in transfers:
                if not restorable:
                    break
                ref = refs.get(str(transfer.name))
                if ref is None:  # never registered: no page of it can be there
                    restorable = []
                    break
                if transfer.hit_policy is PoolHitPolicy.ALL_PAGES:
                    boundary = client.lookup(hashes[:kv_pages], [ref], prefetch=False).chunks
                    allowed = set(range(1, boundary + 1))
                else:
                    window = max(1, len(transfer.keys) if transfer.keys else 1)
                    present = _present(client, ref, hashes[:kv_pages])
                    # Over every prefix up to kv, as SGLang does: a pool's own hits ignore the others'.
                    allowed = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window) : n])}
                    boundary = max(allowed, default=0)
                if boundary:
                    hit_count[transfer.name] = boundary
                restorable = [n for n in restorable if n in allowed]
            return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

        found = self._call("asking which SGLang pages exist", exists) if keys else None
        if found is None:
            if keys:
                self._count(unavailable=1)
            return PoolTransferResult(0, {}, [])
        return found

    # -- SGLang's tensor interface (without interface_v1) -----------------------------------------
    def exists(self, key: str) -> bool:
        """Whether the server holds ``key``'s page."""
        return self.batch_exists([key]) == 1


def _present(client: Client, ref: p.GroupRef, hashes: Sequence[bytes]) -> list[bool]:
    """Whether each of ``hashes`` has its object in group ``ref`` (any tier): one single-page lookup
    per hash, all sent before the first reply is read, so they cost about one round trip."""
    ids = [client.lookup_async([h], [ref], prefetch=False) for h in hashes]
    out: list[bool] = []
    for req in ids:
        reply = None
        while reply is None:
            reply = client.poll(req, wait_s=client.timeout)
        out.append(reply.chunks > 0)
    return out
