"""The store path of :class:`~tiercache.sglang.storage.TierCacheStorage`: every page's slot
reserved in one round trip, each page of the host pool copied straight into its slot (its digest
taken from the host pool's page, never the slot), one commit; all or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from tiercache.client.client import Client
from tiercache.client.tensors import feed
from tiercache.client.transfer import Store
from tiercache.keys.digest import Digest
from tiercache.keys.object_key import ObjectKey
from tiercache.sglang.backend import StorageBase
from tiercache.sglang.keys import KV_POOL


class StorePath(StorageBase):
    """SGLang's store calls (``batch_set_v1``, ``batch_set_v2``, ``set``, ``batch_set``)."""

    def _store(self, items: Sequence[tuple[ObjectKey, torch.Tensor]]) -> bool | None:
        """Store each ``(object, page)``: all or none (one reserve, the copies, one commit); whether
        all were stored, or ``None`` when the server was away."""

        def store(client: Client) -> int:
            store = Store.reserve(client, [(o, t.numel() * t.element_size()) for o, t in items])
            arena = self._arena_view(store.arena)

            def write(i: int, target: memoryview) -> int:
                slot, page = store.slot(i), items[i][1]
                arena[slot.offset : slot.offset + slot.nbytes].view(page.dtype).view(page.shape).copy_(page)
                digest = Digest()
                feed(digest, page)  # the host pool's page, never the slot
                return digest.value

            digests = store.fill(write)
            return 0 if digests is None else store.commit(digests)

        done = self._call("storing SGLang pages", store) if items else 0
        if done is None:
            self._count(unavailable=1)
            return None
        return done == len(items)

    def _store_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store KV ``pages`` under ``keys`` (counted); one verdict for all."""
        ok = False
        if KV_POOL in self._refs:
            ok = bool(self._store(list(zip(self._objects(KV_POOL, keys), pages))))
        else:
            self._count(unavailable=1)  # the server was never reached
        self._count(stored=len(keys) if ok else 0, store_failed=0 if ok else len(keys))
        return [ok] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages at ``host_indices`` of the host pool under ``keys``: all or none."""
        pages = self._pages(host_indices, len(keys))
        if pages is None:
            self._count(store_failed=len(keys))
            return [False] * len(keys)
        return self._store_pages(keys, pages)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages (its pool's pages at ``host_indices`` under ``keys``), every
        pool's in one reserve and one commit: all or none, reported per pool as SGLang asks."""
        results: dict[Any, list[bool]] = {}
        items: list[tuple[ObjectKey, torch.Tensor]] = []
        moving: list[PoolTransfer] = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._transfer_pool(transfer)
            host = transfer.host_indices
            starts = pool.starts(host, len(keys)) if pool is not None and host is not None else None
            if pool is None or starts is None or pool.name not in self._refs:
                results[transfer.name] = [False] * len(keys)
                continue
            items += zip(self._objects(pool.name, keys), pool.sources(starts))
            moving.append(transfer)
        ok = bool(self._store(items)) if items else not moving
        pages = sum(len(t.keys or []) for t in moving)
        self._count(stored=pages if ok else 0, store_failed=0 if ok else pages)
        for transfer in moving:
            results[transfer.name] = [ok] * len(transfer.keys or [])
        return results

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store tensor ``value`` as ``key``'s page."""
        return self._store_pages([key], [value])[0]

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store each tensor of ``values`` under its key; whether all were stored."""
        values = list(values or [])
        if len(values) != len(keys):
            raise TypeError(f"tiercache: batch_set() got {len(keys)} keys but {len(values)} values")
        return all(self._store_pages(keys, values))
