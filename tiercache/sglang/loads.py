"""The load path of :class:`~tiercache.sglang.storage.TierCacheStorage`: pages pinned in L1 in
one round trip (or, for pages ``batch_exists`` asked about just before, its held ticket's slots),
a lookup that promotes from disk or S3 for a part not wholly in L1, each slot copied straight into
its page of the host pool and checked against its digest, then released; the leading run of hits
is what is reported loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolTransfer

from tiercache.client.client import Client
from tiercache.client.transfer import Load
from tiercache.keys.object_key import ObjectKey
from tiercache.sglang.backend import StorageBase
from tiercache.sglang.held import HeldLookup
from tiercache.sglang.keys import KV_POOL
from tiercache.sglang.pools import FlatPage, Sink
from tiercache.wire import protocol as p


class LoadPath(StorageBase):
    """SGLang's load calls (``batch_get_v1``, ``batch_get_v2``, ``get``, ``batch_get``)."""

    def _load(self, parts: Sequence[tuple[str, list[ObjectKey], Sequence[Sink]]]) -> list[int] | None:
        """Load each part ``(pool, objects, sinks)``; how many of each part's leading pages were
        loaded, or ``None`` when the server was away.

        One pin for every part's objects (the common case: all in L1, answered on the server's
        request loop), the copies, one release that says which leases expired during the copy. A part
        not wholly in L1 then gets one lookup of its own, which pins its leading run of hits after
        promoting them from disk or S3.
        """

        def load(client: Client) -> list[int]:
            everything = [o for _, objects, _ in parts for o in objects]
            transfer = Load.pin(client, everything)
            loaded = [0] * len(parts)
            whole: list[int] = []  # the parts wholly in L1, copied under the pin
            at = 0
            cuts: list[int] = []  # where each part's slots start
            for n, (_, objects, _) in enumerate(parts):
                cuts.append(at)
                if all(s is not None for s in transfer.slots[at : at + len(objects)]):
                    whole.append(n)
                at += len(objects)
            corrupt: list[int] = []
            try:
                for n in whole:
                    loaded[n], bad = self._copy_in(transfer, cuts[n], parts[n][2])
                    corrupt += bad
            finally:
                # Reports the corrupt copies; a copy done well inside its leases needs no reply.
                lost = transfer.finish(corrupt)
            for n in whole:
                # A slot whose lease expired may have been reused: a miss from there on.
                loaded[n] = next((i for i in range(loaded[n]) if cuts[n] + i in lost), loaded[n])
            for n, (name, objects, sinks) in enumerate(parts):
                if n not in whole:
                    loaded[n] = self._load_looked_up(client, self._refs[name], objects, sinks)
            return loaded

        return self._call("loading SGLang pages", load) if parts else []

    def _load_looked_up(
        self, client: Client, ref: p.GroupRef, objects: Sequence[ObjectKey], sinks: Sequence[Sink]
    ) -> int:
        """A lookup pins the leading run of hits of one pool (promoting them from disk/S3), the
        copies, the ticket's release; how many were copied."""
        sent_at = client.clock()
        found = client.lookup([o.prefix_hash for o in objects], [ref], max_chunks=len(objects))
        if not found.chunks or not found.ticket:
            return 0
        try:
            if found.pending:
                found = client.wait_ticket(found.ticket, timeout=self.settings.link.timeout_s)
            return self._copy_ticket(client, found, objects, sinks, sent_at) or 0
        finally:
            client.release_ticket(found.ticket)

    def _copy_ticket(
        self,
        client: Client,
        reply: p.LookupReply,
        objects: Sequence[ObjectKey],
        sinks: Sequence[Sink],
        sent_at: float,
    ) -> int | None:
        """Copy the leading ``objects`` from the slots a lookup (sent at ``sent_at``) had its ticket
        pin, each copy checked; how many leading pages were copied and checked (0 when the copy may
        have outlived the ticket's leases), or ``None`` when the ticket is not READY, its slots are
        in another arena than the one mapped (a restarted server's: the offsets mean nothing there),
        or a copy could no longer start in the leases' window."""
        if reply.state is not p.TicketStateName.READY:
            return None
        by_key = {s.key: s for s in reply.slots}
        ready = [by_key.get(o.to_bytes()) for o in objects[: reply.ready_chunks]]
        transfer = Load.adopt(client, client.arena(), reply.arena, ready, sent_at)
        if transfer is None:
            return None
        copied, corrupt = self._copy_in(transfer, 0, sinks)
        lost = transfer.finish(corrupt)
        return 0 if lost else copied  # a lease may have ended during the copy: another object by now

    def _load_held(
        self, client: Client, held: HeldLookup, objects: Sequence[ObjectKey], sinks: Sequence[Sink]
    ) -> int | None:
        """Copy ``objects`` from the slots of ``held``, the ticket of the ``batch_exists`` that asked
        for them (no pin of our own); how many leading pages were copied, 0 when the copy may have
        outlived the ticket's leases, or ``None`` when the ticket cannot be used (another connection
        or arena, too old, its promotion failed): then the caller pins. Releases the ticket."""
        if client is not held.client or not held.usable():
            held.release()
            return None
        reply = held.reply
        if reply.pending:
            reply = client.wait_ticket(reply.ticket, timeout=self.settings.link.timeout_s)
        copied = self._copy_ticket(client, reply, objects, sinks, held.sent_at)
        held.release(read=bool(copied))
        return copied

    def _load_pages(self, keys: Sequence[str], pages: Sequence[Sink]) -> list[bool]:
        """Load KV ``keys`` into ``pages`` (counted); the leading run of hits is ``True``. Pages a
        ``batch_exists`` asked about just before come from its ticket's slots, others are pinned."""
        got = None
        self._held.sweep()
        if KV_POOL in self._refs:
            objects = self._objects(KV_POOL, keys)
            held = self._held.take([o.prefix_hash for o in objects])
            copied = None
            if held is not None:
                copied = self._call(
                    "loading SGLang pages", lambda c: self._load_held(c, held, objects, pages)
                )
            got = [copied] if copied is not None else self._load([(KV_POOL, objects, pages)])
        if got is None:
            self._count(unavailable=1)
        loaded = got[0] if got else 0
        self._count(loaded=loaded, load_missed=len(keys) - loaded)
        return [i < loaded for i in range(len(keys))]

    def _copy_in(self, transfer: Load, first: int, pages: Sequence[Sink]) -> tuple[int, list[int]]:
        """Copy the slots of ``transfer`` from ``first`` on into ``pages``, in order, each copy
        checked against its digest, up to the first that is missing, of another size or fails its
        check. How many were copied, and the slots whose check failed (to report)."""
        arena = self._arena_view(transfer.arena)
        slots = transfer.slots[first : first + len(pages)]
        for i, (slot, page) in enumerate(zip(slots, pages)):
            if slot is None:
                return i, []
            src = arena[slot.offset : slot.offset + slot.nbytes]
            if isinstance(page, FlatPage):
                if slot.nbytes != page.nbytes:
                    return i, []
                check = transfer.check(first + i)
                page.write(src)
            else:
                if slot.nbytes != page.numel() * page.element_size():
                    return i, []
                check = transfer.check(first + i)
                page.copy_(src.view(page.dtype).view(page.shape))
            check.copied(0, slot.nbytes)  # the slot was just read: still in cache
            if not check.ok():
                self._count(corrupt=1)
                return i, [first + i]
        return min(len(slots), len(pages)), []

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load ``keys`` into the host pool's pages at ``host_indices``; the leading run of hits is
        ``True``, everything from the first miss ``False``."""
        pages = self._pages(host_indices, len(keys))
        if pages is None:
            self._count(load_missed=len(keys))
            return [False] * len(keys)
        return self._load_pages(keys, pages)

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Load each transfer's pages into its pool at ``host_indices``; per pool, the leading run
        of hits is ``True`` (SGLang counts each pool's leading run)."""
        results: dict[Any, list[bool]] = {}
        parts: list[tuple[str, list[ObjectKey], Sequence[Sink]]] = []
        moving: list[PoolTransfer] = []
        for transfer in transfers:
            keys = list(transfer.keys or [])
            pool = self._transfer_pool(transfer)
            host = transfer.host_indices
            starts = pool.starts(host, len(keys)) if pool is not None and host is not None else None
            if pool is None or starts is None or pool.name not in self._refs or not keys:
                results[transfer.name] = [False] * len(keys)
                continue
            parts.append((pool.name, self._objects(pool.name, keys), pool.sinks(starts)))
            moving.append(transfer)
        got = self._load(parts) if parts else []
        if got is None:
            self._count(unavailable=1)
            got = [0] * len(parts)
        for transfer, loaded in zip(moving, got, strict=True):
            n = len(transfer.keys or [])
            self._count(loaded=loaded, load_missed=n - loaded)
            results[transfer.name] = [i < loaded for i in range(n)]
        return results

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Load ``key`` into the flat tensor ``target_location``; it, or ``None`` on a miss."""
        if not isinstance(target_location, torch.Tensor):
            raise TypeError("tiercache: get() needs target_location, the tensor to load the page into")
        return target_location if self._load_pages([key], [target_location])[0] else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """:meth:`get` of each key into its target tensor (one round trip for all)."""
        targets = list(target_locations or [])
        if len(targets) != len(keys):
            raise TypeError(f"tiercache: batch_get() got {len(keys)} keys but {len(targets)} target tensors")
        done = self._load_pages(keys, targets)
        return [t if ok else None for t, ok in zip(targets, done)]
